"""Start the tests' train.py runs from a process that has already imported torch and torch_xla.

This module is the test process's side; tests/zygote_server.py is the zygote's.

Every XLA training test runs train.py in a process of its own, as it must
(XLA tests must not share a process with eager backward, and each run is a
real `python train.py`). On this project's 2-core machines a small run is
about 12 CPU-seconds, of which about 5 are imports (torch, torch_xla, Hydra):
the suite is CPU-bound and starts over forty such runs. A zygote (as Android's
and Chromium's are called) imports them once; each run is a fork of it that
then does what `python train.py ARGS` does: its own pid, session or process
group, cwd, environment, argv and stdio, train.py run as __main__, and a
normal interpreter exit (thread joins, exit handlers, flushes, finalization).

A zygote is started per preload (a zygote imports nothing of torch_xla when
the run is on the native path, accelerator=cpu_eager or cuda, which must work
without torch_xla) and per environment that imports differently: one that
differs in a variable read at import (`IMPORT_TIME_VARIABLES`: PJRT, XLA,
torch, Python, threading libraries) other than by a value the imports set
themselves. Those values (torch_xla's defaults such as TF_CPP_MIN_LOG_LEVEL)
are set in a run's environment too, unless it gives them its own, as they
would be in a fresh process.

Fresh interpreters instead: for a command that is not
`python SCRIPT.py ARGS` (no interpreter options), for a test that needs one
(one whose subject is a stop during the imports), and for the whole suite
with TPUSTREAM_TEST_FRESH_PROCESSES=1.

What differs from a fresh process, knowingly: the imports are done before the
script's first line (so train.py installs its stop handlers after them, not
before); their objects are in the permanent generation (gc.freeze, as the
DataLoader workers' fork server does for its forks); and /proc/PID/cmdline
names tests.zygote_server, not train.py (the tests that read it start their own).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

FRESH_PROCESSES = "TPUSTREAM_TEST_FRESH_PROCESSES"
REPO = Path(__file__).resolve().parent.parent

# Read when these modules are imported (or by the libraries they load), so a
# zygote's children must have the values the zygote imported with. Not here:
# what is read only when the runtime starts (CPU_NUM_DEVICES, by PJRT's client),
# and TORCHINDUCTOR_CACHE_DIR, which torch sets itself on first use.
IMPORT_TIME_VARIABLES = (
    "PYTHON",
    "LD_",
    "PJRT_",
    "XLA_",
    "TPU_",
    "PT_",
    "TORCH",
    "TF_",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "OPENBLAS_",
    "CUDA",
    "NCCL_",
    "GRPC_",
    "LIBTPU",
    "JAX",
    "HYDRA",
)
RUNTIME_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR",)

NATIVE_ACCELERATORS = ("accelerator=cpu_eager", "accelerator=cuda")


def import_time_environment(env: dict[str, str]) -> dict[str, str]:
    return {
        k: v for k, v in env.items() if k.startswith(IMPORT_TIME_VARIABLES) and k not in RUNTIME_VARIABLES
    }


def same_imports(env: dict[str, str], before: dict[str, str], after: dict[str, str]) -> bool:
    """Whether a fresh process with `env` would import as a zygote started with `before` did.

    The imports set some variables themselves (`after`): torch_xla sets
    defaults (TF_CPP_MIN_LOG_LEVEL, PJRT_DEVICE) and adds its own to XLA_FLAGS
    only where they are missing, so a value they would have set imports the
    same way as the value they set it from. Tests that import torch_xla in
    pytest's process leave such values in its environment.
    """
    env, before, after = (import_time_environment(e) for e in (env, before, after))
    return all(env.get(k) in (before.get(k), after.get(k)) for k in {*env, *before, *after})


def preload_for(args: Sequence[str]) -> str:
    return "native" if any(arg in NATIVE_ACCELERATORS for arg in args) else "xla"


class Zygote:
    """One zygote process: a socket to ask for forks, a thread that reads their starts and ends."""

    def __init__(self, preload: str, env: dict[str, str]):
        self.preload, self.before, self.after = preload, env, None
        self.ready = threading.Event()
        self.requests, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote_server", preload, str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=env,
            cwd=REPO,  # where `tests` is a package, whatever the runs' folders
        )
        theirs.close()
        self.started: queue.Queue[dict] = queue.Queue()
        self.lock = threading.Lock()
        self.forking = threading.Lock()  # one request and its reply at a time
        self.ends: dict[int, ZygoteChild] = {}
        self.early_ends: dict[int, int] = {}
        self.exited = threading.Event()
        self.reader = threading.Thread(target=self.read, name="zygote-reader", daemon=True)
        self.reader.start()

    def read(self) -> None:
        while True:
            try:
                message = self.requests.recv(1 << 20)
            except OSError:
                message = b""
            if not message:
                self.exited.set()
                self.ready.set()
                with self.lock:
                    children = list(self.ends.values())
                for child in children:
                    child.ended(-signal.SIGKILL)
                return
            reply = json.loads(message)
            if "imported" in reply:
                self.after = reply["imported"]
                self.ready.set()
            elif "ended" in reply:
                with self.lock:
                    child = self.ends.pop(reply["ended"], None)
                    if child is None:  # it ended before its start was read
                        self.early_ends[reply["ended"]] = reply["returncode"]
                        continue
                child.ended(reply["returncode"])
            else:
                self.started.put(reply)

    def imports_as(self, preload: str, env: dict[str, str]) -> bool:
        """Whether a fresh process with `env` would have imported what this zygote did, in the same way."""
        if preload != self.preload:
            return False
        self.ready.wait()
        return not self.exited.is_set() and same_imports(env, self.before, self.after)

    def fork(self, argv: list[str], env: dict[str, str], cwd: str, stdio: list[int], new_session: bool):
        request = json.dumps({"argv": argv, "env": env, "cwd": cwd, "new_session": new_session}).encode()
        with self.forking:
            socket.send_fds(self.requests, [request], stdio)
            while True:  # the first waits for the zygote's imports
                try:
                    reply = self.started.get(timeout=1)
                    break
                except queue.Empty:
                    if self.exited.is_set():
                        raise RuntimeError(f"the zygote exited ({self.process.wait()})") from None
        child = ZygoteChild(reply["pid"])
        with self.lock:
            if reply["pid"] in self.early_ends:
                child.ended(self.early_ends.pop(reply["pid"]))
            else:
                self.ends[reply["pid"]] = child
        return child

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.requests.shutdown(socket.SHUT_RDWR)
        self.requests.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class ZygoteChild:
    """The part of subprocess.Popen the tests use, for a process the zygote forked."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self.done = threading.Event()
        self.stdout: IO[str] | None = None
        self.stderr: IO[str] | None = None

    def ended(self, returncode: int) -> None:
        self.returncode = returncode
        self.done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.done.wait(timeout):
            raise subprocess.TimeoutExpired(f"train.py (pid {self.pid})", timeout)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str | None, str | None]:
        results: dict[str, str] = {}

        def drain(name: str, stream: IO[str]) -> None:
            results[name] = stream.read()
            stream.close()

        readers = [
            threading.Thread(target=drain, args=(name, stream), daemon=True)
            for name, stream in (("stdout", self.stdout), ("stderr", self.stderr))
            if stream is not None
        ]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(f"train.py (pid {self.pid})", timeout)
        self.wait(timeout)
        return results.get("stdout"), results.get("stderr")


