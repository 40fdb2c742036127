"""--recreate against a stand-in gcloud that scripts the pod's life (tests/gcloud_world.py).

The pod is preempted mid-run; the launcher deletes what is left, asks for it
again as a queued resource (accepted late, or failing to provision), waits,
re-syncs onto the new (empty) disks and reruns the command, which continues
from its last.pt and finishes. Creations are bounded; a Ctrl-C at any moment
leaves no pod or queued resource the user did not ask for, or names it. No real
TPU or gcloud runs here.
"""

from __future__ import annotations

import re
import signal
import sys

import pytest

from tests.gcloud_world import World, spot_node, tiny_checkout
from tpustream.errors import TpustreamError
from tpustream.pod.__main__ import main
from tpustream.pod.queued import create_command
from tpustream.pod.recreate import learn_slice
from tpustream.pod.slice_spec import SliceSpec, save_record
from tpustream.pod.spec import LaunchSpec
from tpustream.pod.tpu import TpuGone, TpuInfo, info_from_node, pod_info, terminal_error

EPOCHS = 3
WAITING = ["ACCEPTED", "WAITING_FOR_RESOURCES", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]


@pytest.fixture
def world(tmp_path, monkeypatch) -> World:
    return World(tmp_path, monkeypatch)


@pytest.fixture
def sigint_default():
    """SIGINT at Python's default during the test (the stub's Ctrl-C reaches main's handler)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def launch(world: World, tmp_path, *options: str) -> int:
    """tpustream-pod --recreate with the resuming training, short waits and no backoff to speak of."""
    checkout = tiny_checkout(tmp_path) if not (tmp_path / "checkout").exists() else tmp_path / "checkout"
    return main(
        [
            "--tpu", "tpu1", "--zone", "europe-west4-a", "--project", "p",
            "--workdir", str(world.disk), "--source", str(checkout),
            "--sync", "--restart", "--recreate",
            "--poll-interval", "0.01", "--backoff", "0.01", "--grace", "5",
            *options,
            "--", sys.executable, "train.py", f"output_dir={tmp_path / 'bucket'}", f"epochs={EPOCHS}",
        ]
    )  # fmt: skip


def epochs_trained(tmp_path) -> list[int]:
    log = tmp_path / "bucket" / "epochs.log"
    return [int(line) for line in log.read_text().split()] if log.exists() else []


def test_a_preempted_spot_pod_is_recreated_and_the_run_resumes_and_finishes(world, tmp_path, capfd):
    world.set(nodes={"tpu1": spot_node()}, script={"preempt_runs": [0], "plans": [WAITING]})
    code = launch(world, tmp_path)
    out, err = capfd.readouterr()
    assert code == 0, err
    # Every epoch once: the rerun continued from last.txt (the training's last.pt).
    assert epochs_trained(tmp_path) == [1, 2, 3]
    assert re.findall(r'\[worker 0\] \{"host": "0", "resumed_from": (\d)\}', out) == ["0", "1"]
    # The same pod asked for again, as it was made: type, runtime, spot, network, account.
    (create,) = world.calls("queued-resources", "create")
    assert create[:11] == [
        "compute", "tpus", "queued-resources", "create", "tpu1", "--node-id=tpu1",
        "--accelerator-type=v5litepod-16", "--runtime-version=v2-alpha-tpuv5-lite",
        create[8], "--spot", "--network=tpu-net",
    ]  # fmt: skip
    assert create[8].startswith("--metadata-from-file=startup-script=")
    assert create[11:] == [
        "--subnetwork=tpu-sub",
        "--service-account=trainer@p.iam.gserviceaccount.com",
        "--zone=europe-west4-a",
        "--project=p",
    ]
    assert world.calls("tpu-vm", "delete")  # the preempted node, made without a queued resource
    assert len(world.calls("tpu-vm", "scp")) == 2  # synced again onto the new, empty disks
    for line in (
        "TPU tpu1 is PREEMPTED: --recreate asks for it again (v5litepod-16, spot, runtime v2-alpha-tpuv5-",
        "deleted what was left of TPU tpu1 (",
        "asked for queued resource tpu1 (",
        "queued resource tpu1: ACCEPTED",
        "queued resource tpu1: WAITING_FOR_RESOURCES after ",
        "queued resource tpu1: ACTIVE after ",
        "TPU tpu1 is READY with 2 worker(s): recreated in ",
        "all 2 worker(s) exited with 0",
        "TPU tpu1 was recreated by this launch and is still there",
        "tpustream-pod delete tpu1 --zone europe-west4-a --project p",
    ):
        assert line in err, line
    assert world.left() == (["tpu1"], ["tpu1"])  # the user's pod, now a queued resource, stays


def test_failing_provisioning_is_retried_with_backoff_and_the_requests_are_bounded(world, tmp_path, capfd):
    plans = [["FAILED"], ["WAITING_FOR_RESOURCES", "FAILED"], ["ACTIVE"]]
    world.set(
        nodes={"tpu1": spot_node()}, script={"preempt_runs": [0], "plans": plans, "create_exit": [0, 0]}
    )
    assert launch(world, tmp_path, "--max-restarts", "2") == 2
    err = capfd.readouterr().err
    assert len(world.calls("queued-resources", "create")) == 2
    assert "request 1 failed: queued resource tpu1 is FAILED: no capacity in the zone" in err
    assert "asking again in 0.01s" in err
    assert "the 2 request(s) --max-restarts allows are used up" in err
    assert world.left() == ([], [])  # the failed requests are not left in the queue
    assert epochs_trained(tmp_path) == [1]

    # Another launch (the stub counts on: its 3rd create is a quota error, its 4th is filled at once).
    world.set(script={"plans": [*plans, ["ACTIVE"]], "create_exit": [0, 0, 1]})
    assert launch(world, tmp_path, "--max-restarts", "3") == 0
    err = capfd.readouterr().err
    assert "TPU tpu1 is NOT_FOUND: --recreate asks for it again" in err  # from the record made above
    assert "could not create queued resource tpu1 (exit code 1" in err
    assert epochs_trained(tmp_path) == [1, 2, 3]


def test_a_request_not_active_in_time_is_deleted(world, tmp_path, capfd):
    waiting = ["WAITING_FOR_RESOURCES"]
    world.set(nodes={"tpu1": spot_node(state="PREEMPTED")}, script={"plans": [waiting, waiting]})
    assert launch(world, tmp_path, "--create-timeout", "0.05", "--max-restarts", "2") == 2
    err = capfd.readouterr().err
    assert "queued resource tpu1 is not ACTIVE after 0.05s (still WAITING_FOR_RESOURCES)" in err
    assert "raise --create-timeout to wait longer" in err
    assert world.left() == ([], [])
    assert epochs_trained(tmp_path) == []


MOMENTS = {
    # where the Ctrl-C comes -> (what is left: nodes, queued resources), what the launcher says
    "deleting the old pod": ({"tpu-vm delete": 1}, ([], []), None),
    "asking for the new one": ({"queued-resources create": 1}, ([], []), "deleted TPU tpu1: nothing"),
    "waiting for capacity": ({"queued-resources describe": 2}, ([], []), "deleted TPU tpu1: nothing"),
    "training on the new one": ({"ssh 0": 2}, (["tpu1"], ["tpu1"]), "was recreated by this launch"),
}


@pytest.mark.parametrize("moment", MOMENTS)
def test_ctrl_c_at_any_moment_of_a_recreation_leaves_nothing_unasked_for(
    world, tmp_path, capfd, sigint_default, moment
):
    sigint, left, said = MOMENTS[moment]
    world.set(nodes={"tpu1": spot_node()}, script={"preempt_runs": [0], "plans": [WAITING], "sigint": sigint})
    assert launch(world, tmp_path) == 130
    err = capfd.readouterr().err
    assert err.rstrip().endswith("python -m tpustream.pod: interrupted")
    assert world.left() == left
    if said:
        assert said in err
    # Bounded: one request at most, whatever the moment.
    assert len(world.calls("queued-resources", "create")) <= 1


def test_a_second_ctrl_c_leaves_the_request_and_names_it(world, tmp_path, capfd, sigint_default):
    sigint = {"queued-resources describe": 2, "queued-resources delete": 1}
    world.set(nodes={"tpu1": spot_node()}, script={"preempt_runs": [0], "plans": [WAITING], "sigint": sigint})
    assert launch(world, tmp_path) == 130
    err = capfd.readouterr().err
    assert "Ctrl-C: deleting TPU tpu1, which this launch asked for (Ctrl-C again to leave it)" in err
    assert (
        "TPU tpu1 may be left behind; delete it with: gcloud compute tpus queued-resources delete tpu1 "
        "--force --quiet --zone=europe-west4-a --project=p && gcloud compute tpus tpu-vm delete tpu1" in err
    )


def test_a_pod_gone_before_the_launch_is_made_from_its_record(world, tmp_path, capfd):
    recorded = SliceSpec(
        name="tpu1", zone="europe-west4-a", project="p", accelerator_type="v4-16",
        runtime_version="tpu-ubuntu2204-base", provisioning="reserved",
    )  # fmt: skip
    save_record(recorded)
    world.set(script={"plans": [["PROVISIONING", "ACTIVE"]]})
    assert launch(world, tmp_path) == 0, capfd.readouterr().err
    (create,) = world.calls("queued-resources", "create")
    assert "--accelerator-type=v4-16" in create and "--reserved" in create and "--spot" not in create
    assert epochs_trained(tmp_path) == [1, 2, 3]


def test_a_pod_gone_without_a_record_says_how_to_make_it(world, tmp_path, capfd):
    assert launch(world, tmp_path) == 2
    err = capfd.readouterr().err
    assert "TPU tpu1 is NOT_FOUND, and neither the pod nor this machine" in err
    assert "tpustream-pod create tpu1 --zone europe-west4-a --type TYPE" in err and err.count("\n") == 1
    assert world.calls("queued-resources", "create") == []


def test_a_preemptible_pod_is_made_again_with_tpu_vm_create(world, tmp_path, capfd):
    node = spot_node(schedulingConfig={"preemptible": True}, acceleratorType="v3-32", runtimeVersion="r")
    world.set(nodes={"tpu1": node}, script={"preempt_runs": [0]})
    assert launch(world, tmp_path) == 0, capfd.readouterr().err
    (create,) = world.calls("tpu-vm", "create")
    assert create[4:7] == ["tpu1", "--accelerator-type=v3-32", "--version=r"] and "--preemptible" in create
    assert world.calls("queued-resources", "create") == []
    assert epochs_trained(tmp_path) == [1, 2, 3]


@pytest.mark.parametrize(
    "options, message",
    [(["--no-sync"], "--recreate needs --restart and --sync"), (["--backoff", "-1"], "must be >= 0")],
)
def test_recreate_usage_errors_are_one_line(world, capsys, options, message):
    flags = ["--restart", "--recreate"] + (["--sync"] if options != ["--no-sync"] else [])
    argv = ["--tpu", "t", "--zone", "z", *flags, *[o for o in options if o != "--no-sync"], "--", "x"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert world.calls() == []


def test_dry_run_with_recreate_prints_what_it_would_run_if_the_pod_were_taken(world, tmp_path, capsys):
    argv = ["--tpu", "tpu1", "--zone", "z", "--sync", "--restart", "--recreate", "--dry-run", "--", "x"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        out.splitlines()[-1]
        == "#   as `describe` shows the pod at the launch (this machine has no record of it)"
    )
    save_record(
        SliceSpec(name="tpu1", zone="z", accelerator_type="v6e-16", runtime_version="r", provisioning="spot")
    )
    assert main(argv) == 0
    tail = capsys.readouterr().out.splitlines()[-4:]
    assert tail == [
        "#   gcloud compute tpus queued-resources delete tpu1 --force --quiet --zone=z",
        "#   gcloud compute tpus tpu-vm delete tpu1 --quiet --zone=z",
        "#   gcloud compute tpus queued-resources create tpu1 --node-id=tpu1 --accelerator-type=v6e-16 "
        "--runtime-version=r --metadata-from-file=startup-script=STARTUP_SCRIPT --spot --zone=z",
        "#   gcloud compute tpus queued-resources describe tpu1 --format=json --zone=z   # until ACTIVE",
    ]
    assert world.calls() == []


def test_one_command_makes_a_missing_spot_pod_survives_a_preemption_and_finishes(world, tmp_path, capfd):
    world.set(script={"preempt_runs": [0], "plans": [["WAITING_FOR_RESOURCES", "ACTIVE"], WAITING]})
    assert launch(world, tmp_path, "--type", "v5litepod-16", "--spot") == 0, capfd.readouterr().err
    creates = world.calls("queued-resources", "create")
    assert len(creates) == 2 and all(
        "--spot" in c and "--accelerator-type=v5litepod-16" in c for c in creates
    )
    assert epochs_trained(tmp_path) == [1, 2, 3]
    assert main(["--tpu", "t", "--zone", "z", "--type", "v4-8", "--", "x"]) == 2
    assert "--type makes the pod if it is missing: it goes with --recreate" in capfd.readouterr().err


def test_a_multislice_pod_is_ready_when_every_node_is_and_recreated_whole(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # learn_slice records what it learns there
    launch_spec = LaunchSpec(
        tpu="tpu1", zone="z", num_slices=2, command=("python", "train.py", "strategy=spmd", "mesh.slices=2")
    )

    def node(name: str, state: str, first_ip: str = "10.0.0.5") -> dict:
        endpoints = [{"ipAddress": first_ip}, {"ipAddress": "10.9.9.9"}] if state == "READY" else []
        found = {"state": state, "networkEndpoints": endpoints, "acceleratorType": "v5litepod-16"}
        return {**found, "runtimeVersion": "v2-alpha-tpuv5-lite", "schedulingConfig": {"spot": True}}

    ready = [
        info_from_node(node(n, "READY", ip), n) for n, ip in (("tpu1-0", "10.0.0.5"), ("tpu1-1", "10.0.1.5"))
    ]
    # Slice 0's first host coordinates the slices.
    assert pod_info(launch_spec, ready) == TpuInfo("READY", 2, "10.0.0.5", "tpu1")
    # Not READY while one node is not; a node that never comes back is the pod's state.
    creating, preempted = (
        info_from_node(node("", "CREATING"), "tpu1-0"),
        info_from_node(node("", "PREEMPTED"), "tpu1-1"),
    )
    assert pod_info(launch_spec, [ready[0], creating]).state == "CREATING"
    assert pod_info(launch_spec, [creating, preempted]) == preempted
    gone = terminal_error(preempted.node, preempted.state)
    assert isinstance(gone, TpuGone) and str(gone).startswith("TPU tpu1-1 is PREEMPTED: ")
    uneven = info_from_node({**node("", "READY"), "networkEndpoints": [{"ipAddress": "10.0.1.5"}]}, "tpu1-1")
    with pytest.raises(TpustreamError, match=r"different numbers of hosts \(tpu1-0: 2, tpu1-1: 1\)"):
        pod_info(launch_spec, [ready[0], uneven])
    # --recreate asks for both slices again, as one queued resource.
    made = learn_slice(launch_spec, node("tpu1-0", "READY"))
    assert made is not None and (made.slices, made.provisioning, made.kind) == (
        2,
        "spot",
        "2 slices of v5litepod-16",
    )
    assert "--node-count=2" in create_command(made, "S") and made.nodes == launch_spec.nodes
