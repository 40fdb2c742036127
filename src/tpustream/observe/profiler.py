"""Profiling: the XLA profiler server of each replica (debug.profiler_port), traces captured on demand.

Traces: torch_xla's profiler on the XLA runtimes, torch.profiler on the native one.

A busy port or a failed capture is a warning, never an error.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import tempfile
import time
from pathlib import Path

from tpustream.observe import trace_gaps

log = logging.getLogger(__name__)


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


class TraceCapture:
    """A trace of part of a run (debug.profile_steps, debug.profile_eval_epoch), under the run's tensorboard/.

    Written to ``<output_dir>/tensorboard/<name>/``; for a gs:// run folder
    it is written locally and copied there when the capture stops. A capture
    that fails is a warning: profiling is never worth stopping a run. Each
    runtime makes its own kind (Runtime.trace_capture).
    """

    kind = "XLA"
    # What the trace says, logged with where it is (torch's on a GPU: where its idle time went).
    summary: str | None = None

    def __init__(self, output_dir: str, name: str):
        from tpustream import storage

        self.url = storage.join(storage.absolute(output_dir), "tensorboard", name)
        self.remote = storage.is_gcs(self.url)
        self.local_dir = tempfile.mkdtemp(prefix="tpustream-trace-") if self.remote else self.url
        self.started = False

    def start(self) -> None:
        try:
            os.makedirs(self.local_dir, exist_ok=True)
            self._start()
            self.started = True
        except Exception as exc:
            log.warning("%s trace not started (%s: %s)", self.kind, exc.__class__.__name__, exc)

    def stop(self) -> str | None:
        """End the capture (the caller waited for the device) and return where it is, or None."""
        from tpustream import storage

        if not self.started:
            return None
        self.started = False
        try:
            self._stop()
            if self.remote:
                for folder, _, files in os.walk(self.local_dir):
                    for file in files:
                        path = os.path.join(folder, file)
                        relative = os.path.relpath(path, self.local_dir).replace(os.sep, "/")
                        with open(path, "rb") as handle:
                            storage.write_bytes(storage.join(self.url, relative), handle.read())
        except Exception as exc:
            reason = f"{exc.__class__.__name__}: {exc}"
            log.warning("%s trace not written to %s (%s)", self.kind, self.url, reason)
            return None
        return self.url

    def mark_step(self, step: int) -> None:
        """The training loop goes on to global step `step` (XLA's traces mark steps themselves)."""

    def _start(self) -> None:
        """torch_xla's profiler session: the host's Python and XLA activity, and the device's ops on a TPU.

        It writes ``plugins/profile/<session>/*.xplane.pb``, where
        TensorBoard's profile plugin and XProf read it.
        """
        import torch_xla.debug.profiler as xp

        xp.start_trace(self.local_dir)

    def _stop(self) -> None:
        import torch_xla.debug.profiler as xp

        xp.stop_trace()


def gpu_idle_summary(path: str) -> str | None:
    """observe.trace_gaps' line for a trace with GPU work, else None; a failure is only a warning."""
    try:
        found = trace_gaps.summarise(trace_gaps.load_events(Path(path)))
    except Exception as exc:
        log.warning("trace %s not summarised (%s: %s)", path, exc.__class__.__name__, exc)
        return None
    return None if "error" in found else trace_gaps.describe("GPU", found)


class TorchTraceCapture(TraceCapture):
    """The native runtime's trace: torch.profiler (Kineto) over the window, a gzipped Chrome trace.

    The training thread's operators, and the ones autograd's thread runs for
    it, and on a GPU every kernel
    and copy on every stream (CUPTI: the copy stream's batch copies, and
    kernels queued from other threads, such as data.decode=device's). The
    loader's waits for a batch are marked "input wait" (observe.timing.timed)
    and each step "train step N" (training.debug). Perfetto
    (ui.perfetto.dev), chrome://tracing and Holistic Trace Analysis read the
    ``<host>_<pid>.<ms>.pt.trace.json.gz`` file, the name torch's
    TensorBoard trace handler uses.
    """

    kind = "torch"

    def __init__(self, output_dir: str, name: str, cuda: bool):
        super().__init__(output_dir, name)
        self.cuda = cuda
        self.profiler = None
        self.step_mark = None  # the record_function of the step under way

    def mark_step(self, step: int) -> None:
        # torch.profiler marks steps only under a schedule (ProfilerStep#N):
        # the trace's own marks, from one step's end to the next one's.
        from torch.profiler import record_function

        self._end_step()
        if self.profiler is not None:
            self.step_mark = record_function(f"{trace_gaps.STEP_MARK}{step}")
            self.step_mark.__enter__()

    def _end_step(self) -> None:
        if self.step_mark is not None:
            self.step_mark.__exit__(None, None, None)
            self.step_mark = None

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # No with_stack: with Python's call sites recorded, a process that exited
        # while the profiler ran (a stop or an error inside the window) hung in its
        # Python tracer's destructor (torch 2.9, seen here); the exit handler below
        # alone prevents that too (tests/test_debug.py), and both are kept.
        self.profiler = profile(activities=activities)
        self.profiler.start()
        atexit.register(self._abandon)

    def _abandon(self) -> None:
        """At exit, a capture the run never reached the end of is stopped, not written."""
        self._end_step()
        profiler, self.profiler = self.profiler, None
        if profiler is not None:
            with contextlib.suppress(Exception):
                profiler.stop()

    def _stop(self) -> None:
        atexit.unregister(self._abandon)
        self._end_step()
        profiler, self.profiler = self.profiler, None
        profiler.stop()
        name = f"{socket.gethostname()}_{os.getpid()}.{int(time.time() * 1000)}.pt.trace.json.gz"
        path = os.path.join(self.local_dir, name)
        profiler.export_chrome_trace(path)
        if self.cuda:
            self.summary = gpu_idle_summary(path)
