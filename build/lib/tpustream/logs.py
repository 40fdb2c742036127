"""Logging for replicas: the replica's ordinal on every line, safe when replicas are threads.

Under PJRT a v2/v3 host runs two replicas as threads of one process, so the
label cannot be baked into a process-wide format. Each replica thread records
its label in a thread-local; a filter stamps it on every record. Threads that
are not replicas (the device loader's, read-ahead threads) get the label of
the first replica of their process.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

_thread = threading.local()
_setup_lock = threading.Lock()
FORMAT = "%(asctime)s [replica %(replica)s] %(levelname)s %(name)s: %(message)s"


class _ReplicaLabel(logging.Filter):
    """Stamps record.replica; with `only` set, passes only that replica's records."""

    def __init__(self, default: str, only: str | None = None):
        super().__init__()
        self.default = default
        self.only = only

    def filter(self, record: logging.LogRecord) -> bool:
        record.replica = getattr(_thread, "label", self.default)
        return self.only is None or record.replica == self.only


def _handler(stream_or_path, label_filter: _ReplicaLabel) -> logging.Handler:
    if isinstance(stream_or_path, str):
        handler: logging.Handler = logging.FileHandler(stream_or_path)
    else:
        handler = logging.StreamHandler(stream_or_path)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(label_filter)
    return handler


def setup_replica_logging(rank: int, world_size: int, log_dir: str | None) -> None:
    """Call in each replica (process or thread) before it logs anything."""
    label = f"{rank}/{world_size}"
    _thread.label = label
    root = logging.getLogger()
    with _setup_lock:
        if not getattr(root, "_tpustream_replica_logging", False):
            # First replica of this process: replace whatever a parent or a
            # framework configured (Hydra's handlers do not survive a spawn).
            for handler in list(root.handlers):
                root.removeHandler(handler)
            root.addHandler(_handler(sys.stderr, _ReplicaLabel(default=label)))
            root.setLevel(logging.INFO)
            root._tpustream_replica_logging = True
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            path = os.path.join(log_dir, f"replica-{rank}.log")
            root.addHandler(_handler(path, _ReplicaLabel(default=label, only=label)))


def setup_worker_logging(rank: int, world_size: int, worker_id: int) -> None:
    """DataLoader worker_init_fn: worker processes (spawned) start without any logging set-up."""
    label = f"{rank}/{world_size} worker {worker_id}"
    _thread.label = label
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.addHandler(_handler(sys.stderr, _ReplicaLabel(default=label)))
    root.setLevel(logging.INFO)
