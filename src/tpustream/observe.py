"""Observability of a run: TensorBoard scalars, XLA compile/transfer metrics, the profiler server.

Nothing here may stop a run: TensorBoard uploads that fail are logged and
retried at the next sync, a busy profiler port is a warning. torch_xla is
imported inside functions, so importing this module initialises nothing.
There is no module-level mutable state: on TPU v2/v3 replicas are threads of
one process, and each builds its own objects.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tpustream import storage

log = logging.getLogger(__name__)

TENSORBOARD = "tensorboard"
# How often SummaryWriter flushes on its own, so a local run shows up in a
# TensorBoard that is already open; sync() flushes explicitly before uploads.
FLUSH_SECONDS = 10
EVENT_FILE_MARK = ".tfevents."


class TensorBoardLog:
    """Scalars for TensorBoard under ``<output_dir>/tensorboard/``, written by the master replica only.

    A local ``output_dir`` is written directly. For ``gs://`` the events go to
    ``local_dir`` (a temporary folder when None) and ``sync()`` uploads every
    event file that grew since the last sync to the same relative name under
    ``<output_dir>/tensorboard/``. Event files only grow, and GCS objects cannot
    be appended to, so a sync rewrites each grown file whole: scalar event files
    stay small (measured: 47 bytes per scalar per step).

    On a resumed run pass ``purge_step`` (the global step it resumes at):
    TensorBoard then hides the events the interrupted run wrote from that step on,
    which this run writes again.
    """

    def __init__(
        self,
        output_dir: str,
        local_dir: str | None = None,
        *,
        purge_step: int | None = None,
        flush_seconds: int = FLUSH_SECONDS,
    ):
        from torch.utils.tensorboard import SummaryWriter

        self.url = storage.join(storage.absolute(output_dir), TENSORBOARD)
        if storage.is_gcs(self.url):
            self.local_dir = os.path.abspath(local_dir or tempfile.mkdtemp(prefix="tpustream-tensorboard-"))
            self._remote: str | None = self.url
        else:
            self.local_dir = self.url
            self._remote = None
        os.makedirs(self.local_dir, exist_ok=True)
        # Files already in local_dir belong to another writer (an earlier run,
        # maybe of another output_dir): counting them as synced leaves them alone.
        self._synced_sizes: dict[str, int] = dict(self._event_files())
        self._writer = SummaryWriter(self.local_dir, purge_step=purge_step, flush_secs=flush_seconds)
        self.sync_failures = 0

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """Record values (names such as "train/loss", "rate/replica_003") at a global step."""
        if self._writer is None:
            raise RuntimeError(f"TensorBoardLog for {self.url} is closed")
        for name, value in values.items():
            self._writer.add_scalar(name, float(value), global_step=step)

    def _event_files(self) -> list[tuple[str, int]]:
        """(name relative to local_dir with '/' separators, size) of every event file."""
        found = []
        for folder, _, names in os.walk(self.local_dir):
            for name in names:
                if EVENT_FILE_MARK in name:
                    path = os.path.join(folder, name)
                    relative = os.path.relpath(path, self.local_dir).replace(os.sep, "/")
                    found.append((relative, os.path.getsize(path)))
        return sorted(found)

    def sync(self) -> bool:
        """Flush, and upload grown event files for gs://. False if an upload failed (logged, not raised).

        Blocks for the GCS retries (TPUSTREAM_GCS_RETRY_SECONDS) when the bucket
        is unreachable, like every other write to the run folder: call it at
        epoch boundaries, not every step.
        """
        if self._writer is not None:
            self._writer.flush()
        if self._remote is None:
            return True
        try:
            for relative, size in self._event_files():
                if self._synced_sizes.get(relative) == size:
                    continue
                with open(os.path.join(self.local_dir, relative), "rb") as f:
                    data = f.read()
                storage.write_bytes(storage.join(self._remote, relative), data)
                # What was read, not what was listed: the writer's thread may
                # have appended in between, and that part is not uploaded yet.
                self._synced_sizes[relative] = len(data)
        except Exception as exc:
            # TensorBoard data is never worth stopping a run: whatever went wrong
            # (GCS unreachable after its retries, expired credentials, a local
            # read), count it, say so, and upload the same files at the next sync.
            # Stopping at the first failure avoids waiting out the retries per file.
            self.sync_failures += 1
            log.warning(
                "could not upload TensorBoard events to %s (%s: %s); they stay in %s and the next "
                "sync tries again",
                self._remote,
                exc.__class__.__name__,
                exc,
                self.local_dir,
            )
            return False
        return True

    def close(self) -> bool:
        """Flush, close the event file and sync a last time; returns what that sync returned."""
        if self._writer is None:
            return True
        self._writer.close()
        self._writer = None
        return self.sync()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class NullTensorBoardLog:
    """What replicas other than the master hold: the same methods, doing nothing."""

    url = None
    sync_failures = 0

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        pass

    def sync(self) -> bool:
        return True

    def close(self) -> bool:
        return True

    def __enter__(self) -> NullTensorBoardLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass


# -- XLA metrics ------------------------------------------------------------

# torch_xla's timing metrics accumulate nanoseconds.
NANOSECONDS = 1e-9
# `.item()` / `float()` of a device tensor is counted as aten::_local_scalar_dense:
# a device-to-host read the program asked for, not an op missing an XLA lowering.
ITEM_COUNTER = "aten::_local_scalar_dense"


@dataclass(frozen=True)
class XlaMetrics:
    """Process-wide totals from torch_xla.debug.metrics (all replicas of a process together)."""

    compilations: int = 0
    compile_seconds: float = 0.0
    executions: int = 0
    execute_seconds: float = 0.0
    to_device_transfers: int = 0
    to_device_bytes: int = 0
    from_device_transfers: int = 0
    from_device_bytes: int = 0
    item_calls: int = 0
    # aten ops that ran on the CPU because XLA has no lowering for them, with counts:
    # each one cuts the graph and copies tensors to the host and back.
    cpu_fallbacks: dict[str, int] = field(default_factory=dict)

    def scalars(self) -> dict[str, float]:
        """The numbers worth plotting, named for TensorBoardLog.scalars."""
        return {
            "xla/compilations": self.compilations,
            "xla/compile_seconds": self.compile_seconds,
            "xla/executions": self.executions,
            "xla/execute_seconds": self.execute_seconds,
            "xla/to_device_bytes": self.to_device_bytes,
            "xla/from_device_bytes": self.from_device_bytes,
            "xla/cpu_fallbacks": sum(self.cpu_fallbacks.values()),
        }

    def summary(self) -> str:
        fallbacks = (
            ", ".join(f"{name} x{count}" for name, count in self.cpu_fallbacks.items())
            if self.cpu_fallbacks
            else "none"
        )
        return (
            f"XLA: {self.compilations} compilations ({self.compile_seconds:.2f} s), "
            f"{self.executions} executions ({self.execute_seconds:.2f} s), "
            f"host->device {self.to_device_transfers} transfers ({format_bytes(self.to_device_bytes)}), "
            f"device->host {self.from_device_transfers} transfers ({format_bytes(self.from_device_bytes)}), "
            f"{self.item_calls} .item() reads, CPU fallbacks: {fallbacks}"
        )


def format_bytes(count: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    index = 0
    while count >= 1024 and index < len(units) - 1:
        count /= 1024
        index += 1
    return f"{count:.0f} B" if index == 0 else f"{count:.1f} {units[index]}"


def _metric_count_and_total(met: Any, name: str) -> tuple[int, float]:
    # metric_data is None for a metric nothing has recorded yet.
    data = met.metric_data(name)
    return (int(data[0]), float(data[1])) if data else (0, 0.0)


def read_xla_metrics() -> XlaMetrics:
    """The process's XLA metrics so far (torch_xla 2.9 names, checked on the XLA CPU device)."""
    import torch_xla.debug.metrics as met

    compilations, compile_ns = _metric_count_and_total(met, "CompileTime")
    executions, execute_ns = _metric_count_and_total(met, "ExecuteTime")
    # SPMD programs run through ExecuteReplicated instead.
    replicated, replicated_ns = _metric_count_and_total(met, "ExecuteReplicatedTime")
    to_device, _ = _metric_count_and_total(met, "TransferToDeviceTime")
    from_device, _ = _metric_count_and_total(met, "TransferFromDeviceTime")
    # Named from the host's side: OutboundData grows with host->device copies,
    # InboundData with device->host reads (measured with a 1 MB tensor each way).
    _, to_device_bytes = _metric_count_and_total(met, "OutboundData")
    _, from_device_bytes = _metric_count_and_total(met, "InboundData")
    aten = {name: int(met.counter_value(name)) for name in met.counter_names() if name.startswith("aten::")}
    item_calls = aten.pop(ITEM_COUNTER, 0)
    return XlaMetrics(
        compilations=compilations,
        compile_seconds=compile_ns * NANOSECONDS,
        executions=executions + replicated,
        execute_seconds=(execute_ns + replicated_ns) * NANOSECONDS,
        to_device_transfers=to_device,
        to_device_bytes=int(to_device_bytes),
        from_device_transfers=from_device,
        from_device_bytes=int(from_device_bytes),
        item_calls=item_calls,
        cpu_fallbacks=dict(sorted(aten.items(), key=lambda item: (-item[1], item[0]))),
    )


