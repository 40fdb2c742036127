"""python -m tpustream.pod against a stub gcloud that runs the "remote" commands here with bash.

The stub records its argv, answers describe from a script (states in order,
N network endpoints), and for ``ssh --worker=I --command=CMD`` runs CMD with
``bash -c`` in a new session, as sshd would on the host, then exits with the
code scripted for that worker and attempt (255 = connection lost: CMD is not
run). So quoting, output prefixes, cleanup and restarts are tested for real;
only gcloud itself is simulated.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
import types
from pathlib import Path

import pytest

from tests.test_pod_commands import OVERRIDES, alive, spec
from tpustream.errors import HUNG_EXIT_CODE, PREEMPTED_EXIT_CODE
from tpustream.pod import commands, interrupts, supervise, sync
from tpustream.pod.__main__ import main

REPO = Path(__file__).resolve().parent.parent

STUB = r'''#!{python}
"""A stand-in for gcloud compute tpus tpu-vm (describe, ssh, scp, create)."""
import json, os, shutil, subprocess, sys, threading

LOG = os.environ["GCLOUD_STUB_LOG"]
with open(os.environ["GCLOUD_STUB_SCRIPT"]) as f:
    SCRIPT = json.load(f)
args = sys.argv[1:]
fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
os.write(fd, (json.dumps(args) + "\n").encode())
os.close(fd)
with open(LOG) as f:
    calls = [json.loads(line) for line in f]


def flag(name):
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"--{{name}}=")), None)


def run_here(command, env):
    """Like sshd: the user's shell runs the command in its own session; output is relayed."""
    child = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, env={{**os.environ, **env}})
    def copy(src, dst):
        for line in iter(src.readline, b""):
            dst.write(line)
            dst.flush()
    threads = [threading.Thread(target=copy, args=(child.stdout, sys.stdout.buffer)),
               threading.Thread(target=copy, args=(child.stderr, sys.stderr.buffer))]
    for t in threads:
        t.start()
    code = child.wait()
    for t in threads:
        t.join()
    return 128 - code if code < 0 else code


verb = args[3] if args[:3] == ["compute", "tpus", "tpu-vm"] and len(args) > 3 else None
if verb == "describe":
    if SCRIPT.get("describe_error"):
        print("ERROR: (gcloud.compute.tpus.tpu-vm.describe) " + SCRIPT["describe_error"], file=sys.stderr)
        sys.exit(1)
    states = SCRIPT.get("states", ["READY"])
    index = sum(1 for c in calls if c[3:4] == ["describe"]) - 1
    endpoints = [{{"ipAddress": f"10.0.0.{{i}}", "port": 8470}} for i in range(SCRIPT.get("workers", 1))]
    print(json.dumps({{"name": args[4], "state": states[min(index, len(states) - 1)],
                      "acceleratorType": "v3-32", "networkEndpoints": endpoints}}))
elif verb == "ssh":
    worker, command = flag("worker"), flag("command")
    if worker == "all":
        sys.exit(run_here(command, {{}}) if SCRIPT.get("run_all", True) else 0)
    # Counted per worker, not per command: every launch has its own run id in the command.
    attempt = sum(1 for c in calls if c[3:4] == ["ssh"] and f"--worker={{worker}}" in c
                  and (command == "true") == ("--command=true" in c)) - 1
    planned = SCRIPT.get("ssh", {{}}).get(worker, []) if command != "true" else []  # not for the ssh check
    code = planned[attempt] if attempt < len(planned) else None
    if code == 255:
        print(f"ssh: connect to host 10.0.0.{{worker}} port 22: Connection timed out", file=sys.stderr)
        sys.exit(255)
    result = run_here(command, {{"STUB_WORKER": worker, "STUB_ATTEMPT": str(attempt)}})
    sys.exit(result if code is None else code)
elif verb == "scp":
    source, dest = args[4], args[5]
    if SCRIPT.get("scp_copy"):
        shutil.copy(source, dest.split(":", 1)[1])
elif verb == "create":
    spec = flag("metadata-from-file")
    if spec and spec.startswith("startup-script="):
        shutil.copy(spec.split("=", 1)[1], LOG + ".startup-script")
'''

FAKE_TRAIN = r'''
"""Stands for train.py on one host: reports what arrived, hangs if told to."""
import json, os, subprocess, sys, time
from pathlib import Path

worker = os.environ.get("STUB_WORKER", "?")
# fake_hang=/fake_pids= arguments: as FAKE_HANG/FAKE_PID_DIR, through the command line.
for arg in sys.argv[1:]:
    if arg.startswith(("fake_hang=", "fake_pids=")):
        name, value = arg.split("=", 1)
        os.environ[{"fake_hang": "FAKE_HANG", "fake_pids": "FAKE_PID_DIR"}[name]] = value
