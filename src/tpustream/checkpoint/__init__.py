"""Checkpoints that never lose progress: what they hold, how they are written and read.

Run folder (``output_dir``, a local path or ``gs://bucket/run``)::

    checkpoints/best.pt   best reduced validation accuracy so far
    checkpoints/last.pt   every epoch, every checkpoint.every_n_steps steps, and on preemption
    config.yaml           the resolved config of the (latest) run
    metrics.jsonl         one line per epoch

A checkpoint is a plain ``torch.save`` file (``torch.load`` reads it) holding
the model, optimizer, the training position (epoch and step within it), the
partial sums of the epoch in progress, best accuracy, history, RNG states, the
config and its fingerprint, plus ``integrity``: a SHA-256 over all of that
content. torch.load does not notice flipped bytes inside tensor data; we do.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from omegaconf import OmegaConf

from tpustream import progress, storage

# The fingerprint's rules live beside the format and are part of this package's interface.
from tpustream.checkpoint.fingerprint import (  # noqa: F401  (re-exported)
    FINGERPRINT_IGNORES,
    RESUME_MAY_DIFFER,
    SHAPE_MAY_DIFFER,
    config_differences,
    config_fingerprint,
    schema_defaults,
)
from tpustream.errors import ConfigError, StorageError

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
BEST = "best.pt"
LAST = "last.pt"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
CHECKPOINT_VERSION = 2
FORCE_RESUME = "force"
# resume=overwrite: start fresh in a run folder that holds a run, deleting it
# first (resume=null refuses to: it would overwrite best.pt and metrics.jsonl).
OVERWRITE_RESUME = "overwrite"


class CheckpointError(ConfigError):
    """A checkpoint exists but cannot be used (damaged, foreign, or another version)."""


def checkpoint_url(output_dir: str, name: str) -> str:
    return storage.join(output_dir, CHECKPOINTS, name)


def local_mirror(folder: str, url: str) -> str:
    """Where url is kept under a local folder (the fallback for a failed write, checkpoint.local_dir)."""
    return os.path.join(folder, url.replace("://", "/").lstrip("/"))


def content_digest(state: Any) -> str:
    """SHA-256 over a checkpoint's content in a canonical order (without 'integrity')."""
    digest = hashlib.sha256()

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            progress.beat("a checkpoint hashed")  # a big state hashes for seconds, tensor by tensor
            tensor = value.detach().cpu().contiguous()
            digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
            # The array itself, not a bytes copy of it: hashlib reads the buffer without the GIL.
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else b"")
        elif isinstance(value, Mapping):
            digest.update(b"{")
            for key in sorted(value, key=str):
                if key == "integrity":
                    continue
                digest.update(repr(key).encode())
                visit(value[key])
            digest.update(b"}")
        elif isinstance(value, list | tuple):
            digest.update(b"[")
            for item in value:
                visit(item)
            digest.update(b"]")
        else:
            digest.update(repr(value).encode())

    visit(state)
    return digest.hexdigest()


def encode_checkpoint(host_state: dict[str, Any]) -> bytes:
    """torch.save bytes of a host (CPU) state, with its integrity digest added."""
    state = {"version": CHECKPOINT_VERSION, **host_state}
    state["integrity"] = content_digest(state)
    buffer = io.BytesIO()
    torch.save(state, progress.ProgressStream(buffer, "a checkpoint serialised"))
    return buffer.getvalue()


def decode_checkpoint(data: bytes, source: str) -> dict[str, Any]:
    """Load and verify; raises CheckpointError naming the source if it is damaged or foreign."""
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged file
        reason = "the file is empty" if not data else describe_load_error(exc)
        log.debug("%s: torch.load failed: %s", source, exc)
        # Chained: the whole of torch's message stays with the error.
        raise CheckpointError(f"{source}: damaged or not a checkpoint ({reason})") from exc
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{source}: not a tpustream checkpoint (version {CHECKPOINT_VERSION})")
    if state.get("integrity") != content_digest(state):
        raise CheckpointError(f"{source}: checksum mismatch, the file is damaged")
    return state