def xla_metrics_summary() -> str:
    """One line: compilations, executions, transfers both ways, .item() reads, CPU fallback ops."""
    return read_xla_metrics().summary()


def compilation_count() -> int:
    """Graphs XLA has compiled in this process (cache hits in memory are not compilations)."""
    import torch_xla.debug.metrics as met

    return _metric_count_and_total(met, "CompileTime")[0]


class RecompileWatch:
    """Warns when XLA compiles a graph it was not expected to: a shape or a constant changed.

    Call ``check(step)`` after each step's graph has run, i.e. from a step closure
    (``runtime.add_step_closure(watch.check, (step, "train"))``): with
    MpDeviceLoader a step's graph is compiled and run when the next batch is
    taken, after the loop body. The first ``warmup_checks`` checks may compile
    (the first training step); call ``expect_compile()`` before any other check
    that legitimately compiles (the first evaluation batch, the first epoch's
    end-of-epoch reductions).

    Compilations are counted per process: on a v2/v3 host, where replicas are
    threads of one process, one watch (local ordinal 0) sees every thread's
    compilations, so give it warm-up enough for all of them.
    """

    def __init__(self, warmup_checks: int = 1, count_compilations: Callable[[], int] | None = None):
        self._count = count_compilations or compilation_count
        # Compilations before the watch exists (model set-up) are not its business.
        self._seen = self._count()
        self._expected_checks = warmup_checks
        self._last_check: tuple[str, int] | None = None
        self.unexpected = 0

    def expect_compile(self, checks: int = 1) -> None:
        """The next `checks` checks may see compilations without a warning."""
        self._expected_checks = max(self._expected_checks, checks)

    def check(self, step: int, phase: str = "train") -> int:
        """Compilations since the previous check; warns if they were not expected."""
        total = self._count()
        new, self._seen = total - self._seen, total
        expected = self._expected_checks > 0
        self._expected_checks = max(0, self._expected_checks - 1)
        since = f" (since {self._last_check[0]} step {self._last_check[1]})" if self._last_check else ""
        self._last_check = (phase, step)
        if new > 0 and not expected:
            self.unexpected += new
            log.warning(
                "%s step %d: XLA compiled %d new graph(s)%s, %d in total: a tensor shape or a constant "
                "baked into the graph changed, and each change costs a compilation. Rerun with "
                "PT_XLA_DEBUG_LEVEL=1 to see the cause of each compilation",
                phase,
                step,
                new,
                since,
                total,
            )
        return new