megascale = {k: v for k, v in os.environ.items() if k.startswith("MEGASCALE_")}
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "pjrt": os.environ.get("PJRT_DEVICE"),
                  "extra": os.environ.get("EXTRA"), "host": os.environ.get("TPUSTREAM_HOST_INDEX"),
                  "megascale": megascale}), flush=True)
print(f"replica log of worker {worker}", file=sys.stderr, flush=True)
if os.environ.get("FAKE_PID_DIR"):
    Path(os.environ["FAKE_PID_DIR"], f"{worker}.pid").write_text(str(os.getpid()))
if worker in os.environ.get("FAKE_SLOW", "").split(","):
    time.sleep(0.3)
# FAKE_HANG=0,1@0: worker 0 hangs on every attempt, worker 1 on its first (attempt 0) only.
hangs = os.environ.get("FAKE_HANG", "").split(",")
if worker in hangs or f"{worker}@{os.environ.get('STUB_ATTEMPT')}" in hangs:
    # A replica process (its command line does not name this script) and this process
    # wait in a collective for a host that is gone.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    Path(os.environ["FAKE_PID_DIR"], f"{worker}.child").write_text(str(child.pid))
    time.sleep(30)
deadline = time.time() + 5  # FAKE_WAIT_PIDS: end only once that many workers have started
wanted = int(os.environ.get("FAKE_WAIT_PIDS", 0))
while len(list(Path(os.environ.get("FAKE_PID_DIR", ".")).glob("*.pid"))) < wanted and time.time() < deadline:
    time.sleep(0.02)
