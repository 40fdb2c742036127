"""checkpoint.local_dir: a local copy of last.pt, written before the upload, and the resume rule reading it.

The background writer puts last.pt on local disk first, then uploads it; the
local file is durable seconds before the remote one. A run restarted on the
same host continues from the newer of the two (both verified); the remote
copy stays the source of truth across hosts. On a job of several hosts only
the master's host would have the local copy and the hosts would disagree on
where the run continues, so there the remote copy alone decides (and a newer
local one is named, with the command that uploads it).
"""

from __future__ import annotations

import logging
import os

from tpustream import storage
from tpustream.checkpoint import (
    LAST,
    CheckpointError,
    ResumePoint,
    checkpoint_url,
    load_checkpoint,
    local_mirror,
)

log = logging.getLogger(__name__)


def local_checkpoint_url(local_dir: str, output_dir: str, name: str = LAST) -> str:
    """Where checkpoint `name` of the run in output_dir is kept under local_dir (a folder per run folder)."""
    return local_mirror(local_dir, checkpoint_url(output_dir, name))


def position_of(state: dict) -> tuple[int, int, int]:
    """How far a checkpoint's run got: (global step, epoch, step); later positions compare greater."""
    return int(state["global_step"]), int(state["position"]["epoch"]), int(state["position"]["step"])


def newer_local(
    remote: ResumePoint | None, local_dir: str | None, output_dir: str, one_host: bool
) -> ResumePoint | None:
    """remote, or the local copy of last.pt where it is further along (and usable), as the run's resume point.

    A local copy is this run's only if its config fingerprint is the remote
    one's (or the remote has none yet: the first upload did not finish).
    """
    if local_dir is None:
        return remote
    url = local_checkpoint_url(local_dir, output_dir)
    if not os.path.exists(url):
        return remote
    try:
        state = load_checkpoint(url)
    except CheckpointError as exc:
        log.warning("checkpoint.local_dir: %s; continuing from the remote copy", exc)
        return remote
    if remote is not None:
        if state.get("config_fingerprint") != remote.state.get("config_fingerprint"):
            log.warning(
                "checkpoint.local_dir: %s belongs to another run than %s; not using it", url, remote.url
            )
            return remote
        if position_of(state) <= position_of(remote.state):
            return remote
    if not one_host:
        log.warning(
            "checkpoint.local_dir: %s is further along than %s, but a job of several hosts continues from "
            "the remote copy on every host; to continue from the local one, upload it first "
            "(gcloud storage cp %s %s)",
            url,
            checkpoint_url(output_dir, LAST),
            url,
            checkpoint_url(output_dir, LAST),
        )
        return remote
    log.warning(
        "checkpoint.local_dir: continuing from %s (global step %d), further along than %s (its upload did "
        "not finish)",
        url,
        position_of(state)[0],
        remote.url if remote is not None else f"{output_dir}'s checkpoints (none)",
    )
    return ResumePoint(url, state, own=True)


def delete_local_copies(local_dir: str | None, output_dir: str) -> list[str]:
    """Delete the run's local copies (resume=overwrite starts the run folder afresh); what was deleted."""
    if local_dir is None:
        return []
    url = local_checkpoint_url(local_dir, output_dir)
    return [url] if storage.delete(url) else []