# -- profiler ---------------------------------------------------------------


def _port_taken(port: int) -> bool:
    # The profiler's gRPC server binds with SO_REUSEPORT, so starting a second
    # one on a taken port "succeeds" and the two share connections (seen with
    # torch_xla 2.9). A plain bind still fails while any server listens there.
    # SO_REUSEADDR keeps connections in TIME_WAIT from counting as taken.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def start_profiler(port: int | None, local_ordinal: int) -> object | None:
    """Start this replica's XLA profiler server on port + local_ordinal; None if port is 0/None.

    Each replica process of a host needs its own port. Keep the returned
    object for as long as the server should run: torch_xla stops the server
    when it is garbage-collected. A taken port or a failing start is a warning,
    not an error: profiling is never worth stopping a run.
    """
    if not port:
        return None
    import torch_xla.debug.profiler as xp

    replica_port = port + local_ordinal
    if _port_taken(replica_port):
        log.warning(
            "XLA profiler not started: port %d is in use (profiler port + local ordinal)", replica_port
        )
        return None
    try:
        # only_on_master=False: by default torch_xla starts a server on local
        # ordinal 0 only, and we want one per replica.
        server = xp.start_server(replica_port, only_on_master=False)
    except Exception as exc:
        log.warning("XLA profiler not started on port %d (%s: %s)", replica_port, exc.__class__.__name__, exc)
        return None
    log.info(
        "XLA profiler listening on port %d; capture with TensorBoard's profile plugin or "
        "torch_xla.debug.profiler.trace('HOST:%d', LOGDIR, duration_ms=...)",
        replica_port,
        replica_port,
    )
    return server
