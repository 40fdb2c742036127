"""The XLA profiler server of each replica (debug.profiler_port): a busy port is a warning, never an error."""

from __future__ import annotations

import logging
import socket

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
