"""Imported first by the DataLoader workers' fork server (loader.WORKER_PRELOAD): stop signals are ignored.

The fork server is a child of the replica, in its process group: a stop
signal to the group (a preempted VM's SIGTERM, Ctrl-C's SIGINT) reaches it
too. Killed, it would take the workers with it (torch's worker watchdog
follows a worker's parent) before the replica could finish its step and
save. The replica starts it with stop signals blocked on the starting thread
(CountingLoader.start_workers; SIG_IGN would need the main thread, and under
xmp.spawn a replica runs on a thread of its process), so it starts immune;
here, from the first import of its preload, it ignores them (a signal
pending since its start is discarded) and keeps them blocked. Its forks,
the workers, start ignoring and blocking both; their worker_init_fn
(launch.replica.init_data_worker) ignores them again, after torch's worker
loop installed its own SIGTERM handler, and unblocks them.

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

    ignore_stop_signals(keep_blocked=True)