'''


class Gcloud:
    """The stub on PATH: set what it answers, read what it was asked."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.log = tmp_path / "gcloud-calls.jsonl"
        self.script_path = tmp_path / "gcloud-script.json"
        stub = self.bin / "gcloud"
        stub.write_text(STUB.format(python=sys.executable))
        stub.chmod(0o755)
        self.script(workers=2)
        # The "hosts" share this home: the launch's pid files go to its ~/.tpustream/runs.
        self.home = tmp_path / "home"
        self.home.mkdir()
        monkeypatch.setenv("HOME", str(self.home))
        monkeypatch.setenv("PATH", f"{self.bin}{os.pathsep}{os.environ['PATH']}")
        monkeypatch.setenv("GCLOUD_STUB_LOG", str(self.log))
        monkeypatch.setenv("GCLOUD_STUB_SCRIPT", str(self.script_path))

    def script(self, **answers) -> None:
        self.script_path.write_text(json.dumps(answers))

    def calls(self, verb: str | None = None) -> list[list[str]]:
        if not self.log.exists():
            return []
        calls = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [c for c in calls if verb is None or c[3] == verb]

    def worker_runs(self, worker: int) -> list[list[str]]:
        """ssh calls that ran the training command on one worker (not the ssh check)."""
        return [c for c in self.calls("ssh") if f"--worker={worker}" in c and "--command=true" not in c]

    def run_id(self) -> str:
        """The run id of the last launch, from its last worker command."""
        runs = [c for c in self.calls("ssh") if "--worker=all" not in c and "--command=true" not in c]
        return re.search(rf"{commands.RUN_ID_VARIABLE}=([0-9a-f]+) ", runs[-1][6]).group(1)


@pytest.fixture
def gcloud(tmp_path, monkeypatch) -> Gcloud:
    return Gcloud(tmp_path, monkeypatch)


@pytest.fixture
def fake_train(tmp_path) -> Path:
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAIN)
    return path


@pytest.fixture
def sigint_default():
    """SIGINT at Python's default in pytest's process during the test, put back after.

    Earlier tests may leave it otherwise; a child started meanwhile inherits it
    at its default (a handler becomes SIG_DFL on exec; SIG_IGN would stay).
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def launched_processes(gcloud: Gcloud) -> list[int]:
    """The live processes of this test's launches: all that the stub starts carry its log's path."""
    marker = f"GCLOUD_STUB_LOG={gcloud.log}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if marker in environ and state != "Z":
            found.append(int(entry))
    return found


def launch(tmp_path: Path, *options: str, command: list[str]) -> int:
    """main() with a workdir in tmp_path and short waits."""
    (tmp_path / "remote").mkdir(exist_ok=True)
    return main(
        [
            "--tpu",
            "tpu1",
            "--zone",
            "europe-west4-a",
            "--workdir",
            str(tmp_path / "remote"),
            "--poll-interval",
            "0.01",
            "--grace",
            "0",
            *options,
            "--",
            *command,
        ]
    )


def reports(out: str) -> dict[str, dict]:
    """The fake train.py's JSON line of each worker, by prefix."""
    found = {}
    for line in out.splitlines():
        match = re.match(r"(\[(?:slice \d+ )?worker \d+\]) (\{.*\})$", line)
        if match:
            found[match.group(1)] = json.loads(match.group(2))
    return found


# --- runs through the stub gcloud --------------------------------------------------------


def test_several_slices_run_as_one_job_on_every_host_of_every_node(gcloud, fake_train, tmp_path, capfd):
    command = [sys.executable, str(fake_train), "strategy=spmd", "mesh.slices=2"]
    code = launch(tmp_path, "--num-slices", "2", command=command)
    out, err = capfd.readouterr()
    assert code == 0, err
    # Both nodes described (READY, 2 hosts each; the first one's first host coordinates).
    assert [c[4] for c in gcloud.calls("describe")] == ["tpu1-0", "tpu1-1"]
    got = reports(out)
    assert set(got) == {f"[slice {s} worker {h}]" for s in (0, 1) for h in (0, 1)}
    for name, report in got.items():
        slice_id, host = map(int, re.findall(r"\d+", name))
        assert report["host"] == str(host) and report["argv"] == command[2:]
        assert report["megascale"] == {
            "MEGASCALE_NUM_SLICES": "2",
            "MEGASCALE_SLICE_ID": str(slice_id),
            "MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.0:8081",
            "MEGASCALE_PORT": "8081",
        }
    assert "all 4 worker(s) exited with 0" in err


def test_overrides_arrive_unchanged_on_every_worker_with_prefixed_lines(gcloud, fake_train, tmp_path, capfd):
    code = launch(tmp_path, "--env", "EXTRA=x $y 'z'", command=[sys.executable, str(fake_train), *OVERRIDES])
    out, err = capfd.readouterr()
    assert code == 0, err
    got = reports(out)
    assert set(got) == {"[worker 0]", "[worker 1]"}
    for name, report in got.items():
        assert report == {
            "argv": OVERRIDES,
            "cwd": str(tmp_path / "remote"),
            "pjrt": "TPU",
            "extra": "x $y 'z'",
            "host": name[-2],  # [worker I]
            "megascale": {},  # one slice
        }
    assert "[worker 0] replica log of worker 0" in err and "[worker 1] replica log of worker 1" in err
    assert len(gcloud.calls("describe")) == 1 and len(gcloud.worker_runs(1)) == 1


def test_python_c_prints_its_arguments_exactly(gcloud, tmp_path, capfd):
    code = launch(
        tmp_path,
        "--num-workers",
        "1",
        command=[sys.executable, "-c", "import sys,json; print(json.dumps(sys.argv[1:]))", *OVERRIDES],
    )
    out, err = capfd.readouterr()
    assert code == 0, err
    assert f"[worker 0] {json.dumps(OVERRIDES)}" in out.splitlines()
    assert gcloud.calls("describe") == []  # --num-workers skips describe


def test_default_workdir_is_in_the_remote_home(gcloud, fake_train, tmp_path, capfd):
    home = gcloud.home
    (home / "tpustream").mkdir()
    code = main(["--tpu", "t", "--zone", "z", "--num-workers", "1", "--", sys.executable, str(fake_train)])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert reports(out)["[worker 0]"]["cwd"] == str(home / "tpustream")


def test_a_failed_worker_stops_the_others_and_kills_the_training_everywhere(
    gcloud, fake_train, tmp_path, monkeypatch, capfd
):
    gcloud.script(workers=3, ssh={"1": [1]})
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("FAKE_PID_DIR", str(pids))
    monkeypatch.setenv("FAKE_HANG", "0,2")
    monkeypatch.setenv("FAKE_WAIT_PIDS", "3")  # worker 1 fails once all three run
    started = time.monotonic()
    code = launch(tmp_path, "--restart", command=[sys.executable, str(fake_train), "epochs=3"])
    elapsed = time.monotonic() - started
    out, err = capfd.readouterr()
    assert code == 1
    assert "worker 1 exited with 1; worker(s) 0, 2 stopped by the launcher" in err
    cleanups = [c for c in gcloud.calls("ssh") if "--worker=all" in c]
    assert len(cleanups) == 1 and cleanups[0][6] == f"--command={commands.cleanup_script(gcloud.run_id())}"
    assert re.search(r"^\[cleanup\] .*: stopping process group\(s\) \d+ \d+$", out, re.M)
    hung = [int((pids / f"{w}.{kind}").read_text()) for w in ("0", "2") for kind in ("pid", "child")]
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in hung) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in hung)  # the cleanup killed them; the local stop alone would not
    assert len(gcloud.worker_runs(0)) == 1  # exit 1 is not restarted
    assert elapsed < 10


# This test failed in some full-suite runs (4 of 4 in one session; once in 962 on a
# fresh clone): the launcher reported "all 2 worker(s) exited with 0" and exited 0.
# A pytest process with SIGINT ignored or blocked reproduces that exactly: the
# launcher inherits it (Python installs no KeyboardInterrupt handler for an ignored
# SIGINT, and never unblocks a blocked one), the Ctrl-C goes unheard, and the hung
# workers end after their 30 s with 0. Which earlier test leaves pytest's process so
# is not known; the launcher unblocks SIGINT, and this test gives it SIGINT's default.
@pytest.mark.parametrize("blocked", [False, True], ids=["sigint-default", "sigint-blocked"])
def test_ctrl_c_stops_every_worker(gcloud, fake_train, tmp_path, sigint_default, blocked):
    """`python -m tpustream.pod` in a process of its own, as a user runs it, gets the Ctrl-C.

    It starts with SIGINT at its default, as a terminal's shell starts it (one
    started with SIGINT ignored, as a script's background job, ignores Ctrl-C
    like any program), or blocked, as by a parent that starts it from a thread
    with signals blocked: it unblocks SIGINT.
    """
    pids = tmp_path / "pids"
    pids.mkdir()
    (tmp_path / "remote").mkdir()
    options = ["--tpu", "tpu1", "--zone", "europe-west4-a", "--workdir", str(tmp_path / "remote")]
    mask = signal.pthread_sigmask(signal.SIG_BLOCK if blocked else signal.SIG_UNBLOCK, {signal.SIGINT})
    try:
        launcher = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tpustream.pod",
                *options,
                "--poll-interval",
                "0.01",
                "--grace",
                "0",
                "--restart",
                "--",
                sys.executable,
                str(fake_train),
                "fake_hang=0,1",  # workers 0 and 1 hang until stopped
                f"fake_pids={pids}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        start = time.monotonic()
        while len(list(pids.glob("*.child"))) < 2 and time.monotonic() < start + 60:
            time.sleep(0.02)
        hanging, waited = sorted(p.name for p in pids.glob("*.child")), time.monotonic() - start
        launcher.send_signal(signal.SIGINT)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    before = f"hanging before the Ctrl-C: {hanging} after {waited:.1f}s"
    assert launcher.returncode == 130, f"{before}\n{err[-3000:]}"
    assert "interrupted (Ctrl-C); worker(s) 0, 1 stopped by the launcher" in err
    hung = [int(p.read_text()) for p in pids.iterdir()]
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in hung) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(hung) == 4 and not any(alive(pid) for pid in hung)


# Where a Ctrl-C could escape the launcher's stopping of its workers (a worker started,
# not yet recorded), and how the test puts it there: SIGINT to pytest's own process,
# which main() handles meanwhile.


def _sigint_after_the_first_start(monkeypatch, gcloud, pids) -> None:
    """Between starting worker 0's gcloud and recording it for stopping."""
    real_start, sent = supervise.start, []

    def start(argv):
        proc = real_start(argv)
        if not sent:
            sent.append(proc)
            os.kill(os.getpid(), signal.SIGINT)
        return proc

    monkeypatch.setenv("FAKE_HANG", "0,1")
    monkeypatch.setattr(supervise, "start", start)


def _sigint_while_stopping(monkeypatch, gcloud, pids) -> None:
    """As the launcher stops worker 0 because worker 1 failed."""
    real_stop, sent = supervise.stop, []

    def stop(proc):
        if not sent:
            sent.append(proc)
            os.kill(os.getpid(), signal.SIGINT)
        real_stop(proc)

    gcloud.script(workers=2, ssh={"1": [1]})
    monkeypatch.setenv("FAKE_HANG", "0")
    monkeypatch.setenv("FAKE_WAIT_PIDS", "2")  # worker 1 fails once both run
    monkeypatch.setattr(supervise, "stop", stop)


class _SigintWhenCollected:
    def __del__(self) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0)  # the handler runs here: a KeyboardInterrupt from a __del__ is printed and ignored


def _sigint_lost_in_a_del(monkeypatch, gcloud, pids) -> None:
    """While the launcher waits for the hung workers, inside a __del__, which swallows KeyboardInterrupt."""
    sent = []

    class Events(queue.Queue):
        def get(self, *args, **kwargs):
            if not sent and len(list(pids.glob("*.child"))) == 2:
                sent.append(True)
                _SigintWhenCollected()  # collected at once, on this (the main) thread
            return super().get(*args, **kwargs)

    monkeypatch.setenv("FAKE_HANG", "0,1")
    monkeypatch.setattr(supervise, "queue", types.SimpleNamespace(Queue=Events, Empty=queue.Empty))


@pytest.mark.parametrize(
    "window, summary",
    [
        (_sigint_after_the_first_start, "interrupted (Ctrl-C); worker(s) 0 stopped by the launcher"),
        (
            _sigint_while_stopping,
            "interrupted (Ctrl-C); worker 1 exited with 1; worker(s) 0 stopped by the launcher",
        ),
        (_sigint_lost_in_a_del, "interrupted (Ctrl-C); worker(s) 0, 1 stopped by the launcher"),
    ],
    ids=["after-the-first-start", "while-stopping", "lost-in-a-del"],
)
def test_a_ctrl_c_at_any_moment_stops_every_worker_and_exits_130(
    gcloud, fake_train, tmp_path, monkeypatch, capfd, sigint_default, window, summary
):
    """The launcher's handler records the Ctrl-C first; starting and stopping poll it instead of being cut.

    Raised there, the KeyboardInterrupt left worker 0's gcloud and training running
    (after-the-first-start, while-stopping: exit 130, no cleanup), or was lost and
    the launch went on until the hung workers ended by themselves (lost-in-a-del).
    """
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.setenv("FAKE_PID_DIR", str(pids))
    window(monkeypatch, gcloud, pids)
    code = launch(tmp_path, "--restart", command=[sys.executable, str(fake_train)])
    _, err = capfd.readouterr()
    assert code == 130, err
    assert f"[launch] {summary}\n" in err
    deadline = time.monotonic() + 5
    while launched_processes(gcloud) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert launched_processes(gcloud) == []


def test_sigint_handling_keeps_an_ignored_sigint_and_restores_the_handler(sigint_default):
    """Started with SIGINT ignored, the launcher ignores Ctrl-C; in pytest's process it leaves no handler."""
    with interrupts.handling():
        assert signal.getsignal(signal.SIGINT) not in (signal.default_int_handler, signal.SIG_IGN)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with interrupts.handling():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert not interrupts.received()


def test_after_a_failure_the_others_get_the_grace_period_to_end_on_their_own(
    gcloud, fake_train, tmp_path, monkeypatch, capfd
):
    gcloud.script(workers=2, ssh={"0": [PREEMPTED_EXIT_CODE], "1": [PREEMPTED_EXIT_CODE]})
    monkeypatch.setenv("FAKE_SLOW", "1")  # worker 1 saves for a while, then exits 75 too
    code = launch(tmp_path, "--grace", "10", command=[sys.executable, str(fake_train)])
    _, err = capfd.readouterr()
    assert code == PREEMPTED_EXIT_CODE
    assert "the other workers get 10s to end on their own" in err
    assert (
        "worker 0 exited with 75; worker 1 exited with 75\n" in err and "stopped by the launcher" not in err
    )


@pytest.mark.parametrize(
    "codes, reason",
    [
        ({"0": [PREEMPTED_EXIT_CODE], "1": [PREEMPTED_EXIT_CODE]}, r"worker \d exited with 75 \(preempted"),
        ({"1": [255]}, r"worker 1 exited with 255 \(ssh connection lost\)"),
    ],
    ids=["preempted-75", "connection-lost-255"],
)
def test_restart_after_preemption_or_lost_connection_once_ready(
    gcloud, fake_train, tmp_path, capfd, codes, reason
):
    gcloud.script(workers=2, ssh=codes, states=["READY", "RESTARTING", "READY"])
    # With a grace period the other worker ends by itself, so every attempt reaches both workers.
    code = launch(tmp_path, "--restart", "--grace", "10", command=[sys.executable, str(fake_train)])
    _, err = capfd.readouterr()
    assert code == 0, err
    assert re.search(f"restart 1 of 3: {reason}", err)
    assert "TPU tpu1 is RESTARTING; checking again" in err
    assert len(gcloud.calls("describe")) == 3
    assert [len(gcloud.worker_runs(w)) for w in (0, 1)] == [2, 2]


def test_restart_stops_after_max_restarts(gcloud, fake_train, tmp_path, capfd):
    gcloud.script(workers=2, ssh={"0": [PREEMPTED_EXIT_CODE] * 5, "1": [PREEMPTED_EXIT_CODE] * 5})
    code = launch(
        tmp_path,
        "--restart",
        "--grace",
        "10",
        "--max-restarts",
        "2",
        command=[sys.executable, str(fake_train)],
    )
    _, err = capfd.readouterr()
    assert code == PREEMPTED_EXIT_CODE
    assert "restart 2 of 2" in err and "restart(s) of --max-restarts are used up" in err
    assert re.search(
        r"worker \d exited with 75 \(preempted; last.pt was saved\); the 2 restart\(s\) of --max-restarts "
        r"are used up \(2 after preemptions\): giving up\n",
        err,
    )
    assert [len(gcloud.worker_runs(w)) for w in (0, 1)] == [3, 3]


# --- hangs: exit 76, the watchdog's -----------------------------------------------------

HUNG_RUN = "output_dir=gs://b/runs/x"  # where the stacks are named


def test_a_hang_on_every_host_is_one_restart(gcloud, fake_train, tmp_path, monkeypatch, capfd):
    """One host hangs, the others wait for it in a collective and their watchdogs fire too."""
    gcloud.script(workers=3, ssh={w: [HUNG_EXIT_CODE] for w in ("0", "1", "2")})
    monkeypatch.setenv("FAKE_SLOW", "1,2")  # they end after the first, within the grace period
    code = launch(tmp_path, "--restart", "--grace", "10", command=[sys.executable, str(fake_train), HUNG_RUN])
    _, err = capfd.readouterr()
    assert code == 0, err
    assert re.search(r"(worker \d exited with 76(; |\n)){3}", err)  # all three ended by themselves
    (restart,) = re.findall(r"restart \d of 3: .*", err)
    assert re.fullmatch(
        r"restart 1 of 3: worker \d hung \(exit 76; stacks in gs://b/runs/x/watchdog/\); "
        r"waiting for TPU tpu1 to be READY",
        restart,
    )
    assert [len(gcloud.worker_runs(w)) for w in (0, 1, 2)] == [2, 2, 2]


def test_a_hang_and_the_others_stopped_is_one_restart(gcloud, fake_train, tmp_path, monkeypatch, capfd):
    """Worker 0's watchdog fires first; worker 1, waiting in a collective, is stopped by the launcher."""
    pids = tmp_path / "pids"
    pids.mkdir()
    gcloud.script(workers=2, ssh={"0": [HUNG_EXIT_CODE]})
    monkeypatch.setenv("FAKE_PID_DIR", str(pids))
    monkeypatch.setenv("FAKE_HANG", "1@0")  # hangs in the first attempt only
    monkeypatch.setenv("FAKE_WAIT_PIDS", "2")  # worker 0 ends once both run
    started = time.monotonic()
    code = launch(tmp_path, "--restart", command=[sys.executable, str(fake_train), HUNG_RUN])
    _, err = capfd.readouterr()
    assert code == 0, err
    assert "worker 0 exited with 76; worker(s) 1 stopped by the launcher\n" in err
    (restart,) = re.findall(r"restart \d of 3: .*", err)
    assert restart.startswith("restart 1 of 3: worker 0 hung (exit 76; stacks in gs://b/runs/x/watchdog/)")
    hung = [int((pids / f"1.{kind}").read_text()) for kind in ("pid", "child")]
    assert not any(alive(pid) for pid in hung)  # the cleanup before the restart killed them
    assert [len(gcloud.worker_runs(w)) for w in (0, 1)] == [2, 2]
    assert time.monotonic() - started < 20  # not the hung worker's 30s


@pytest.mark.parametrize(
    "codes, used",
    [
        ([HUNG_EXIT_CODE] * 3, "2 after hangs"),
        ([PREEMPTED_EXIT_CODE, HUNG_EXIT_CODE, HUNG_EXIT_CODE], "1 after a preemption, 1 after a hang"),
    ],
    ids=["hangs", "preemption-then-hangs"],
)
def test_hangs_count_against_max_restarts(gcloud, fake_train, tmp_path, capfd, codes, used):
    """A hang that comes back at the same place is not cured by restarting: it gives up at the bound."""
    gcloud.script(workers=2, ssh={"0": codes, "1": codes})
    options = ["--restart", "--grace", "10", "--max-restarts", "2"]
    code = launch(tmp_path, *options, command=[sys.executable, str(fake_train), HUNG_RUN])
    _, err = capfd.readouterr()
    assert code == HUNG_EXIT_CODE
    assert len(re.findall(r"restart \d of 2: ", err)) == 2
    assert re.search(
        r"\[launch\] worker \d hung \(exit 76; stacks in gs://b/runs/x/watchdog/\); the 2 restart\(s\) of "
        rf"--max-restarts are used up \({used}\): giving up\n",
        err,
    )
    assert [len(gcloud.worker_runs(w)) for w in (0, 1)] == [3, 3]


@pytest.mark.parametrize(
    "command, stacks",
    [
        (["python", "train.py", "++output_dir='gs://b/runs/y/'"], "gs://b/runs/y/watchdog/"),
        (["python", "train.py", "output_dir=/data/runs/y"], "/data/runs/y/watchdog/ on the hosts"),
        (["python", "train.py"], "output_dir/watchdog/ on the hosts (the run's folder under ~/w/outputs/)"),
    ],
)
def test_a_hang_names_where_the_stacks_are(command, stacks):
    first, second = commands.launch_workers(spec(), 2)
    result = supervise.AttemptResult(exits={second: 0, first: HUNG_EXIT_CODE})
    launched = spec(command=tuple(command), workdir="~/w")
    assert result.restart_cause() == (first, HUNG_EXIT_CODE)
    assert result.restart_reason(launched) == f"worker 0 hung (exit 76; stacks in {stacks})"


def test_without_restart_a_hang_says_what_restart_would_do(gcloud, fake_train, tmp_path, capfd):
    gcloud.script(workers=1, ssh={"0": [HUNG_EXIT_CODE]})
    code = launch(tmp_path, command=[sys.executable, str(fake_train), HUNG_RUN])
    _, err = capfd.readouterr()
    assert code == HUNG_EXIT_CODE
    hung = "worker 0 hung (exit 76; stacks in gs://b/runs/x/watchdog/)"
    assert f"{hung}: --restart would relaunch the same command" in err


def test_no_restart_without_the_flag_or_on_a_tpu_that_cannot_come_back(gcloud, fake_train, tmp_path, capfd):
    gcloud.script(workers=1, ssh={"0": [PREEMPTED_EXIT_CODE, PREEMPTED_EXIT_CODE]})
    assert launch(tmp_path, command=[sys.executable, str(fake_train)]) == PREEMPTED_EXIT_CODE
    assert "--restart would relaunch" in capfd.readouterr().err
    # The log counts on: the next run of worker 0 is its attempt 1, the next describe the second.
    gcloud.script(workers=1, ssh={"0": [0, PREEMPTED_EXIT_CODE]}, states=["READY", "READY", "PREEMPTED"])
    assert launch(tmp_path, "--restart", command=[sys.executable, str(fake_train)]) == 2
    err = capfd.readouterr().err
    assert "error: TPU tpu1 is PREEMPTED: a preemptible or spot TPU VM does not come back" in err


def test_dry_run_prints_the_commands_and_runs_nothing(gcloud, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(commands, "new_run_id", lambda: "r1")
    argv = ["--tpu", "tpu1", "--zone", "z", "--project", "p", "--num-workers", "2", "--dry-run"]
    assert main([*argv, "--", ".venv/bin/python", "train.py", "x=a b"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    s = spec(zone="z", project="p", command=(".venv/bin/python", "train.py", "x=a b"))
    expected = [
        commands.preflight_command(s),
        *commands.worker_commands(s, commands.launch_workers(s, 2), "r1"),
        *commands.cleanup_commands(s, "r1"),
    ]
    assert [shlex.split(line) for line in lines] == expected
    assert gcloud.calls() == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--env", "NOEQUALS", "--", "x"], "--env 'NOEQUALS': expected NAME=VALUE"),
        (["--env", "1X=2", "--", "x"], "--env '1X=2'"),
        (["--env", "A-B=1", "--", "x"], "--env 'A-B=1'"),
        (["--env", "=v", "--", "x"], "--env '=v'"),
        ([], "no command: put it after --"),
        (["--"], "no command: put it after --"),
        (["--max-restarts", "-1", "--", "x"], "--max-restarts must be >= 0"),
        (["--restart", "--", "python", "train.py", "resume=overwrite"], "would start the run over"),
        (["--bogus", "--", "x"], "unrecognized arguments: --bogus"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(gcloud, capsys, argv, message):
    assert main(["--tpu", "t", "--zone", "z", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and err.count("\n") == 1
    assert gcloud.calls() == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["frobnicate"], "error: unknown command 'frobnicate' (known: create, delete, gke-manifest; "),
        (["gke-manifests", "--type", "v4-8"], "command 'gke-manifests'; did you mean 'gke-manifest'?"),
        (["tpu1", "--zone", "z", "--", "x"], "unknown command 'tpu1' (known: "),
    ],
)
def test_an_unknown_command_is_named_with_the_known_ones(gcloud, capsys, argv, message):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and err.count("\n") == 1
    assert "a launch starts with its options: --tpu NAME --zone ZONE" in err and "required" not in err
    assert gcloud.calls() == []


def test_gcloud_missing_or_describe_failing_is_one_line_and_exit_2(gcloud, tmp_path, monkeypatch, capsys):
    gcloud.script(describe_error="NOT_FOUND: Resource 'projects/p/locations/z/nodes/t' was not found")
    assert main(["--tpu", "t", "--zone", "z", "--", "x"]) == 2
    err = capsys.readouterr().err
    assert "gcloud describe t in z failed: ERROR: (gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND" in err
    assert err.count("\n") == 1
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert main(["--tpu", "t", "--zone", "z", "--", "x"]) == 2
    assert "gcloud not found on PATH" in capsys.readouterr().err


def test_sync_ships_the_checkout_and_installs_it_on_every_worker(gcloud, tmp_path, monkeypatch, capfd):
    gcloud.script(workers=2, scp_copy=True)
    # python3 on the "hosts": `-m venv .venv` makes a .venv/bin/pip that records its arguments.
    shims = tmp_path / "shims"
    shims.mkdir()
    pip_log = tmp_path / "pip.log"
    (shims / "pip").write_text(f'#!/bin/bash\necho "$PWD $*" >> {shlex.quote(str(pip_log))}\n')
    (shims / "python3").write_text(
        f'#!/bin/bash\n[ "$1 $2" = "-m venv" ] || exit 3\nmkdir -p "$3/bin" && cp {shims}/pip "$3/bin/pip"\n'
    )
    for shim in ("pip", "python3"):
        (shims / shim).chmod(0o755)
    monkeypatch.setenv("PATH", f"{gcloud.bin}{os.pathsep}{shims}{os.pathsep}{os.environ['PATH']}")
    code = launch(
        tmp_path,
        "--sync",
        command=[sys.executable, "-c", "print('hi')"],
    )
    _, err = capfd.readouterr()
    assert code == 0, err
    (scp,) = gcloud.calls("scp")
    assert scp[6:] == ["--worker=all", "--zone=europe-west4-a"] and scp[5].startswith(
        "tpu1:/tmp/tpustream-src-"
    )
    install = [c for c in gcloud.calls("ssh") if "--worker=all" in c]
    assert (
        len(install) == 1
        and "python3 -m venv .venv && .venv/bin/pip install --quiet -e '.[tpu]'" in install[0][6]
    )
    run = spec(workdir=str(tmp_path / "remote"), command=(sys.executable, "-c", "print('hi')"))
    runs = sorted(gcloud.calls("ssh")[-2:])  # the two workers start concurrently
    assert runs == [
        argv[1:] for argv in commands.worker_commands(run, commands.launch_workers(run, 2), gcloud.run_id())
    ]
    remote = tmp_path / "remote"
    assert pip_log.read_text() == f"{remote} install --quiet -e .[tpu]\n"
    tracked = set(sync.source_files(REPO))
    shipped = {
        str(p.relative_to(remote)) for p in remote.rglob("*") if p.is_file() and ".venv" not in p.parts
    }
    assert shipped == tracked
    assert {"train.py", "pyproject.toml", "conf/config.yaml", "src/tpustream/errors.py"} <= shipped
    assert not Path(scp[5].split(":", 1)[1]).exists()  # the install step removed the tarball


def test_sync_without_git_ships_the_sources_not_venvs_or_outputs(tmp_path):
    root = tmp_path / "checkout"
    for name in (
        "train.py",
        "pyproject.toml",
        "conf/config.yaml",
        "src/pkg/data/a.py",
        ".venv/bin/python",
        "outputs/run/x.log",
        "data/big.tar",
        "src/pkg/__pycache__/a.pyc",
        "src/pkg.egg-info/PKG-INFO",
    ):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("x")  # fmt: skip
    files = sync.source_files(root)
    assert files == ["conf/config.yaml", "pyproject.toml", "src/pkg/data/a.py", "train.py"]
    sync.build_tarball(root, files, tmp_path / "src.tar.gz")
    with tarfile.open(tmp_path / "src.tar.gz") as tar:
        assert sorted(tar.getnames()) == files and {m.uname for m in tar.getmembers()} == {""}


def test_help_works_without_importing_torch():
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tpustream.pod", "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert done.returncode == 0 and "--max-restarts" in done.stdout and "--sync" in done.stdout
    assert " torch\n" not in done.stderr and "omegaconf" not in done.stderr


def test_the_pod_package_imports_only_the_standard_library():
    """It runs on the user's machine, which may have gcloud and python but not torch."""
    check = (
        "import sys; before = set(sys.modules); import tpustream.pod.__main__; "
        "assert 'torch' not in sys.modules and 'omegaconf' not in sys.modules; "
        "new = {name.split('.')[0] for name in set(sys.modules) - before}; "
        "print(sorted(new - set(sys.stdlib_module_names) - {'tpustream'}))"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO)
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


def test_console_script_runs_the_launcher_and_returns_its_exit_code():
    script = Path(sys.executable).parent / "tpustream-pod"
    assert script.exists(), f"no {script}: run scripts/bootstrap.sh (pyproject.toml's [project.scripts])"
    done = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--max-restarts" in done.stdout
    done = subprocess.run([str(script), "--tpu", "t", "--zone", "z"], capture_output=True, text=True)
    assert done.returncode == 2 and "error: no command: put it after --" in done.stderr
