"""tpustream.pod.queued: the gcloud commands of a pod's life, exactly, and the queued resource's states."""

from __future__ import annotations

import os

import pytest

from tpustream.errors import ConfigError
from tpustream.pod import queued
from tpustream.pod.slice_spec import SliceSpec

RUNTIME = "v2-alpha-tpuv5-lite"


def spec(**changes) -> SliceSpec:
    values = dict(name="pod1", zone="z", accelerator_type="v5litepod-16", runtime_version=RUNTIME)
    return SliceSpec(**{**values, **changes})


def test_create_commands_per_kind_of_capacity():
    base = ["compute", "tpus", "queued-resources", "create", "pod1", "--node-id=pod1"]
    shape = ["--accelerator-type=v5litepod-16", f"--runtime-version={RUNTIME}"]
    startup = "--metadata-from-file=startup-script=S"
    for provisioning, capacity in (("on-demand", []), ("spot", ["--spot"]), ("reserved", ["--reserved"])):
        argv = queued.create_command(spec(provisioning=provisioning, project="p"), "S")
        assert argv == ["gcloud", *base, *shape, startup, *capacity, "--zone=z", "--project=p"]
    argv = queued.create_command(spec(provisioning="preemptible", network="n", service_account="a@b"), "S")
    assert argv == [
        "gcloud", "compute", "tpus", "tpu-vm", "create", "pod1", "--accelerator-type=v5litepod-16",
        f"--version={RUNTIME}", startup, "--preemptible", "--network=n", "--service-account=a@b", "--zone=z",
    ]  # fmt: skip


def test_a_multislice_pod_is_one_queued_resource_of_several_nodes():
    s = spec(slices=2, provisioning="spot")
    argv = queued.create_command(s, "S")
    assert argv[:8] == [
        "gcloud", "compute", "tpus", "queued-resources", "create", "pod1",
        "--node-count=2", "--node-prefix=pod1",
    ]  # fmt: skip
    assert "--spot" in argv and not any(a.startswith("--node-id") for a in argv)
    assert s.nodes == ("pod1-0", "pod1-1") and s.kind == "2 slices of v5litepod-16"
    # Deleting it: the queued resource (with --force, its nodes), then any node left of either name.
    assert [argv[3:6] for argv in queued.delete_commands(s)] == [
        ["queued-resources", "delete", "pod1"],
        ["tpu-vm", "delete", "pod1-0"],
        ["tpu-vm", "delete", "pod1-1"],
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="preemptible TPU VMs have none; use --spot"):
        spec(slices=2, provisioning="preemptible")


def test_delete_and_describe_commands():
    s = spec(project="p")
    where = ["--zone=z", "--project=p"]
    assert queued.queued_delete_command(s)[3:] == [
        "queued-resources",
        "delete",
        "pod1",
        "--force",
        "--quiet",
        *where,
    ]
    assert queued.node_delete_command(s, "pod1")[3:] == ["tpu-vm", "delete", "pod1", "--quiet", *where]
    assert queued.queued_describe_command(s)[3:] == [
        "queued-resources",
        "describe",
        "pod1",
        "--format=json",
        *where,
    ]
    assert len(queued.delete_commands(s)) == 2
    assert queued.delete_commands(spec(provisioning="preemptible")) == [
        queued.node_delete_command(spec(), "pod1")
    ]


def test_queued_state_is_read_from_the_api_shapes():
    active = {"state": {"state": "ACTIVE", "activeData": {}}}
    assert queued.QueuedState.parse(active) == queued.QueuedState("ACTIVE")
    error = {"code": 8, "message": "out of capacity"}
    failed = {"state": {"state": "FAILED", "failedData": {"error": error}}}
    assert queued.QueuedState.parse(failed) == queued.QueuedState("FAILED", "out of capacity")
    assert queued.QueuedState.parse({"state": "PROVISIONING"}).state == "PROVISIONING"
    assert queued.QueuedState.parse({}).state == "UNKNOWN"


def test_the_startup_script_file_is_removed_after_use():
    with queued.startup_script_file() as path, open(path) as f:
        assert f.read() == queued.HOST_SETUP_SCRIPT
    assert not os.path.exists(path)
