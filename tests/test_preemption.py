"""Stop signals: a process passes them on to the processes it started, until they are gone."""

from __future__ import annotations

import functools
import http.server
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, numbered_samples, popen_train, train_command, write_wds_shards
from tpustream import preemption
from tpustream.checkpoint import checkpoint_url, load_checkpoint
from tpustream.errors import PREEMPTED_EXIT_CODE


@pytest.fixture(autouse=True)
def forwarder_gone():
    """The forwarder thread must be gone before the next test starts children it would signal."""
    yield
    if preemption._forwarder is not None:
        preemption._forwarder.join(timeout=10)
        assert not preemption._forwarder.is_alive()


def test_a_stop_signal_is_passed_on_to_the_processes_this_one_started(monkeypatch):
    context = multiprocessing.get_context("spawn")
    child = context.Process(target=time.sleep, args=(60,))
    child.start()
    try:
        monkeypatch.setattr(preemption, "_requested", type(preemption._requested)())
        preemption._on_signal(signal.SIGINT, None)  # as the handler runs on Ctrl-C
        child.join(timeout=10)
        assert preemption.stop_requested() and child.exitcode == -signal.SIGTERM
    finally:
        if child.is_alive():
            child.kill()


def test_a_child_that_missed_the_first_signal_gets_it_again(monkeypatch):
    # A child that ignores the first SIGTERM (as one still starting up may miss it)
    # and then listens: the forwarder's next round reaches it.
    context = multiprocessing.get_context("spawn")
    deaf = context.Event()
    child = context.Process(target=_deaf_for_a_while, args=(deaf,))
    child.start()
    try:
        assert deaf.wait(timeout=30)
        monkeypatch.setattr(preemption, "FORWARD_AGAIN_SECONDS", 0.2)
        preemption.forward_stop_to_children()
        time.sleep(0.1)
        assert child.is_alive()  # the first SIGTERM was ignored
        child.join(timeout=20)
        assert child.exitcode == -signal.SIGTERM
    finally:
        if child.is_alive():
            child.kill()


