"""The progress watchdog: what it allows, what it collects, what train.py makes of it, and runs that hang."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import torch.nn as nn

from tests import user_stages, zygote
from tests.conftest import REPO, popen_train, train_command
from tests.fake_runtime import tiny_config, tiny_model
from tpustream import preemption, watchdog
from tpustream.errors import HUNG_EXIT_CODE, PREEMPTED_EXIT_CODE
from tpustream.progress import Heartbeat
from tpustream.watchdog import AUTO_FLOOR_SECONDS, AUTO_STEP_MULTIPLE, Limits, Watchdog, allowances
from tpustream.watchdog.reports import Hung, Reports
from tpustream.watchdog.stacks import (
    dump_workers,
    enable_worker_dumps,
    faulthandler_threads,
    thread_stacks,
    watch_workers,
    where_stuck,
    worker_where,
)

AUTO = Limits(steady=None, first_step=3600, stop_grace=20, enabled=True)


def steady_heartbeat(step_seconds: float = 0.0, steps: int = 0) -> Heartbeat:
    """A heartbeat past its first steps, with `steps` intervals of step_seconds."""
    heartbeat = Heartbeat()
    heartbeat.compiling, heartbeat.compile_steps_left = None, 0
    heartbeat.step_intervals.extend([step_seconds] * steps)
    return heartbeat


# -- what it allows ----------------------------------------------------------------


def test_auto_is_the_floor_until_steps_are_known_then_a_multiple_of_their_median():
    (floor,) = allowances(AUTO, steady_heartbeat(), stopped=False)
    assert (floor.seconds, floor.exit_code) == (AUTO_FLOOR_SECONDS, HUNG_EXIT_CODE)
    (quick,) = allowances(AUTO, steady_heartbeat(0.2, steps=50), stopped=False)
    assert quick.seconds == AUTO_FLOOR_SECONDS  # 20 x 0.2 s is under the floor
    slow = steady_heartbeat(100.0, steps=40)
    slow.step_intervals.extend([5000.0] * 9)  # an epoch end or two among them: the median holds
    (long,) = allowances(AUTO, slow, stopped=False)
    assert long.seconds == AUTO_STEP_MULTIPLE * 100.0 and "median step of 100.00 s" in long.why


def test_compiling_gets_the_first_step_allowance_but_a_wait_for_input_does_not():
    heartbeat = Heartbeat()  # a process that has just started: compiling its first steps
    (first,) = allowances(AUTO, heartbeat, stopped=False)
    assert first.seconds == 3600 and "compiling" in first.why
    heartbeat.input_wait_started()  # what was compiled is compiled: a stuck input is found as fast
    assert allowances(AUTO, heartbeat, stopped=False)[0].seconds == AUTO_FLOOR_SECONDS
    heartbeat.input_wait_ended()
    assert allowances(AUTO, heartbeat, stopped=False)[0].seconds == 3600


def test_the_first_steps_after_a_compile_end_it_and_their_intervals_are_not_steps():
    heartbeat = Heartbeat()
    heartbeat.step_finished("a training step", 0, 1)  # traced; compiled when the next batch cut it
    assert heartbeat.compiling is not None
    heartbeat.step_finished("a training step", 0, 2)
    assert heartbeat.compiling is None and not heartbeat.step_intervals
    heartbeat.step_finished("a training step", 0, 3)
    assert len(heartbeat.step_intervals) == 1
    heartbeat.expect_compile("the first evaluation")
    heartbeat.step_finished("an evaluation step")
    heartbeat.step_finished("an evaluation step")
    heartbeat.step_finished("a training step", 1, 1)  # the interval across the evaluation is no step's
    assert len(heartbeat.step_intervals) == 1 and heartbeat.last_finished() == "training step 1 of epoch 1"


def test_a_stop_request_adds_its_grace_but_not_to_a_compile_and_zero_turns_only_the_hang_watch_off():
    (grace, hang) = sorted(allowances(AUTO, steady_heartbeat(), stopped=True), key=lambda a: a.exit_code)
    assert (grace.seconds, grace.exit_code) == (20, PREEMPTED_EXIT_CODE) and hang.exit_code == HUNG_EXIT_CODE
    compiling = Heartbeat()  # a stop during a compile waits for it: its progress cannot be seen
    assert [a.exit_code for a in allowances(AUTO, compiling, stopped=True)] == [HUNG_EXIT_CODE]
    compiling.input_wait_started()
    assert PREEMPTED_EXIT_CODE in [a.exit_code for a in allowances(AUTO, compiling, stopped=True)]
    off = Limits(steady=0.0, first_step=3600, stop_grace=20, enabled=False)
    assert allowances(off, steady_heartbeat(), stopped=False) == []
    assert [a.exit_code for a in allowances(off, steady_heartbeat(), stopped=True)] == [PREEMPTED_EXIT_CODE]
    assert not Watchdog(Limits(0.0, 3600, 0, False), 0, ".").active


def test_limits_come_from_the_config_section(compose_config):
    cfg = compose_config("watchdog.seconds=30", "watchdog.stop_grace_seconds=5")
    from tpustream.launch import resolve_config

    limits = Limits.from_config(resolve_config(cfg)[0].watchdog)
    assert limits == Limits(steady=30.0, first_step=3600.0, stop_grace=5.0, enabled=True)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("watchdog.seconds=soon", "watchdog.seconds must be a number of seconds >= 0"),
        ("watchdog.seconds=-1", "watchdog.seconds must be a number of seconds >= 0"),
        ("watchdog.first_step_seconds=0", "watchdog.first_step_seconds must be > 0"),
        ("watchdog.stop_grace_seconds=-2", "watchdog.stop_grace_seconds must be >= 0"),
    ],
)
def test_bad_watchdog_settings_are_one_line_errors(compose_config, override, message):
    from tpustream.errors import ConfigError
    from tpustream.launch import resolve_config
    from tpustream.launch.checks import check_config

    with pytest.raises(ConfigError, match=message):
        check_config(resolve_config(compose_config(override))[0])


def test_the_verdict_counts_a_stop_grace_from_the_later_of_the_request_and_the_last_progress(monkeypatch):
    heartbeat = steady_heartbeat()
    dog = Watchdog(
        Limits(steady=100.0, first_step=3600, stop_grace=10, enabled=True), 0, ".", heartbeat=heartbeat
    )
    start = heartbeat.at
    assert dog.verdict(start + 50) is None
    monkeypatch.setattr(preemption, "stop_requested", lambda: True)
    assert dog.verdict(start + 60) is None  # the request is seen now: 10 s from here
    heartbeat.at = start + 65  # the step goes on
    assert dog.verdict(start + 74) is None
    stopped = dog.verdict(start + 75.5)
    assert stopped.exit_code == PREEMPTED_EXIT_CODE and "after the stop request" in stopped.headline()
    monkeypatch.setattr(preemption, "stop_requested", lambda: False)
    hung = Watchdog(dog.limits, 0, ".", heartbeat=steady_heartbeat()).verdict(heartbeat.at + 1000)
    assert hung.exit_code == HUNG_EXIT_CODE and "nothing progressed (allowed 100 s)" in hung.headline()


def test_the_thread_fires_once_nothing_moves_and_not_while_something_does():
    heartbeat = steady_heartbeat()
    fired = threading.Event()
    dog = Watchdog(Limits(0.3, 3600, 0, True), 0, ".", heartbeat=heartbeat, on_fire=lambda _: fired.set())
    dog.start()
    try:
        for _ in range(12):  # 1.2 s of beats every 0.1 s
            heartbeat.beat("a batch received")
            time.sleep(0.1)
        assert not fired.is_set()
        assert fired.wait(5) and dog.fired.exit_code == HUNG_EXIT_CODE
    finally:
        dog.stop()


def test_a_replica_fires_when_another_replica_of_its_host_has(tmp_path):
    reports = Reports(str(tmp_path))
    dog = Watchdog(AUTO, 1, ".", reports=reports, heartbeat=steady_heartbeat())
    assert dog.sibling_verdict(time.monotonic()) is None
    reports.write(0, {"exit_code": HUNG_EXIT_CODE, "headline": "nothing progressed", "stacks": "x"})
    verdict = dog.sibling_verdict(time.monotonic())
    assert verdict.exit_code == HUNG_EXIT_CODE and verdict.headline().startswith("replica 0 of this host")


# -- what it collects -----------------------------------------------------------------


def _park_here(ready: threading.Event, done: threading.Event) -> None:
    ready.set()
    done.wait()


def test_thread_stacks_name_where_each_thread_waits_past_the_standard_library():
    ready, done = threading.Event(), threading.Event()
    parked = threading.Thread(target=_park_here, args=(ready, done), name="parked")
    parked.start()
    try:
        ready.wait()
        stacks = {stack.name: stack for stack in thread_stacks(first=parked.ident)}
        assert list(stacks)[0] == "parked"  # `first` leads
        assert stacks["parked"].where.startswith("threading.py:") and "_park_here" in stacks["parked"].where
        assert "_park_here" in stacks["parked"].text and stacks["parked"].outside_standard_library
    finally:
        done.set()
        parked.join()
    assert where_stuck([("/src/tpustream/x.py", 3, "f")]) == "x.py:3 f"
    assert where_stuck([]) == "no Python frame"


def test_faulthandler_dumps_are_read_back_into_threads_and_frames(tmp_path):
    path = tmp_path / "dump.txt"
    with open(path, "w") as dump:
        faulthandler.dump_traceback(dump, all_threads=True)
    threads = faulthandler_threads(path.read_text())
    assert threads and any(
        frame[2] == "test_faulthandler_dumps_are_read_back_into_threads_and_frames"
        for _, frames in threads
        for frame in frames
    )
    assert worker_where("") == "no stack"


def _worker_stuck_in_a_stage(folder: str, ready) -> None:
    enable_worker_dumps(folder)
    _a_stage_that_never_returns(ready)


def _a_stage_that_never_returns(ready) -> None:
    ready.set()
    threading.Event().wait()


def test_a_worker_that_enabled_dumps_answers_the_signal_with_its_stacks(tmp_path):
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    worker = context.Process(target=_worker_stuck_in_a_stage, args=(str(tmp_path), ready), daemon=True)
    worker.start()

    class Loader:  # a loader as watch_workers sees it: a bound method naming its workers
        def worker_pids(self):
            return [worker.pid]

    loader = Loader()
    try:
        assert ready.wait(60)
        watch_workers(loader.worker_pids)
        ((pid, dump),) = [item for item in dump_workers(str(tmp_path)) if item[0] == worker.pid]
        assert worker.is_alive()  # a dump, not a death
        assert "_a_stage_that_never_returns" in worker_where(dump)
    finally:
        worker.kill()
        worker.join()


# -- what train.py makes of it -----------------------------------------------------------


def test_train_py_gets_76_if_any_replica_hung_75_if_all_were_stops_and_nothing_otherwise(tmp_path):
    reports = Reports(str(tmp_path / "reports"))
    os.makedirs(reports.path)
    reports.raise_verdict(str(tmp_path / "run"))  # no report: the replicas' own ends stand
    reports.write(1, {"exit_code": PREEMPTED_EXIT_CODE, "headline": "the step did not finish", "stacks": "a"})
    with pytest.raises(preemption.Preempted, match="replica 1: the step did not finish; stacks in a"):
        reports.raise_verdict(str(tmp_path / "run"))
    reports.write(0, {"exit_code": HUNG_EXIT_CODE, "headline": "nothing progressed", "stacks": "b"})
    with pytest.raises(Hung, match=r"replica 0: nothing progressed; stacks in b \| replica 1") as hung:
        reports.raise_verdict(str(tmp_path / "run"))
    assert hung.value.exit_code == HUNG_EXIT_CODE == 76


def test_a_backstop_dump_is_copied_to_the_run_folder_and_counts_as_a_hang(tmp_path):
    reports = Reports(str(tmp_path / "reports"))
    os.makedirs(reports.path)
    with open(reports.backstop_path(2), "w") as dump:
        faulthandler.dump_traceback(dump, all_threads=True)
    with pytest.raises(Hung, match="replica 2: its watchdog's thread could not run") as hung:
        reports.raise_verdict(str(tmp_path / "run"))
    (name,) = os.listdir(tmp_path / "run" / "watchdog")
    assert name.startswith("replica-2-") and str(tmp_path / "run" / "watchdog" / name) in str(hung.value)
    assert "test_a_backstop_dump_is_copied" in (tmp_path / "run" / "watchdog" / name).read_text()


# -- the trainer's progress ---------------------------------------------------------------


class SlowAt(nn.Module):
    """tiny_model whose forward sleeps once, on call number `call` (1: the first step's trace)."""

    def __init__(self, call: int, seconds: float):
        super().__init__()
        self.inner, self.call, self.seconds, self.calls = tiny_model(), call, seconds, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.call:
            time.sleep(self.seconds)
        return self.inner(x)


@pytest.mark.parametrize(("slow_call", "fires"), [(1, False), (10, True)], ids=["first-step", "tenth-step"])
def test_a_first_step_slower_than_the_allowance_is_a_compile_a_later_one_a_hang(
    fake_job, tmp_path, slow_call, fires
):
    """watchdog.seconds=1: the first step taking 3 s is within first_step_seconds; the tenth is not."""
    cfg = tiny_config(str(tmp_path / "run"), epochs=1)
    fired: list = []
    limits = Limits(1.0, 30, 0, True)
    dog = Watchdog(limits, 0, cfg.output_dir, on_fire=fired.append, stop_requested=lambda: False)
    watchdog.start_watchdog(dog)
    try:
        job = fake_job(cfg, model=lambda: SlowAt(slow_call, 3.0))
    finally:
        watchdog.stop_watchdog(dog)
    assert job.results[0]["history"]  # the run itself went on (a recording watchdog exits nothing)
    assert bool(fired) == fires
    if fires:
        assert fired[0].exit_code == HUNG_EXIT_CODE and fired[0].finished == "training step 9 of epoch 0"


# -- runs that hang -----------------------------------------------------------------------


def blocking_run(digits_root: str, tmp_path, *overrides: str, after: int = 150) -> tuple[list[str], dict]:
    """A train.py command on digits whose stage blocks once, after `after` samples, and its environment.

    The stage runs on each of the 4 canonical streams (about 360 samples each): 150 blocks one
    about 40% into the epoch, after saves (every 2 steps).
    """
    command = train_command(
        f"data.root={digits_root}",
        f"output_dir={tmp_path}/run",
        f"hydra.run.dir={tmp_path}/h",
        "epochs=1",
        "eval_every=0",  # the hang is in training; the rerun's subject is its resume
        "log_steps=1",
        "checkpoint.every_n_steps=2",
        "data.stages=[tests.user_stages:block_once]",
        *overrides,
    )
    marker = str(tmp_path / "blocked")
    return command, {**os.environ, user_stages.BLOCK_MARKER: marker, user_stages.BLOCK_AFTER: str(after)}


def stacks_files(run: str) -> dict[str, str]:
    from tpustream import storage

    folder = storage.join(run, "watchdog")
    return {
        name: storage.read_bytes(storage.join(folder, name)).decode() for name in storage.list_names(folder)
    }


def assert_last_save_whole(run: str) -> None:
    """last.pt is a save from before the hang, whole (load_checkpoint verifies its digest)."""
    from tpustream.checkpoint import checkpoint_url, load_checkpoint

    assert load_checkpoint(checkpoint_url(run, "last.pt"))["global_step"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    # XLA through xmp.spawn's pool (train.py learns the exit from the report); eager in train.py itself.
    [("data.num_workers=0",), ("data.num_workers=2", "accelerator=cpu_eager", "accelerator.in_process=true")],
    ids=["xla-without-workers", "eager-with-2-workers"],
)
def test_a_stage_that_blocks_forever_ends_the_run_with_76_and_every_threads_stack(
    digits_root, tmp_path, overrides
):
    command, env = blocking_run(digits_root, tmp_path, *overrides, "watchdog.seconds=3")
    hung = zygote.run(command, cwd=REPO, env=env, timeout=300)
    assert hung.returncode == HUNG_EXIT_CODE, hung.stderr[-3000:]
    ((name, text),) = stacks_files(f"{tmp_path}/run").items()
    assert name.startswith("replica-0-")
    assert "block_once" in text  # the worker's faulthandler dump, or the loader thread's stack
    if "data.num_workers=2" in overrides:
        assert text.count("== DataLoader worker pid") == 2  # training's (eval_every=0: no validation workers)
    line = next(line for line in hung.stderr.splitlines() if "ERROR tpustream.watchdog" in line)
    assert "nothing progressed (allowed 3 s)" in line and "user_stages.py" in line and "block_once" in line
    assert re.search(r"last finished: training step \d+ of epoch 0", line)
    # The rerun of a folder the watchdog wrote its stacks into is the SIGTERM test's.
    assert_last_save_whole(f"{tmp_path}/run")


@pytest.mark.slow
def test_one_replica_of_the_simulated_pod_blocked_while_the_other_waits_in_the_all_reduce(
    digits_root, tmp_path
):
    command, env = blocking_run(
        digits_root,
        tmp_path,
        # Eager replicas over gloo: the launcher, the watchdog and the collective's wait are the
        # XLA pod's, without 2 processes importing torch_xla and compiling.
        "accelerator=cpu_eager",
        "accelerator.num_devices=2",
        "data.num_workers=0",
        "watchdog.seconds=3",
        after=300,  # each replica reads two streams in turn: 150 would block before its first step
    )
    hung = zygote.run(command, cwd=REPO, env=env, timeout=300)
    assert hung.returncode == HUNG_EXIT_CODE, hung.stderr[-3000:]
    files = stacks_files(f"{tmp_path}/run")
    assert sorted(name.split("-")[1] for name in files) == ["0", "1"]  # one file per replica
    blocked = [text for text in files.values() if "block_once" in text]
    waiting = [text for text in files.values() if "block_once" not in text]
    assert len(blocked) == len(waiting) == 1
    assert "gloo.py" in waiting[0].split("\n== ", 2)[1]  # its training thread, in a gloo collective
    assert_last_save_whole(f"{tmp_path}/run")


@pytest.mark.slow
def test_a_held_background_upload_ends_the_run_with_76_once_training_waits_for_it(
    faulty_gcs, digits_root, tmp_path
):
    """The proxy holds the second save's last step (the copy to last.pt): training goes on until the
    third save waits for it, then nothing moves; the stacks show the writer in that copy."""
    proxy = faulty_gcs
    run = "gs://faulty/run"
    command = train_command(
        f"data.root={digits_root}",
        f"output_dir={run}",
        f"hydra.run.dir={tmp_path}/h",
        "epochs=1",
        "checkpoint.every_n_steps=4",
        "data.num_workers=0",
        "accelerator=cpu_eager",  # the upload is this test's subject, not XLA
        "accelerator.in_process=true",  # train.py is the replica: the watchdog's exit is its own
        "watchdog.seconds=3",
    )
    proxy.hold, proxy.hold_skip = b"copyTo/b/faulty/o/run%2Fcheckpoints%2Flast.pt?", 1
    hung = zygote.run(command, cwd=REPO, env=dict(os.environ), timeout=300)
    assert hung.returncode == HUNG_EXIT_CODE, hung.stderr[-3000:]
    ((name, text),) = stacks_files(run).items()  # written to the bucket past the held request
    writer = next(
        section for section in text.split("\n== ") if section.startswith("thread checkpoint-writer")
    )
    assert "write_bytes_verified" in writer and "copy_blob" in writer
    training = text.split("\n== ")[1]
    assert training.startswith("training thread") and "wait_until_finished" in training
    proxy.drop_held = True  # the held copy dies with its client, never reaching the server
    proxy.release.set()
    from tpustream.checkpoint import checkpoint_url, load_checkpoint

    assert load_checkpoint(checkpoint_url(run, "last.pt"))["global_step"] == 4  # the first save, whole


@pytest.mark.slow
def test_sigterm_to_a_run_blocked_in_its_input_exits_75_within_the_grace(digits_root, tmp_path):
    """A preempted VM's SIGTERM while a DataLoader worker is stuck: the step cannot finish, so
    after watchdog.stop_grace_seconds the replica writes its stacks and exits 75, last.pt as its
    last save left it."""

    # 300 of a stream's ~360 samples: late in the epoch, long after the first steps compiled (a
    # stop during a compile waits for it), with the workers' read-ahead spent before it.
    command, env = blocking_run(
        digits_root,
        tmp_path,
        "data.num_workers=2",
        "accelerator=cpu_eager",  # without XLA's compiles; train.py and its replica process
        "watchdog.stop_grace_seconds=3",
        after=300,
    )
    process = popen_train(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 240
        while not os.path.exists(env[user_stages.BLOCK_MARKER]):
            assert process.poll() is None and time.monotonic() < deadline, "the stage never blocked"
            time.sleep(0.2)
        time.sleep(3)  # the pieces already made are consumed; the loop now waits for the stuck worker
        os.killpg(process.pid, signal.SIGTERM)
        signalled = time.monotonic()
        code = process.wait(timeout=120)
        seconds = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = process.stdout.read()
    assert code == PREEMPTED_EXIT_CODE, output[-3000:]
    assert seconds < 25, seconds  # the grace and the stacks, well inside a preempted VM's 30 s
    assert "the step did not finish after the stop request" in output
    ((name, text),) = stacks_files(f"{tmp_path}/run").items()
    assert "block_once" in text
    # last.pt is whole: the last save that finished, which a rerun resumes from as from any
    # (tests/test_resume.py, tests/test_pod_simulation.py).
    assert_last_save_whole(f"{tmp_path}/run")