class Zygotes:
    """This test process's zygotes, one per preload and way of importing (same_imports), made on first use."""

    def __init__(self):
        self.lock = threading.Lock()
        self.zygotes: list[Zygote] = []
        atexit.register(self.close)

    def get(self, preload: str, env: dict[str, str]) -> Zygote:
        with self.lock:
            self.zygotes = [zygote for zygote in self.zygotes if not zygote.exited.is_set()]
            for zygote in self.zygotes:
                if zygote.imports_as(preload, env):
                    return zygote
            self.zygotes.append(Zygote(preload, env))
            return self.zygotes[-1]

    def close(self) -> None:
        with self.lock:
            zygotes, self.zygotes = self.zygotes, []
        for zygote in zygotes:
            zygote.close()


ZYGOTES = Zygotes()


def can_fork(argv: Sequence[str], env: dict[str, str]) -> bool:
    return (
        env.get(FRESH_PROCESSES, "") in ("", "0")
        and len(argv) >= 2
        and argv[0] == sys.executable
        and argv[1].endswith(".py")
        and not argv[1].startswith("-")
    )


def start(
    argv: list[str],
    *,
    cwd: str | os.PathLike,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    start_new_session: bool = False,
) -> subprocess.Popen | ZygoteChild:
    """subprocess.Popen(argv, text=True, ...) for `python train.py ARGS`, forked from a zygote if it can be.

    stdout/stderr: None (inherit), subprocess.PIPE, or subprocess.STDOUT for stderr.
    """
    env = dict(os.environ if env is None else env)
    if not can_fork(argv, env):
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=stdout,
            stderr=stderr,
            text=True,
            start_new_session=start_new_session,
        )
    zygote = ZYGOTES.get(preload_for(argv[2:]), env)
    mine: dict[str, int] = {}
    theirs = [os.open(os.devnull, os.O_RDONLY), 1, 2]
    opened = [theirs[0]]
    if stdout == subprocess.PIPE:
        mine["stdout"], theirs[1] = os.pipe()
        opened.append(theirs[1])
    if stderr == subprocess.PIPE:
        mine["stderr"], theirs[2] = os.pipe()
        opened.append(theirs[2])
    elif stderr == subprocess.STDOUT:
        theirs[2] = theirs[1]
    try:
        child = zygote.fork(argv[1:], env, str(cwd), theirs, start_new_session)
    except BaseException:
        for fd in mine.values():
            os.close(fd)
        raise
    finally:
        for fd in opened:
            os.close(fd)
    for name, fd in mine.items():
        setattr(child, name, open(fd, encoding="utf-8"))  # noqa: SIM115 (the caller reads and closes it)
    return child


def run(
    argv: list[str], *, cwd: str | os.PathLike, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess:
    """Like subprocess.run(argv, capture_output=True, text=True, ...)."""
    process = start(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    return subprocess.CompletedProcess(argv, process.returncode, out, err)