def _deaf_for_a_while(deaf) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    deaf.set()
    time.sleep(1.0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(60)


# Starts a loader's workers on a thread (as under xmp.spawn) while the main thread
# signals the whole process group every 2 ms; the process itself only notes them.
STORM_SCRIPT = """
import functools, os, signal, sys, threading, time
from tests.conftest import make_stream
from tpustream.launch.replica import init_data_worker
from tpustream.data.read.loader import make_loader
from tpustream.data.resolve.split import load_manifest

for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda *_: None)  # a handler, not SIG_IGN: children must not inherit deafness
stream = make_stream(
    load_manifest(sys.argv[1]), batch_size=4, rank=0, world_size=1, num_workers=2, train=False, seed=0
)
loader = make_loader(stream, 2, worker_init_fn=functools.partial(init_data_worker, 0, 1))
errors = []


def start():
    try:
        loader.start_workers()
    except BaseException as exc:
        errors.append(repr(exc))


thread = threading.Thread(target=start)
thread.start()
started = None
deadline = time.time() + 60
while time.time() < deadline and (started is None or time.time() < started + 1.0):
    if started is None and not thread.is_alive():
        started = time.time()
    os.killpg(0, signal.SIGINT if len(str(time.time())) % 2 else signal.SIGTERM)
    time.sleep(0.002)
thread.join()
if errors:
    sys.exit(f"starting the workers failed: {errors[0]}")
print("batches", len(list(loader)))
loader.close()
"""


def test_loader_workers_survive_stop_signals_sent_while_they_start(write_split):
    """A Ctrl-C as the fork server starts (Python start-up, before it ignores them) must not kill it.

    Starts the workers from a thread, as a replica under xmp.spawn does, under a storm
    of SIGINT and SIGTERM to the process group that lasts until a second after they
    started; they must then deliver every batch.
    """
    folder = write_split("val", [numbered_samples(0, 8), numbered_samples(8, 8)])
    process = subprocess.run(
        [sys.executable, "-c", STORM_SCRIPT, folder],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    assert process.stdout.split() == ["batches", "4"]


ORPHAN_SCRIPT = """
import os, signal, sys
from multiprocessing import forkserver
from tests.conftest import make_stream
from tpustream.data.read.loader import make_loader
from tpustream.data.resolve.split import load_manifest

stream = make_stream(
    load_manifest(sys.argv[1]), batch_size=4, rank=0, world_size=1, num_workers=2, train=False, seed=0
)
loader = make_loader(stream, 2)
next(iter(loader))  # the workers are up and serving
workers = [w.pid for w in loader.loader._iterator._workers]
print(*workers, forkserver._forkserver._forkserver_pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_loader_workers_and_their_fork_server_die_with_a_killed_loader_process(write_split):
    """SIGKILLed (the OOM killer), a loader's process leaves no worker nor fork server behind."""
    folder = write_split("val", [numbered_samples(0, 8), numbered_samples(8, 8)])
    process = subprocess.run(
        [sys.executable, "-c", ORPHAN_SCRIPT, folder], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert process.returncode == -signal.SIGKILL, process.stderr[-3000:]
    pids = [int(pid) for pid in process.stdout.split()]
    assert len(pids) == 3
    deadline = time.time() + 20  # the workers look for their loader's process every 2 s
    while time.time() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.2)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "processes outlived their loader's process"


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan is reaped by init, maybe not at once)."""
    return os.path.exists(f"/proc/{pid}") and not preemption._zombie(pid)


def start_train(digits_root: str, tmp_path, *overrides: str, fresh: bool = False) -> subprocess.Popen:
    command = train_command(
        f"data.root={digits_root}",
        f"output_dir={tmp_path}/run",
        f"hydra.run.dir={tmp_path}/h",
        "log_steps=1",
        *overrides,
    )
    # A session of its own, so that the test can signal its process group as a terminal would.
    # fresh: a new interpreter, importing torch and torch_xla itself (not a zygote's fork).
    start = functools.partial(subprocess.Popen, text=True, cwd=REPO) if fresh else popen_train
    return start(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def wait_for(process: subprocess.Popen, pattern: str, lines: list[str]) -> None:
    deadline = time.time() + 300
    for line in process.stderr:
        lines.append(line)
        if re.search(pattern, line):
            return
        assert time.time() < deadline, f"no line matching {pattern!r}"
    pytest.fail(f"train.py ended before {pattern!r}:\n{''.join(lines[-30:])}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("signum", "target", "when", "saved_steps"),
    [
        # docker stop / Kubernetes: SIGTERM to the container's first process only.
        (signal.SIGTERM, "pid", r"Epoch=0 Step=3 Loss", 4),
        # Ctrl-C: SIGINT to the whole foreground group, while DataLoader workers start.
        (signal.SIGINT, "group", r"replica 0 of 1 on xla:0", 0),
        # A preempted VM: SIGTERM to the group right after the epoch's last training
        # step (digits: 23 steps of 64), as validation begins; the epoch's training is kept.
        (signal.SIGTERM, "group", r"Epoch=0 Step=22 Loss", 23),
    ],
    ids=[
        "sigterm-to-train.py-alone",
        "ctrl-c-while-workers-start",
        "sigterm-right-after-an-epochs-last-step",
    ],
)
def test_a_stop_signal_saves_last_pt_and_exits_75(digits_root, tmp_path, signum, target, when, saved_steps):
    process = start_train(digits_root, tmp_path, "epochs=2")
    lines: list[str] = []
    try:
        wait_for(process, when, lines)
        if target == "pid":
            os.kill(process.pid, signum)
        else:
            os.killpg(process.pid, signum)
        lines.extend(process.stderr)
        assert process.wait(timeout=300) == PREEMPTED_EXIT_CODE, "".join(lines[-40:])
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    text = "".join(lines) + process.stdout.read()  # Hydra logs train.py's own lines to stdout
    assert "Traceback" not in text, text[-3000:]
    saved = load_checkpoint(checkpoint_url(f"{tmp_path}/run", "last.pt"))
    assert saved["global_step"] >= saved_steps
    assert "run the same command to continue" in text


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_a_stop_before_the_replicas_start_ends_the_run_there(
    monkeypatch, compose_config, digits_root, signum, code
):
    """Requested before spawning, a stop is final: no replica starts (exit 75, Ctrl-C 130)."""
    from tpustream.launch import launch, prepare

    plan = prepare(compose_config(f"data.root={digits_root}", "resume=null"))
    monkeypatch.setattr(preemption, "_requested", type(preemption._requested)())
    monkeypatch.setattr(preemption, "_received", [])
    monkeypatch.setattr(preemption, "forward_stop_to_children", lambda: None)
    preemption._on_signal(signum, None)
    with pytest.raises(preemption.StoppedBeforeStart, match="before the replicas started") as stopped:
        launch(plan)  # it would spawn a replica that never hears of the stop
    assert stopped.value.exit_code == code
    with pytest.raises(preemption.StoppedBeforeStart, match="while the training split was read"):
        prepare(compose_config(f"data.root={digits_root}", "resume=null"))


def handlers_installed(pid: int) -> bool:
    """The process catches SIGTERM: train.py's stop handlers are in place (Python catches only SIGINT)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def finish(process: subprocess.Popen) -> str:
    try:
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return out + err


@pytest.mark.slow
def test_ctrl_c_while_train_py_starts_stops_it_before_any_replica(digits_root, tmp_path):
    """Ctrl-C in train.py's first second (its imports): exit 130, no replica, nothing written."""
    process = start_train(digits_root, tmp_path, "epochs=1", fresh=True)
    deadline = time.time() + 60
    while not handlers_installed(process.pid):
        assert time.time() < deadline and process.poll() is None, "train.py never installed its handlers"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGINT)
    text = finish(process)
    assert process.returncode == 130, text[-3000:]
    assert "stopped before training started (SIGINT" in text and "replica 0 of 1" not in text
    assert "Traceback" not in text and not (tmp_path / "run" / "checkpoints").exists()


