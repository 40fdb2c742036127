"""The zygote process of tests/zygote.py: imports once, then forks a run per request.

`python -m tests.zygote_server PRELOAD FD`: PRELOAD is xla or native, FD a
SOCK_SEQPACKET socket to the test process. It imports PRELOAD's modules, sends
the environment they left, and then for each request (a JSON message with
argv, env, cwd and new_session, and three file descriptors for stdin, stdout
and stderr) forks a child, answers its pid, and answers its exit status when
it ends. The child becomes `python SCRIPT ARGS` (`become`) and exits the way
that would.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import sys
from pathlib import Path

# The modules that train.py and its in-process replica import; each run that
# starts from the zygote finds them imported.
NATIVE_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.utils.data",
    "torchvision",
    "hydra",
    "omegaconf",
    "tpustream.launch",
    "tpustream.launch.replica",
)
XLA_PRELOAD = (
    *NATIVE_PRELOAD,
    "torch_xla",
    "torch_xla.core.xla_model",
    "torch_xla.runtime",
    "torch_xla.distributed.parallel_loader",
    "torch_xla.distributed.xla_multiprocessing",
    "torch_xla.debug.metrics",
)


def serve(preload: str, requests: socket.socket) -> dict | None:
    """Fork a child per request and report its pid and end. Returns only in a child, with its request."""
    for name in XLA_PRELOAD if preload == "xla" else NATIVE_PRELOAD:
        importlib.import_module(name)
    requests.send(json.dumps({"imported": dict(os.environ)}).encode())
    # The children inherit these objects as the permanent generation: their
    # collections do not walk (and write to) the pages they share with the
    # zygote, as the DataLoader workers' fork server does for its forks.
    gc.freeze()
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    try:
        while True:
            ready, _, _ = select.select([requests, wakeup_read], [], [])
            if wakeup_read in ready:
                os.read(wakeup_read, 512)
                for pid in list(children):
                    done, status = os.waitpid(pid, os.WNOHANG)
                    if done:
                        children.discard(pid)
                        reply = {"ended": pid, "returncode": os.waitstatus_to_exitcode(status)}
                        requests.send(json.dumps(reply).encode())
            if requests in ready:
                message, fds, _, _ = socket.recv_fds(requests, 1 << 20, 3)
                if not message:
                    return None  # the tests are done
                request = json.loads(message)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    children.clear()  # the zygote's, not this child's to stop
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wakeup_read, wakeup_write):
                        os.close(fd)
                    requests.close()
                    for target, fd in enumerate(fds):
                        os.dup2(fd, target)
                    for fd in set(fds):
                        if fd > 2:
                            os.close(fd)
                    return request
                for fd in fds:
                    os.close(fd)
                children.add(pid)
                requests.send(json.dumps({"pid": pid}).encode())
    finally:
        for pid in children:  # only in the zygote: runs its tests left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def become(request: dict) -> None:
    """In the forked child: become `python train.py ARGS` and run it as the main module."""
    if request["new_session"]:
        os.setsid()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script = str(Path(request["argv"][0]).resolve())
    sys.argv = [request["argv"][0], *request["argv"][1:]]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    preload, fd = sys.argv[1], int(sys.argv[2])
    requests = socket.socket(fileno=fd)
    before = dict(os.environ)
    request = serve(preload, requests)
    if request is None:
        return
    # What the imports set in the environment, unless the run sets it itself.
    for key, value in os.environ.items():
        if before.get(key) != value and request["env"].get(key) == before.get(key):
            request["env"][key] = value
    become(request)


if __name__ == "__main__":
    main()
