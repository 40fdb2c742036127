"""tpustream-pod gke-manifest: the JobSet's structure, per type, read back by a real YAML parser.

Structural only: no cluster, JobSet controller or TPU ran these manifests (see docs/pods.md).
"""

from __future__ import annotations

import pytest
import yaml

from tpustream.errors import HUNG_EXIT_CODE, PREEMPTED_EXIT_CODE
from tpustream.pod.__main__ import main
from tpustream.pod.manifest_yaml import to_yaml
from tpustream.pod.types import SLICE_TYPES

V4 = ["--type", "v4-8", "--image", "i"]
COMMAND = ["python", "train.py", "accelerator=tpu", "output_dir=gs://b/runs/r50", "name=a b: c", "x='{1..2}'"]


def manifest(capsys, *options: str, command: list[str] = COMMAND) -> dict:
    assert main(["gke-manifest", *options, "--", *command]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# ")
    return yaml.safe_load(out)


def slice_job(document: dict) -> dict:
    (job,) = document["spec"]["replicatedJobs"]
    return job


@pytest.mark.parametrize("name", ["v4-32", "v5p-128", "v5litepod-8", "v5litepod-16", "v6e-1", "v6e-256"])
def test_one_pod_per_host_on_the_type_s_nodes(capsys, name):
    kind = SLICE_TYPES[name]
    document = manifest(capsys, "--type", name, "--image", "gcr.io/p/tpustream:1")
    assert (document["apiVersion"], document["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    job = slice_job(document)
    assert job["replicas"] == 1  # one slice
    spec = job["template"]["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == kind.hosts
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": kind.gke_accelerator,
        "cloud.google.com/gke-tpu-topology": kind.topology,
    }
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["google.com/tpu"] == kind.chips_per_host
    assert container["image"] == "gcr.io/p/tpustream:1" and container["command"] == COMMAND
    env = {item["name"]: item for item in container["env"]}
    assert env["PJRT_DEVICE"]["value"] == "TPU"
    index = env["TPUSTREAM_HOST_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_exit_75_and_evictions_restart_without_counting_other_failures_do(capsys):
    document = manifest(capsys, "--type", "v5litepod-16", "--image", "i", "--max-restarts", "5")
    policy = document["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 5
    assert policy["rules"] == [
        {
            "name": "preemptedOrEvicted",
            "action": "RestartJobSetAndIgnoreMaxRestarts",
            "onJobFailureReasons": ["PodFailurePolicy"],
        }
    ]
    spec = slice_job(document)["template"]["spec"]
    assert spec["backoffLimit"] == 0 and spec["template"]["spec"]["restartPolicy"] == "Never"
    exit_rule, eviction_rule = spec["podFailurePolicy"]["rules"]
    assert exit_rule == {
        "action": "FailJob",
        "onPodConditions": [],
        "onExitCodes": {"containerName": "tpustream", "operator": "In", "values": [PREEMPTED_EXIT_CODE]},
    }
    assert eviction_rule == {
        "action": "FailJob",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert document["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }


def restart_action(document: dict, exit_code: int | None = None, condition: str | None = None) -> str:
    """What the JobSet does when one pod fails so, read from the manifest as Kubernetes and JobSet read it.

    The Job: the first podFailurePolicy rule that matches the failed pod decides
    (FailJob: the Job fails with reason PodFailurePolicy); with none, the pod
    counts against backoffLimit and the Job fails with BackoffLimitExceeded once
    it is exceeded. The JobSet: the first failurePolicy rule whose
    onJobFailureReasons holds that reason decides; with none, RestartJobSet
    (counted against maxRestarts), JobSet's default.
    """
    job = slice_job(document)["template"]["spec"]
    reason = None
    for rule in job["podFailurePolicy"]["rules"]:
        codes = rule.get("onExitCodes")
        by_code = codes is not None and codes["containerName"] == "tpustream" and codes["operator"] == "In"
        if (by_code and exit_code in codes["values"]) or any(
            c["type"] == condition and c["status"] == "True" for c in rule["onPodConditions"]
        ):
            assert rule["action"] == "FailJob"
            reason = "PodFailurePolicy"
            break
    else:
        assert job["backoffLimit"] == 0  # this one failed pod exceeds it
        reason = "BackoffLimitExceeded"
    for rule in document["spec"]["failurePolicy"]["rules"]:
        if reason in rule["onJobFailureReasons"]:
            return rule["action"]
    return "RestartJobSet"


@pytest.mark.parametrize(
    "failure, action",
    [
        ({"exit_code": PREEMPTED_EXIT_CODE}, "RestartJobSetAndIgnoreMaxRestarts"),
        ({"condition": "DisruptionTarget"}, "RestartJobSetAndIgnoreMaxRestarts"),
        ({"exit_code": HUNG_EXIT_CODE}, "RestartJobSet"),
        ({"exit_code": 1}, "RestartJobSet"),
        ({"exit_code": 137}, "RestartJobSet"),
    ],
    ids=["preempted-75", "evicted", "hung-76", "error-1", "killed-137"],
)
def test_a_hang_restarts_counted_against_max_restarts_a_preemption_for_free(capsys, failure, action):
    """Exit 76 must stay "any other failure": a hang that comes back ends the JobSet after maxRestarts."""
    document = manifest(capsys, "--type", "v5litepod-16", "--image", "i", "--max-restarts", "2")
    assert restart_action(document, **failure) == action
    assert document["spec"]["failurePolicy"]["maxRestarts"] == 2


def test_the_manifest_says_how_it_restarts(capsys):
    assert main(["gke-manifest", *V4, "--max-restarts", "4", "--", *COMMAND]) == 0
    comments = [line for line in capsys.readouterr().out.splitlines() if line.startswith("#")]
    assert comments[1] == (
        "# Restarts: after exit 75 (preempted, last.pt saved) or an eviction, as often as they come; after "
        "exit 76 (hung: stacks in output_dir/watchdog/) or any other failure, at most 4 times (maxRestarts)"
    )


@pytest.mark.parametrize("size", ["16Gi", "512Mi", "1G", "1073741824", "1.5Gi", "500k", "1e9", "2Ti"])
def test_shared_memory_takes_kubernetes_quantities(capsys, size):
    document = manifest(capsys, *V4, "--shm-size", size)
    (volume,) = slice_job(document)["template"]["spec"]["template"]["spec"]["volumes"]
    assert volume["emptyDir"]["sizeLimit"] == size  # a string, as the cluster reads a quantity


@pytest.mark.parametrize(
    "command",
    [
        ["python", "train.py", "output_dir=gs://b/runs/x"],
        ["python", "train.py", "++output_dir='gs://b/runs/x'"],
        [".venv/bin/python", "train.py", "+output_dir=gs://b"],
    ],
)
def test_a_bucket_output_dir_is_accepted(capsys, command):
    document = manifest(capsys, *V4, command=command)
    assert slice_job(document)["template"]["spec"]["template"]["spec"]["containers"][0]["command"] == command


def test_spot_name_env_and_shared_memory(capsys):
    options = ["--type", "v6e-16", "--image", "i", "--spot", "--name", "r50-spot", "--env", "A=1 2"]
    document = manifest(capsys, *options, "--shm-size", "32Gi", "--termination-grace", "60")
    pod = slice_job(document)["template"]["spec"]["template"]["spec"]
    assert document["metadata"]["name"] == "r50-spot"
    assert pod["nodeSelector"]["cloud.google.com/gke-spot"] == "true"
    assert {
        "key": "cloud.google.com/gke-spot",
        "operator": "Equal",
        "value": "true",
        "effect": "NoSchedule",
    } in (pod["tolerations"])
    assert {"name": "A", "value": "1 2"} in pod["containers"][0]["env"]
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}]
    assert pod["terminationGracePeriodSeconds"] == 60


def test_num_slices_makes_a_job_per_slice_joined_over_dcn(capsys):
    """--num-slices 2: two Jobs of the slice's hosts, every pod told the slice count, its slice (its
    Job's index) and slice 0's first host, the variables Ray's TPU support sets."""
    command = ["python", "train.py", "strategy=spmd", "mesh.slices=2", "output_dir=gs://b/runs/r"]
    document = manifest(
        capsys, "--type", "v5litepod-16", "--image", "i", "--num-slices", "2", command=command
    )
    job = slice_job(document)
    assert job["replicas"] == 2
    assert job["template"]["spec"]["completions"] == SLICE_TYPES["v5litepod-16"].hosts
    # Each Job on a node pool (a physical slice) of its own.
    annotations = document["metadata"]["annotations"]
    assert annotations["alpha.jobset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
    env = {item["name"]: item for item in job["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["MEGASCALE_NUM_SLICES"]["value"] == "2"
    assert env["MEGASCALE_SLICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['jobset.sigs.k8s.io/job-index']"
    )
    assert env["MEGASCALE_COORDINATOR_ADDRESS"]["value"] == "tpustream-slice-0-0.tpustream:8081"
    assert env["MEGASCALE_PORT"]["value"] == "8081"
    # One slice: none of it.
    single = slice_job(manifest(capsys, *V4))
    names = {item["name"] for item in single["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert single["replicas"] == 1 and not any(name.startswith("MEGASCALE") for name in names)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--type", "v3-32", "--image", "i", "--", "x"], "--type v3-32: GKE offers no v3 slices"),
        (["--type", "v9-8", "--image", "i", "--", "x"], "unknown TPU type 'v9-8'; known: v2-{8,"),
        (["--type", "v4-8", "--image", "i"], "no command: put it after --"),
        (["--type", "v4-8", "--image", "i", "--name", "Big_Name", "--", "x"], "--name 'Big_Name'"),
        (["--type", "v4-8", "--", "x"], "the following arguments are required: --image"),
        (
            ["--type", "v4-8", "--image", "i", "--max-restarts", "-1", "--", "x"],
            "--max-restarts must be >= 0",
        ),
        (
            [*V4, "--shm-size", "lots", "--", *COMMAND],
            "--shm-size 'lots' is not a Kubernetes quantity of bytes: write e.g. 16Gi, 512Mi, 1G",
        ),
        (
            [*V4, "--shm-size", "16g", "--", *COMMAND],
            "--shm-size '16g' is not a Kubernetes quantity of bytes (Docker's 16g is 16Gi here)",
        ),
        # In Kubernetes 512m is 512 thousandths of a byte.
        ([*V4, "--shm-size", "512m", "--", *COMMAND], "(Docker's 512m is 512Mi here)"),
        ([*V4, "--shm-size", "16gi", "--", *COMMAND], "--shm-size '16gi' is not"),
        ([*V4, "--shm-size=-1Gi", "--", *COMMAND], "--shm-size '-1Gi' is not"),
        ([*V4, "--shm-size", "0", "--", *COMMAND], "--shm-size '0': /dev/shm needs a size above 0"),
        (
            [*V4, "--", "python", "train.py", "epochs=3"],
            "the command sets no output_dir, so each pod writes under its own outputs/ (the default), and a "
            "restart on a fresh node would start over: add output_dir=gs://BUCKET/runs/NAME",
        ),
        (
            [*V4, "--", "python", "train.py", "output_dir=/data/runs/x"],
            "output_dir=/data/runs/x is not a gs://BUCKET/... URL, so it does not outlive the pods",
        ),
        ([*V4, "--", "python", "train.py", "output_dir=gs://"], "output_dir=gs:// is not a gs://BUCKET/"),
        (
            [*V4, "--num-slices", "2", "--", *COMMAND],
            "--num-slices 2, but the command sets no mesh.slices (1): add mesh.slices=2 and strategy=spmd",
        ),
        ([*V4, "--num-slices", "2", "--", *COMMAND, "mesh.slices=4"], "the command sets mesh.slices=4"),
        ([*V4, "--num-slices", "0", "--", *COMMAND], "--num-slices must be at least 1, got 0"),
        ([*V4, "--", *COMMAND, "mesh.slices=2"], "--num-slices 1, but the command sets mesh.slices=2"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(capsys, argv, message):
    assert main(["gke-manifest", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "value",
    ["yes", "No", "on", "null", "~", "", "4x4", "0x10", "1e3", "007", "a: b", "- a", "#x", "it's", 'say "hi"',
     "é", "a\tb\nc", "{x}", "[y]", "*z", "&a", "!t", "%p", "@a", "`b", "?", "x=1", "gs://b/x"],
)  # fmt: skip
def test_strings_read_back_as_the_same_strings(value):
    document = {"k": value, "l": [value, {"m": value}], "n": 3, "t": True, "e": [], "d": {}}
    assert yaml.safe_load(to_yaml(document)) == document
