"""XLA profiling: the profiler server of each replica (debug.profiler_port) and traces captured on demand.

A busy port or a failed capture is a warning, never an error.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile

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
    """An XLA trace of part of a run (debug.profile_steps, debug.profile_eval_epoch), where TensorBoard looks.

    torch_xla's profiler session records the host's Python and XLA activity and
    the device's ops (on a TPU; on the CPU device, the host side), and writes
    ``plugins/profile/<session>/*.xplane.pb``: TensorBoard's profile plugin and
    XProf read it under ``<output_dir>/tensorboard/<name>/``. For a gs://
    run folder it is written locally and copied there when the capture stops.
    A capture that fails is a warning: profiling is never worth stopping a run.
    """

    def __init__(self, output_dir: str, name: str):
        from tpustream import storage

        self.url = storage.join(storage.absolute(output_dir), "tensorboard", name)
        self.remote = storage.is_gcs(self.url)
        self.local_dir = tempfile.mkdtemp(prefix="tpustream-trace-") if self.remote else self.url
        self.started = False

    def start(self) -> None:
        import torch_xla.debug.profiler as xp

        try:
            os.makedirs(self.local_dir, exist_ok=True)
            xp.start_trace(self.local_dir)
            self.started = True
        except Exception as exc:
            log.warning("XLA trace not started (%s: %s)", exc.__class__.__name__, exc)

    def stop(self) -> str | None:
        """End the capture (the caller waited for the device) and return where it is, or None."""
        import torch_xla.debug.profiler as xp

        from tpustream import storage

        if not self.started:
            return None
        self.started = False
        try:
            xp.stop_trace()
            if self.remote:
                for folder, _, files in os.walk(self.local_dir):
                    for file in files:
                        path = os.path.join(folder, file)
                        relative = os.path.relpath(path, self.local_dir).replace(os.sep, "/")
                        with open(path, "rb") as handle:
                            storage.write_bytes(storage.join(self.url, relative), handle.read())
        except Exception as exc:
            log.warning("XLA trace not written to %s (%s: %s)", self.url, exc.__class__.__name__, exc)
            return None
        return self.url
