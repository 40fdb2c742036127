"""tpustream.pod.commands: the gcloud commands, and their shell code run here by real shells."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tpustream.errors import PREEMPTED_EXIT_CODE, ConfigError
from tpustream.pod import commands
from tpustream.pod.spec import LaunchSpec

LAUNCHED_TRAIN = r'''
"""Stands for train.py on one host: starts a replica; on SIGTERM notes it and exits 75 (preempted)."""
import os, signal, subprocess, sys, time
from pathlib import Path


def stop(signum, frame):
    Path("got-sigterm").write_text(str(os.getpid()))
    sys.exit(75)


signal.signal(signal.SIGTERM, stop)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
Path("ready.tmp").write_text(f"{os.getpid()} {child.pid}")
os.rename("ready.tmp", "ready")
time.sleep(30)
'''

# Each reaches train.py unchanged only if every shell-special character is quoted.
OVERRIDES = [
    "optim.name=a b",
    "home=$HOME",
    "cmd=$(echo no)`echo no`",
    "say=\"double\" and 'single'",
    "glob=*",
    "data.train_shards=gs://b/x/train-{000000..000639}.tar",
    "k=v=w",
    "semi=a;b&&c|d>e",
    "tab=a\tb",
    "unicode=é",
]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def spec(**changes) -> LaunchSpec:
    values = {"tpu": "tpu1", "zone": "europe-west4-a", "command": (".venv/bin/python", "train.py")}
    return LaunchSpec(**{**values, **changes})


# --- command construction -------------------------------------------------------------


def test_remote_command_quotes_every_token_and_keeps_the_home_tilde():
    s = spec(command=(".venv/bin/python", "train.py", *OVERRIDES), env=(("MSG", "a $b c"),))
    remote = commands.remote_run_command(s, commands.Worker("tpu1", 0), "r1")
    assert remote.startswith("cd ~/tpustream && setsid --wait sh -c ") and remote.endswith("; exit $?")
    record = 'mkdir -p "$HOME/.tpustream/runs" && echo $$ > "$HOME/.tpustream/runs/r1.0.pid" && exec "$@"'
    assert shlex.split(remote.removesuffix("; exit $?")) == [
        "cd", "~/tpustream", "&&", "setsid", "--wait", "sh", "-c", record, "tpustream",
        "env", "PJRT_DEVICE=TPU", "TPUSTREAM_HOST_INDEX=0", "MSG=a $b c", "TPUSTREAM_RUN_ID=r1",
        ".venv/bin/python", "train.py", *OVERRIDES,
    ]  # fmt: skip
    assert commands.shell_path("~/runs/my dir") == "~/'runs/my dir'"
    assert commands.shell_path("~") == commands.shell_path("~/") == "~"
    assert commands.shell_path("/opt/a b") == "'/opt/a b'"


def test_gcloud_commands_name_the_tpu_zone_project_and_worker():
    s = spec(project="my-proj")
    workers = commands.launch_workers(s, 2)
    assert [str(w) for w in workers] == ["worker 0", "worker 1"]
    assert commands.worker_commands(s, workers, "r1") == [
        ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "tpu1", f"--worker={w.host}",
         f"--command={commands.remote_run_command(s, w, 'r1')}", "--zone=europe-west4-a", "--project=my-proj"]
        for w in workers
    ]  # fmt: skip
    # Each host knows its index (only host 0 counts unindexed shards) and has its own pid file.
    second = commands.remote_run_command(s, workers[1], "r1")
    assert "env PJRT_DEVICE=TPU TPUSTREAM_HOST_INDEX=1 " in second and '/.tpustream/runs/r1.1.pid"' in second
    assert "MEGASCALE" not in second
    assert commands.describe_command(spec(), "tpu1") == [
        "gcloud", "compute", "tpus", "tpu-vm", "describe", "tpu1", "--format=json", "--zone=europe-west4-a",
    ]  # fmt: skip
    (cleanup,) = commands.cleanup_commands(s, "r1")
    assert (
        cleanup[5:7] == ["tpu1", "--worker=all"]
        and cleanup[7] == f"--command={commands.cleanup_script('r1')}"
    )
    # Only this launch's pid files; no command-line pattern.
    assert '"$HOME"/.tpustream/runs/r1.*.pid' in cleanup[7] and "pgrep" not in cleanup[7]


def test_several_slices_run_on_every_host_of_every_node_joined_by_megascale():
    command = (".venv/bin/python", "train.py", "strategy=spmd", "mesh.slices=2")
    s = spec(num_slices=2, command=command)
    assert s.nodes == ("tpu1-0", "tpu1-1")  # the queued resource's nodes, NAME as the prefix
    workers = commands.launch_workers(s, 2)
    assert [(w.node, w.host, str(w)) for w in workers] == [
        ("tpu1-0", 0, "slice 0 worker 0"), ("tpu1-0", 1, "slice 0 worker 1"),
        ("tpu1-1", 0, "slice 1 worker 0"), ("tpu1-1", 1, "slice 1 worker 1"),
    ]  # fmt: skip
    argvs = commands.worker_commands(s, workers, "r1", "10.0.0.2")
    assert [argv[5:7] for argv in argvs] == [
        ["tpu1-0", "--worker=0"], ["tpu1-0", "--worker=1"],
        ["tpu1-1", "--worker=0"], ["tpu1-1", "--worker=1"],
    ]  # fmt: skip
    remote = shlex.split(
        commands.remote_run_command(s, workers[3], "r1", "10.0.0.2").removesuffix("; exit $?")
    )
    env = remote[remote.index("env") + 1 : remote.index(".venv/bin/python")]
    assert env == [
        "PJRT_DEVICE=TPU", "TPUSTREAM_HOST_INDEX=1",  # the host within its slice
        "MEGASCALE_NUM_SLICES=2", "MEGASCALE_SLICE_ID=1", "MEGASCALE_COORDINATOR_ADDRESS=10.0.0.2:8081",
        "MEGASCALE_PORT=8081", "TPUSTREAM_RUN_ID=r1",
    ]  # fmt: skip
    assert remote[7].endswith('/r1.1-1.pid" && exec "$@"')  # unique across the slices' hosts
    # The code goes to, and the cleanup reaches, every host of every node.
    assert [argv[4:6] for argv in commands.sync_commands(s, "L", "/tmp/r.tar.gz")] == [
        ["scp", "L"], ["ssh", "tpu1-0"], ["scp", "L"], ["ssh", "tpu1-1"],
    ]  # fmt: skip
    assert [argv[5:7] for argv in commands.cleanup_commands(s, "r1")] == [
        ["tpu1-0", "--worker=all"], ["tpu1-1", "--worker=all"],
    ]  # fmt: skip
    lines = commands.dry_run_lines(replace(s, num_workers=2))
    assert [line for line in lines if " describe " in line and not line.startswith("#")] == [
        shlex.join(commands.describe_command(s, node)) for node in s.nodes
    ]
    assert sum("MEGASCALE_COORDINATOR_ADDRESS=COORDINATOR:8081" in line for line in lines) == 4


@pytest.mark.parametrize(
    "changes, error",
    [
        ({"num_slices": 2}, "--num-slices 2, but the command sets no mesh.slices (1): add mesh.slices=2"),
        ({"command": ("python", "train.py", "mesh.slices=2")}, "--num-slices 1, but the command sets"),
        ({"num_slices": 0}, "--num-slices must be at least 1, got 0"),
    ],
)
def test_the_slice_count_and_the_commands_mesh_agree(changes, error):
    with pytest.raises(ConfigError, match=re.escape(error)):
        spec(**changes)


def test_process_tokens_name_the_program_and_its_script_or_module():
    assert commands.process_tokens([".venv/bin/python", "train.py", "epochs=3"]) == [
        ".venv/bin/python",
        "train.py",
    ]
    assert commands.process_tokens(["python", "-u", "-m", "pkg.mod", "a"]) == [
        "python",
        "-u",
        "-m",
        "pkg.mod",
    ]


# --- the remote commands, run here by real shells ----------------------------------------


def run_on_host(command: str, home: Path, **popen) -> subprocess.Popen:
    """Like sshd: the login shell runs the command in its own session, here with HOME=home."""
    return subprocess.Popen(
        ["bash", "-c", command], env={**os.environ, "HOME": str(home)}, start_new_session=True, **popen
    )


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def wait_for(predicate, what: str, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} after {timeout}s"
        time.sleep(0.02)


def test_remote_command_records_the_group_the_command_leads_and_passes_argv_and_exit_code_on(tmp_path):
    script = (
        "import json, os, sys; print(json.dumps([sys.argv[1:], os.getpid(), os.getpgid(0)])); sys.exit(3)"
    )
    s = spec(workdir=str(tmp_path), command=(sys.executable, "-c", script, *OVERRIDES))
    host = run_on_host(
        commands.remote_run_command(s, commands.Worker("tpu1", 4), "r1"),
        tmp_path,
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = host.communicate(timeout=10)
    argv, pid, group = json.loads(out)
    assert host.returncode == 3  # the command's own exit code, through the login shell
    assert argv == OVERRIDES
    # The command itself (not a shell around it) leads a new group, and the file names it.
    assert pid == group == int((tmp_path / ".tpustream" / "runs" / "r1.4.pid").read_text())


def test_cleanup_stops_the_launched_training_and_spares_a_lookalike(tmp_path):
    home, run_id, earlier_id = tmp_path / "home", "aaaa1111", "bbbb2222"
    workdir, runs = home / "tpustream", home / ".tpustream" / "runs"
    workdir.mkdir(parents=True)
    (workdir / "train.py").write_text(LAUNCHED_TRAIN)
    command = (sys.executable, "train.py", "epochs=3")
    # A colleague's run of the same command in another session, started by an earlier launch.
    # Its pid is also in a pid file of that launch and in one of this launch's (as if the
    # number had been reused since that training ended): neither may get it killed.
    marker = f"{commands.RUN_ID_VARIABLE}={earlier_id}"
    lookalike = run_on_host(f"export {marker}; exec -a {shlex.quote(shlex.join(command))} sleep 300", home)
    launched = run_on_host(
        commands.remote_run_command(spec(command=command), commands.Worker("tpu1", 0), run_id), home
    )
    try:
        wait_for(lambda: (workdir / "ready").exists(), "ready file")
        train_pid, replica_pid = map(int, (workdir / "ready").read_text().split())
        assert int((runs / f"{run_id}.0.pid").read_text()) == train_pid
        (runs / f"{earlier_id}.0.pid").write_text(f"{lookalike.pid}\n")
        (runs / f"{run_id}.1.pid").write_text(f"{lookalike.pid}\n")
        # Both command lines match what a pgrep -f of the training would look for.
        wait_for(lambda: "train.py" in command_line(lookalike.pid), "exec -a")
        assert command_line(train_pid) == f"{shlex.join(command)} "
        assert command_line(lookalike.pid).startswith(command_line(train_pid))

        env = {**os.environ, "HOME": str(home)}
        # What the launcher tells to run after a failed cleanup lists this launch's processes only.
        (leftovers,) = (
            argv[7].removeprefix("--command=") for argv in commands.leftovers_commands(spec(), run_id)
        )
        listed = subprocess.run(["bash", "-c", leftovers], env=env, capture_output=True, text=True).stdout
        assert sorted(int(line.split()[0]) for line in listed.splitlines()) == sorted(
            [train_pid, replica_pid]
        )

        cleanup = ["bash", "-c", commands.cleanup_script(run_id)]
        done = subprocess.run(cleanup, env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        assert done.stdout.endswith(f": stopping process group(s) {train_pid}\n")
        # SIGTERM reached train.py itself, and its exit code came back through the shell.
        assert launched.wait(timeout=10) == PREEMPTED_EXIT_CODE
        assert (workdir / "got-sigterm").read_text() == str(train_pid)
        wait_for(lambda: not alive(replica_pid), "end of the replica")
        assert alive(lookalike.pid)
        # Again, now with only stale files: nothing to stop, nothing stopped.
        done = subprocess.run(cleanup, env=env, capture_output=True, text=True, timeout=30)
        assert (done.returncode, done.stdout) == (0, "") and alive(lookalike.pid)
    finally:
        for proc in (launched, lookalike):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if (workdir / "ready").exists():
            for pid in map(int, (workdir / "ready").read_text().split()):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