@pytest.fixture
def slow_http_folder(tmp_path):
    """A folder served over http://127.0.0.1, each answer 2 s late: (folder, URL, first request seen)."""
    folder = tmp_path / "served"
    folder.mkdir()
    asked = threading.Event()

    class SlowHandler(http.server.SimpleHTTPRequestHandler):
        def send_head(self):
            asked.set()
            time.sleep(2.0)
            return super().send_head()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(SlowHandler, directory=folder)
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.mark.slow
def test_sigterm_while_samples_are_counted_stops_before_any_replica(slow_http_folder, tmp_path):
    """A SIGTERM while an unindexed split is counted (minutes for a large bucket): exit 75 at once."""
    folder, url, asked = slow_http_folder
    write_wds_shards(str(folder), "shard-%06d.tar", 40, maxcount=10)
    shards = f"'{url}/shard-{{000000..000003}}.tar'"
    command = train_command(
        f"data.train_shards={shards}",
        f"data.val_shards={shards}",
        "data.num_classes=10",
        f"output_dir={tmp_path}/run",
        f"hydra.run.dir={tmp_path}/h",
    )
    process = popen_train(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert asked.wait(timeout=120), "train.py never read the shards"
    finally:
        os.killpg(process.pid, signal.SIGTERM)
    text = finish(process)
    assert process.returncode == PREEMPTED_EXIT_CODE, text[-3000:]
    assert "stopped before training started (SIGTERM while counting samples" in text, text[-3000:]
    assert "replica 0 of 1" not in text and "Traceback" not in text
