"""Checkpoints: what they hold, and writing/reading them atomically, locally or on GCS.

A checkpoint holds everything needed to continue exactly at an epoch
boundary: model and optimizer state, the epoch just finished, the global step,
the best validation accuracy so far, the metrics history and the resolved
config. Data order is a function of (seed, epoch), so resuming at epoch e+1
replays the same batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import torch

from tpustream import storage
from tpustream.errors import ConfigError, StorageError
from tpustream.runtime import Runtime

log = logging.getLogger(__name__)

BEST = "best.pt"
LAST = "last.pt"
METRICS = "metrics.json"
CHECKPOINT_VERSION = 1


def save_checkpoint(runtime: Runtime, url: str, state: dict[str, Any]) -> None:
    """Write state to url from the master replica; every replica must call this."""
    data = runtime.serialize({"version": CHECKPOINT_VERSION, **state})
    error: Exception | None = None
    if data is not None:
        try:
            storage.write_bytes(url, data)
            log.info("saved %s (%.1f MB)", url, len(data) / 1e6)
        except StorageError as exc:
            error = exc
    # Replicas wait for the write so nobody races ahead to read or overwrite it.
    runtime.barrier(f"checkpoint:{url}")
    if error is not None:
        raise error


def load_checkpoint(url: str) -> dict[str, Any]:
    """Read a checkpoint written by save_checkpoint (tensors on the CPU)."""
    data = storage.read_bytes(url)
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged file
        raise ConfigError(f"{url}: not a readable tpustream checkpoint ({exc.__class__.__name__})") from exc
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        raise ConfigError(f"{url}: not a tpustream checkpoint (version {CHECKPOINT_VERSION})")
    return state


def resolve_resume(resume: str | None, output_dir: str) -> str | None:
    """The checkpoint URL to continue from, or None to start fresh.

    "auto" continues from output_dir/last.pt when it exists, so rerunning the
    same command after a preemption picks up where the run stopped.
    """
    if resume is None or resume == "":
        return None
    if resume == "auto":
        url = storage.join(output_dir, LAST)
        return url if storage.exists(url) else None
    url = storage.absolute(resume)
    if not storage.exists(url):
        raise ConfigError(f"resume={resume}: no checkpoint at {url}")
    return url


def write_metrics(runtime: Runtime, output_dir: str, history: list[dict[str, Any]]) -> None:
    """Rewrite output_dir/metrics.json with every epoch's metrics (master only)."""
    if runtime.is_master:
        storage.write_bytes(
            storage.join(output_dir, METRICS), (json.dumps(history, indent=1) + "\n").encode()
        )
