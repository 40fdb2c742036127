"""This host's part in a multi-host pod before spawning: who counts a split's shards, and the wait for it.

Every host must plan the epoch from the same sample counts. Shards without a
recorded count are counted by pod host 0 alone, which writes the folder's
index; the other hosts read the split the same way but may not count, and
wait here until host 0's index covers it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence

from tpustream.config import positive_seconds
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.resolve.counting import CountsNotReady
from tpustream.data.resolve.split import SplitOptions, load_split
from tpustream.errors import ConfigError
from tpustream.preemption import raise_if_stop_requested

log = logging.getLogger(__name__)

# Seconds between two looks at host 0's index.
INDEX_POLL_SECONDS = 5.0


def host_index() -> int:
    """This host's index in a multi-host pod (0 when alone), as the pod launcher sets it."""
    value = os.environ.get("TPUSTREAM_HOST_INDEX", "0")
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"TPUSTREAM_HOST_INDEX={value!r}: expected a host number") from None


def index_wait_seconds() -> float:
    """How long a pod host other than the first waits for host 0's index (TPUSTREAM_INDEX_WAIT_SECONDS)."""
    return positive_seconds("TPUSTREAM_INDEX_WAIT_SECONDS", 3600.0)


def load_split_on_this_host(
    spec: str | Sequence[str],
    split: str,
    options: SplitOptions,
    sleep: Callable[[float], None] = time.sleep,
) -> ShardManifest:
    """load_split as this pod host may: host 0 counts what is missing, the others wait for its index."""
    if host_index() == 0:
        return load_split(spec, split, options)
    options = dataclasses.replace(options, counting_host=False)
    deadline = time.monotonic() + index_wait_seconds()
    waiting = None
    while True:
        try:
            manifest = load_split(spec, split, options)
        except CountsNotReady as exc:
            if waiting is None:
                log.info("%s: waiting for pod host 0 to index the shards", exc.folder)
            waiting = exc
        else:
            if waiting is not None:
                manifest.counts_from += " (written by host 0)"
            return manifest
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"{waiting.folder}: pod host 0 wrote no index covering these shards within "
                f"{index_wait_seconds():.0f} s; run `tpustream-index {waiting.folder}` once before the job"
            )
        sleep(INDEX_POLL_SECONDS)
        raise_if_stop_requested("while waiting for pod host 0's index")
