"""Imported first by the DataLoader workers' fork server (loader.WORKER_PRELOAD): stop signals are ignored.

The fork server is a child of the replica, in its process group: a stop
signal to the group (a preempted VM's SIGTERM, Ctrl-C's SIGINT) reaches it
too. Killed, it would take the workers with it (torch's worker watchdog
follows a worker's parent) before the replica could finish its step and
save. The replica cannot start it with the signals ignored when it runs on
a thread of its process (xmp.spawn runs replicas in a thread pool), so the
server ignores them itself, from the first import of its preload. Its forks,
the workers, start the same way; their worker_init_fn keeps it so.

Only inside the fork server: imported anywhere else (a test importing every
module) it changes nothing.
"""

import sys


def _in_fork_server() -> bool:
    """Whether multiprocessing's fork server main loop is importing this module."""
    from multiprocessing import forkserver

    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if _in_fork_server():
    from tpustream.preemption import ignore_stop_signals

    ignore_stop_signals()