# The longest cause shown in a damaged checkpoint's one line; longer ones end at a word.
MAX_LOAD_ERROR_CHARS = 240


def describe_load_error(exc: Exception) -> str:
    """torch.load's error as its class and cause, in a line, cut (if at all) at a word, never inside one.

    A file that is not weights only (a pickled class) gets a paragraph whose
    first line is generic advice with terminal colour codes; the cause is its
    "WeightsUnpickler error:" sentence. Some errors carry no message at all
    (EOFError for a zero-byte file).
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()
    cause = re.search(r"WeightsUnpickler error: (.+?\.)(\s|$)", text, re.DOTALL)
    line = cause.group(1) if cause else (text.splitlines() or [""])[0]
    line = textwrap.shorten(line, MAX_LOAD_ERROR_CHARS, placeholder=" ...")
    return f"{exc.__class__.__name__}: {line}" if line else exc.__class__.__name__


def load_checkpoint(url: str) -> dict[str, Any]:
    """Read and verify a checkpoint written by write_host_state (tensors on the CPU)."""
    return decode_checkpoint(storage.read_bytes(url), url)


def write_host_state(
    url: str,
    host_state: dict[str, Any] | Callable[[], dict[str, Any]],
    fallback_dir: str | None = None,
    copies: Sequence[str] = (),
    local_first: str | None = None,
) -> list[str]:
    """Serialise, hash, write and verify a host state at url, then its copies; the master's part of a save.

    Serialised once: each copy is a copy of url's object (a hard link, a GCS
    server-side copy; storage.copy), made after url is whole, so a new best
    epoch that is also last.pt costs one write, not two. A write that fails
    after the storage client's retries is kept in fallback_dir, logged with
    where, and returned in the list (the paths kept locally); training goes on.
    local_first (checkpoint.local_dir) is written, verified, before url.
    host_state may be a function that hands the state over once: the caller
    then holds no reference, and the host copy is freed as soon as it is
    serialised (a background save holds one copy of the state, not two).
    """
    kept: list[str] = []
    data = encode_checkpoint(host_state() if callable(host_state) else host_state)
    del host_state
    if local_first is not None:
        try:
            storage.write_bytes_verified(local_first, data)
            log.info("saved %s (%.1f MB, the local copy)", local_first, len(data) / 1e6)
        except (StorageError, OSError) as exc:  # the remote copy is the one that matters
            log.warning("could not write the local copy %s (%s); writing %s", local_first, exc, url)
    written = _write_or_keep(url, data, fallback_dir, kept)
    for target in copies:
        try:
            if not written:
                raise StorageError(f"{url} was not written")
            storage.copy(url, target)
            log.info("saved %s (a copy of %s)", target, url)
        except StorageError as exc:  # the bytes are still here: write them
            log.warning("could not copy %s to %s (%s); writing it", url, target, exc)
            _write_or_keep(target, data, fallback_dir, kept)
    return kept


def _write_or_keep(url: str, data: bytes, fallback_dir: str | None, kept: list[str]) -> bool:
    """write_bytes_verified, or on failure the bytes kept in fallback_dir (added to kept); True if written."""
    try:
        storage.write_bytes_verified(url, data)
        log.info("saved %s (%.1f MB)", url, len(data) / 1e6)
        return True
    except StorageError as exc:
        if fallback_dir is None:
            raise
        kept_at = local_mirror(fallback_dir, url)
        storage.write_bytes(kept_at, data)
        log.error("could not write %s (%s); kept the checkpoint at %s", url, exc, kept_at)
        kept.append(kept_at)
        return False


class ResumePoint(NamedTuple):
    """The checkpoint a run continues from."""

    url: str
    state: dict[str, Any]  # verified: reading it is how it is checked
    own: bool  # the run folder's own checkpoint (this run continues), not one named by resume=URL


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """The checkpoint URL to continue from, or None to start fresh (see find_resume)."""
    found = find_resume(resume, output_dir)
    return found.url if found else None


def find_resume(resume: str | None, output_dir: str) -> ResumePoint | None:
    """The checkpoint to continue from, or None to start fresh.

    "auto" (and "force", which the caller lets continue under another config)
    continues from output_dir's last.pt; if that is damaged it says so and
    uses best.pt. If checkpoints are there but none is usable, that is an
    error, not a fresh start: the new run would overwrite them and the user
    would lose whatever a repair could still save.
    An explicit path or URL (resume=URL, e.g. to fine-tune) must be a valid
    checkpoint, and starts the run: once the run folder has a checkpoint of
    its own, that one wins, so that the same command (or ``launch --restart``)
    after a preemption continues the run instead of starting it over.
    """
    if resume is None or resume in ("", OVERWRITE_RESUME):
        return None
    own = _own_checkpoint(resume, output_dir)
    if resume in ("auto", FORCE_RESUME):
        return own
    url = storage.absolute(resume)
    if own is not None:
        if own.url != url:
            log.warning(
                "resume=%s started this run; %s has a checkpoint of its own now, so the run continues "
                "from %s (a new output_dir starts another run from %s)",
                resume,
                output_dir,
                own.url,
                resume,
            )
        return own
    if not storage.exists(url):
        raise ConfigError(f"resume={resume}: no checkpoint at {url}")
    return ResumePoint(url, load_checkpoint(url), own=False)


def _own_checkpoint(resume: str, output_dir: str) -> ResumePoint | None:
    """output_dir's last.pt, else its best.pt if last.pt is damaged; an error if none is usable."""
    damaged = []
    for name in (LAST, BEST):
        url = checkpoint_url(output_dir, name)
        if not storage.exists(url):
            continue
        try:
            state = load_checkpoint(url)
        except CheckpointError as exc:
            log.error("resume=%s: %s; trying the next checkpoint", resume, exc)
            damaged.append(str(exc))
            continue
        if damaged:
            log.warning("resume=%s: continuing from %s instead", resume, url)
        return ResumePoint(url, state, own=True)
    if damaged:
        raise ConfigError(
            f"resume={resume}: no usable checkpoint in {output_dir}/checkpoints ({'; '.join(damaged)}); "
            f"move them away to keep them, or set resume={OVERWRITE_RESUME} to start fresh and delete them"
        )
    return None


