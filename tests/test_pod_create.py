"""tpustream-pod create / delete, and scripts/create_tpu_pod.sh around them, against the stand-in gcloud."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gcloud_world import World
from tpustream.pod import commands, queued
from tpustream.pod.__main__ import main
from tpustream.pod.slice_spec import load_record

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "scripts" / "create_tpu_pod.sh")


@pytest.fixture
def world(tmp_path, monkeypatch) -> World:
    return World(tmp_path, monkeypatch)


@pytest.mark.parametrize(
    "flags, capacity, runtime",
    [
        (["--type", "v5litepod-16", "--spot"], ["--spot"], "v2-alpha-tpuv5-lite"),
        (["--type", "v6e-8", "--reserved"], ["--reserved"], "v2-alpha-tpuv6e"),
        (["--type", "v5p-32"], [], "v2-alpha-tpuv5"),
        (["--type", "v4-32", "--runtime-version", "mine"], [], "mine"),
    ],
)
def test_create_dry_run_prints_exactly_the_queued_resource_command(world, capsys, flags, capacity, runtime):
    argv = ["create", "pod1", "--zone", "us-east5-b", "--project", "p", "--service-account", "a@b", *flags]
    assert main([*argv, "--dry-run"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert [shlex.split(line) for line in lines] == [
        [
            "gcloud", "compute", "tpus", "queued-resources", "create", "pod1", "--node-id=pod1",
            f"--accelerator-type={flags[1]}", f"--runtime-version={runtime}",
            "--metadata-from-file=startup-script=STARTUP_SCRIPT", *capacity,
            "--service-account=a@b", "--zone=us-east5-b", "--project=p",
        ]
    ]  # fmt: skip
    assert world.calls() == []


def test_create_asks_waits_and_records_how_the_pod_was_made(world, capfd):
    world.set(script={"plans": [["ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]]})
    argv = ["create", "pod1", "--zone", "z", "--type", "v5litepod-16", "--spot", "--network", "net"]
    assert main([*argv, "--poll-interval", "0.01"]) == 0
    err = capfd.readouterr().err
    assert world.left() == (["pod1"], ["pod1"])
    assert len(world.calls("queued-resources", "describe")) == 4
    for line in ("queued resource pod1: ACCEPTED", "queued resource pod1: ACTIVE after ", "asked for pod1 ("):
        assert line in err
    assert "next: tpustream-pod --tpu pod1 --zone z --sync --restart --recreate --" in err
    record = load_record("pod1", "z", None)
    assert (record.accelerator_type, record.provisioning, record.network) == ("v5litepod-16", "spot", "net")
    assert (record.runtime_version, record.service_account) == ("v2-alpha-tpuv5-lite", None)
    # The hosts' set-up went along, and its temporary file is gone.
    assert Path(f"{world.log}.startup-script").read_text() == queued.HOST_SETUP_SCRIPT
    (create,) = world.calls("queued-resources", "create")
    assert not Path(create[8].split("=", 2)[2]).exists()


def test_create_that_fails_to_provision_names_the_request_and_how_to_delete_it(world, capfd):
    world.set(script={"plans": [["WAITING_FOR_RESOURCES", "FAILED"]]})
    argv = ["create", "pod1", "--zone", "z", "--type", "v4-8", "--poll-interval", "0.01"]
    assert main(argv) == 2
    err = capfd.readouterr().err
    assert "pod1 stays as it is; delete it with: gcloud compute tpus queued-resources delete pod1" in err
    assert err.splitlines()[-1] == (
        "python -m tpustream.pod: error: queued resource pod1 is FAILED: no capacity in the zone"
    )
    assert world.left() == ([], ["pod1"])  # asked for by the user: left, and named


def test_delete_removes_the_queued_resource_and_its_node_however_made(world, capfd):
    world.set(
        queued={"pod1": {"states": ["ACTIVE"], "seen": 1, "node": {}}}, nodes={"pod1": {"state": "READY"}}
    )
    assert main(["delete", "pod1", "--zone", "z"]) == 0
    assert world.left() == ([], [])
    assert [c[2:4] for c in world.calls() if c[3] == "delete"] == [["queued-resources", "delete"]]
    world.set(nodes={"pod2": {"state": "PREEMPTED"}})  # a bare TPU VM (tpu-vm create)
    assert main(["delete", "pod2", "--zone", "z"]) == 0
    assert world.left() == ([], []) and world.calls("tpu-vm", "delete")[-1][4] == "pod2"
    assert "deleted pod2: nothing of it is left" in capfd.readouterr().err
    assert main(["delete", "pod3", "--zone", "z", "--dry-run"]) == 0
    printed = [line for line in capfd.readouterr().out.splitlines() if not line.startswith("#")]
    assert printed == [
        "gcloud compute tpus queued-resources delete pod3 --force --quiet --zone=z",
        "gcloud compute tpus tpu-vm delete pod3 --quiet --zone=z",
    ]


def test_an_unknown_type_is_one_line_naming_the_known_ones(world, capsys):
    assert main(["create", "pod1", "--zone", "z", "--type", "v5e-16"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown TPU type 'v5e-16'; known: v2-{8,32" in err
    assert "v5litepod-{1,4,8,16,32,64,128,256}" in err and world.calls() == []
    assert main(["create", "pod1", "--zone", "z", "--type", "v4-8", "--spot", "--reserved"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_create_tpu_pod_script_wraps_create(world, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PYTHON", sys.executable)  # the stand-in hosts' python3 shim is first on PATH
    done = subprocess.run(["bash", SCRIPT, "tpu1", "europe-west4-a", "--project", "my-proj", "--preemptible"])
    assert done.returncode == 0
    (create,) = world.calls()
    startup_path = create[7].split("=", 2)[2]
    assert create == [
        "compute", "tpus", "tpu-vm", "create", "tpu1", "--accelerator-type=v3-32",
        "--version=tpu-ubuntu2204-base", f"--metadata-from-file=startup-script={startup_path}",
        "--preemptible", "--zone=europe-west4-a", "--project=my-proj",
    ]  # fmt: skip
    assert not Path(startup_path).exists()  # the temporary file is removed
    assert world.left() == (["tpu1"], [])
    done = subprocess.run(
        ["bash", SCRIPT, "tpu2", "us-central2-b", "v4-32", "--spot", "--dry-run"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and len(world.calls()) == 1  # printed, not run
    assert (
        "gcloud compute tpus queued-resources create tpu2 --node-id=tpu2 --accelerator-type=v4-32"
        in done.stdout
    )
    for bad in (["only-a-name"], ["a", "b", "c", "d", "e"], ["a", "b", "--bogus"], ["a", "b", "--project"]):
        done = subprocess.run(["bash", SCRIPT, *bad], capture_output=True, text=True)
        assert done.returncode == 2 and "usage: scripts/create_tpu_pod.sh NAME ZONE" in done.stderr, bad
    assert len(world.calls()) == 1


def test_the_host_setup_installs_python3_venv_and_writes_the_marker(tmp_path):
    """The start-up script itself, with fake dpkg/apt-get and the marker in tmp_path."""
    startup = queued.HOST_SETUP_SCRIPT
    assert os.path.dirname(commands.STARTUP_MARKER) in startup
    assert os.path.basename(commands.STARTUP_MARKER) in startup
    fakes, markers, apt_log = tmp_path / "fakes", tmp_path / "markers", tmp_path / "apt.log"
    fakes.mkdir()
    for name, body in {"dpkg": "exit 1", "apt-get": f'echo "$*" >> {shlex.quote(str(apt_log))}'}.items():
        (fakes / name).write_text(f"#!/bin/bash\n{body}\n")
        (fakes / name).chmod(0o755)
    runnable = tmp_path / "startup.sh"
    runnable.write_text(startup.replace(os.path.dirname(commands.STARTUP_MARKER), str(markers)))
    env = {**os.environ, "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}"}
    assert subprocess.run(["bash", str(runnable)], env=env).returncode == 0
    assert "install -y -q python3-venv python3-pip" in apt_log.read_text()
    assert (markers / "startup-done").read_text() == "0\n"


def test_create_and_gke_manifest_run_without_torch():
    check = (
        "import sys; from tpustream.pod.__main__ import main; "
        "main(['gke-manifest', '--type', 'v6e-16', '--image', 'i', '--', 'python', 'train.py']); "
        "main(['create', 'p', '--zone', 'z', '--type', 'v6e-16', '--dry-run']); "
        "assert 'torch' not in sys.modules and 'yaml' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert json.dumps("v6e-16")[1:-1] in done.stdout


def test_a_ctrl_c_while_create_waits_names_the_request_and_how_to_delete_it(world, capfd):
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        waiting = ["WAITING_FOR_RESOURCES"]
        world.set(script={"plans": [waiting], "sigint": {"queued-resources describe": 2}})
        assert main(["create", "pod1", "--zone", "z", "--type", "v4-8", "--poll-interval", "0.01"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capfd.readouterr().err
    assert "pod1 may exist (a Ctrl-C does not withdraw it); delete it with: gcloud compute tpus" in err
    assert world.left() == ([], ["pod1"])  # the user asked for it: it stays, named
