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

It then imports what every worker needs (PRELOAD) and freezes the garbage
collector's view of it (gc.freeze): the workers, its forks, inherit those
objects in the permanent generation, so their collections neither walk nor
write to the pages they share with the server (copy-on-write stays shared),
and the server's own exit skips the full collections over them (about 1 s
of CPU a fork server, measured: 5.8 -> 4.7 s for a process that imported
PRELOAD and exited).

Only inside the fork server: imported anywhere else (a test importing every
module) it changes nothing.
"""

import contextlib
import gc
import importlib
import sys

# What every worker imports, once, here: torch, the pipeline, and what
# train.py imports (each worker imports train.py, the main module, itself:
# preloaded, its stop handlers would be the fork server's). Not torchvision:
# the decoder registers its image ops from torchvision's library, without its
# import's 3 s (data.format.decode.register_image_ops).
PRELOAD = ("torch", "hydra", "tpustream.launch", "tpustream.data.read.stream")


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
    for name in PRELOAD:
        # As multiprocessing's own preload: a module that fails here, a worker imports itself.
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    gc.freeze()