# What a run leaves in its folder that a fresh start would overwrite.
RUN_FILES = (f"{CHECKPOINTS}/{BEST}", f"{CHECKPOINTS}/{LAST}", METRICS)


def existing_run_files(output_dir: str) -> list[str]:
    """The files of an earlier run in output_dir (relative names), if any."""
    return [name for name in RUN_FILES if storage.exists(storage.join(output_dir, *name.split("/")))]


def delete_run_files(output_dir: str) -> list[str]:
    """Delete an earlier run's files from output_dir (resume=overwrite); their relative names."""
    names = existing_run_files(output_dir)
    # metrics.jsonl last: until it goes, the folder still says what it held.
    for name in sorted(names, key=lambda n: n == METRICS):
        storage.delete(storage.join(output_dir, *name.split("/")))
    return names


def write_config(output_dir: str, config: Mapping[str, Any]) -> None:
    storage.write_bytes(
        storage.join(output_dir, CONFIG), OmegaConf.to_yaml(OmegaConf.create(dict(config))).encode()
    )


def write_metrics(output_dir: str, history: list[dict[str, Any]]) -> None:
    """Rewrite metrics.jsonl (GCS objects cannot be appended to; the file is small)."""
    text = "".join(json.dumps(record, sort_keys=True) + "\n" for record in history)
    storage.write_bytes(storage.join(output_dir, METRICS), text.encode())


def read_metrics(output_dir: str) -> list[dict[str, Any]]:
    url = storage.join(output_dir, METRICS)
    if not storage.exists(url):
        return []
    return [json.loads(line) for line in storage.read_bytes(url).decode().splitlines() if line.strip()]
