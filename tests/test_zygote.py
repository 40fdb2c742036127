"""tests/zygote.py and zygote_server.py: a forked run is what `python SCRIPT ARGS` would have been."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests import zygote

# accelerator=cpu_eager: the zygote without torch_xla, the cheaper one to start.
NATIVE = "accelerator=cpu_eager"

SCRIPT = """\
import atexit, json, os, sys, threading, time
imported = 'torch' in sys.modules
atexit.register(lambda: print('exit handler ran'))
threading.Thread(target=lambda: (time.sleep(0.2), print('thread joined'))).start()
print(json.dumps({
    'name': __name__, 'argv': sys.argv, 'path0': sys.path[0], 'cwd': os.getcwd(), 'pid': os.getpid(),
    'ppid': os.getppid(), 'sid': os.getsid(0), 'set': os.environ.get('ZYGOTE_TEST'),
    'unset': os.environ.get('ZYGOTE_TEST_UNSET'), 'imported': imported,
}), flush=True)
print('to stderr', file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def forking(monkeypatch) -> None:
    """Forks even when the suite runs with TPUSTREAM_TEST_FRESH_PROCESSES=1."""
    monkeypatch.delenv(zygote.FRESH_PROCESSES, raising=False)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return str(path)


def test_a_forked_run_is_the_script_run_as_main_in_a_process_of_its_own(
    forking, script, tmp_path, monkeypatch
):
    monkeypatch.setenv("ZYGOTE_TEST_UNSET", "the zygote's")  # in the zygote's environment, not the run's
    zygote.ZYGOTES.get("native", dict(os.environ))
    env = {k: v for k, v in os.environ.items() if k != "ZYGOTE_TEST_UNSET"}
    done = zygote.run(
        [sys.executable, script, "3", NATIVE], cwd=tmp_path, env={**env, "ZYGOTE_TEST": "yes"}, timeout=120
    )
    assert done.returncode == 3, done.stderr
    seen = json.loads(done.stdout.splitlines()[0])
    assert seen["imported"]  # forked: torch was there before the script ran
    assert seen["name"] == "__main__" and seen["argv"] == [script, "3", NATIVE]
    assert seen["path0"] == str(tmp_path) and seen["cwd"] == str(tmp_path)
    assert seen["pid"] != os.getpid() and seen["ppid"] != os.getpid()  # the zygote's child
    assert seen["sid"] == os.getsid(0)  # no session of its own unless asked
    assert (seen["set"], seen["unset"]) == ("yes", None)
    # A normal interpreter exit: threads joined, then exit handlers; stderr apart.
    assert done.stdout.splitlines()[1:] == ["thread joined", "exit handler ran"]
    assert done.stderr == "to stderr\n"


def test_signals_sessions_and_merged_output_are_popens(forking, script, tmp_path):
    process = zygote.start(
        [sys.executable, script, "0", NATIVE],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    assert isinstance(process, zygote.ZygoteChild)
    seen = json.loads(process.stdout.readline())
    assert seen["sid"] == seen["pid"] == process.pid
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    assert process.stdout.read() in ("", "to stderr\n")
    process.stdout.close()


def test_fresh_processes_when_asked(script, tmp_path):
    env = {**os.environ, zygote.FRESH_PROCESSES: "1"}
    done = zygote.run([sys.executable, script, "0", NATIVE], cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert not json.loads(done.stdout.splitlines()[0])["imported"]


def test_zygotes_are_per_import_time_environment():
    before = {"HOME": "/root", "XLA_FLAGS": "--a", "CPU_NUM_DEVICES": "1"}
    after = {**before, "XLA_FLAGS": "--a --b=false", "PJRT_DEVICE": "CPU"}  # what the imports set
    assert zygote.same_imports(before, before, after)
    assert zygote.same_imports(after, before, after)  # an environment the imports left in pytest's process
    assert zygote.same_imports({**before, "HOME": "/x", "CPU_NUM_DEVICES": "4"}, before, after)  # read later
    assert not zygote.same_imports({**before, "XLA_FLAGS": "--c"}, before, after)
    assert not zygote.same_imports({**before, "PJRT_DEVICE": "TPU"}, before, after)
    assert not zygote.same_imports({**before, "PYTHONPATH": "/elsewhere"}, before, after)
    assert zygote.preload_for(["data.root=x", "accelerator=cpu_eager"]) == "native"
    assert zygote.preload_for(["data.root=x", "accelerator=cpu_pod"]) == "xla"
