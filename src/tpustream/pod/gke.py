"""``tpustream-pod gke-manifest``: the same training on GKE, as a JobSet manifest for TPU slices.

    tpustream-pod gke-manifest --type v5litepod-16 --image IMAGE -- \\
        python train.py accelerator=tpu output_dir=gs://BUCKET/runs/r50 ... | kubectl apply -f -

One replicated job, one Job per slice (``--num-slices N``: N Jobs, each on a
node pool of its own, their hosts given the megascale variables that join the
slices over DCN; the command's mesh.slices must say N), one pod per host
(completions and parallelism = the slice's hosts), placed by GKE's TPU node labels
(``cloud.google.com/gke-tpu-accelerator``, ``cloud.google.com/gke-tpu-topology``),
each asking for its host's chips (``google.com/tpu``). GKE injects TPU_WORKER_ID
and TPU_WORKER_HOSTNAMES into the pods of an Indexed Job that asks for TPUs;
JobSet gives the Job its headless service. The shape follows JobSet's API
(kubernetes-sigs/jobset, api/jobset/v1alpha2/jobset_types.go, and its
failure-policy examples) and xpk's workload template (AI-Hypercomputer/xpk,
src/xpk/commands/workload.py).

Restarts: any pod failing fails its Job (backoffLimit 0), and JobSet then
recreates every Job (failurePolicy: RestartJobSet, at most maxRestarts times).
A pod that exits 75 (train.py was stopped and saved last.pt) or was evicted
(condition DisruptionTarget: a spot node taken, host maintenance) fails its Job
through the Job's podFailurePolicy, reason PodFailurePolicy, and the first rule
of the JobSet's failurePolicy restarts it without counting against maxRestarts
(RestartJobSetAndIgnoreMaxRestarts, JobSet v0.6+). A pod that exits 76 (its
watchdog found the run hung and wrote the stacks to output_dir/watchdog/) is
"any other failure" on purpose: no podFailurePolicy rule names 76, so it counts
against backoffLimit 0, the Job fails with reason BackoffLimitExceeded, no rule
of the JobSet matches that, and JobSet's default action, RestartJobSet, counts
it against maxRestarts: a hang that comes back at the same place ends the
JobSet after maxRestarts restarts instead of looping. When one host hangs, the
others wait in a collective and their watchdogs fire too; the first failed pod
fails the Job and the JobSet restarts once for that, not once per pod.

Every rerun continues from output_dir's last.pt, which must therefore be a
gs:// URL: a command that sets no output_dir, or a local one, is refused.
"""

from __future__ import annotations

import argparse
import re

from tpustream.errors import HUNG_EXIT_CODE, PREEMPTED_EXIT_CODE, ConfigError
from tpustream.pod.manifest_yaml import to_yaml
from tpustream.pod.multislice import megascale_env
from tpustream.pod.spec import check_num_slices, command_output_dir, is_bucket_url, parse_env
from tpustream.pod.types import SLICE_TYPES, SliceType, slice_type
from tpustream.pod.usage import UsageParser, split_command

CONTAINER = "tpustream"
ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
SPOT_LABEL = "cloud.google.com/gke-spot"
# JobSet's pod names (NAME-slice-0-HOST-xxxxx) must stay within DNS's 63 characters.
_NAME = re.compile(r"[a-z]([-a-z0-9]{0,38}[a-z0-9])?\Z")
# The Job's index (0 .. hosts-1), as Kubernetes sets it on every pod of an Indexed Job.
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# The replicated job of slices, and a pod's Job's index in it (its slice), as JobSet labels pods.
REPLICATED_JOB = "slice"
JOB_INDEX = "metadata.labels['jobset.sigs.k8s.io/job-index']"
# A Kubernetes quantity of bytes (k8s.io/apimachinery resource.Quantity): a number with a
# binary (Ki ... Ei) or decimal (k, M ... E) suffix, an exponent, or none. No "m": that is
# milli, not Docker's mebibytes, and would ask for a /dev/shm of a fraction of a byte.
_QUANTITY = re.compile(r"(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[kMGTPE]|[eE]\d+)?\Z")


def gke_generations() -> list[str]:
    return list(dict.fromkeys(kind.generation for kind in SLICE_TYPES.values() if kind.gke_accelerator))


def pod_failure_policy() -> dict:
    """Exit 75 or an eviction fail the Job with reason PodFailurePolicy, which the JobSet restarts for free.

    Exit 76 (hung) is left out: it must fail the Job with BackoffLimitExceeded
    so that its restart counts against maxRestarts. ``onPodConditions: []`` and
    ``status: "True"`` are spelled out: JobSet validates the Job template
    without Kubernetes' defaulting (its examples and xpk write them too).
    """
    return {
        "rules": [
            {
                "action": "FailJob",
                "onPodConditions": [],
                "onExitCodes": {
                    "containerName": CONTAINER,
                    "operator": "In",
                    "values": [PREEMPTED_EXIT_CODE],
                },
            },
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }


def failure_policy(max_restarts: int) -> dict:
    return {
        "maxRestarts": max_restarts,
        "rules": [
            {
                "name": "preemptedOrEvicted",
                "action": "RestartJobSetAndIgnoreMaxRestarts",
                "onJobFailureReasons": ["PodFailurePolicy"],
            }
        ],  # any other failure, exit 76 (hung) included: RestartJobSet, counted against maxRestarts
    }


def multislice_env(name: str, slices: int) -> list[dict]:
    """What the TPU runtime of every host needs to join ``slices`` slices over DCN (tpustream.pod.multislice).

    This pod's slice is its Job's index in the replicated job (as xpk's Pathways
    template takes it), read by the pod itself; the coordinator is the first host
    of slice 0, by the DNS name JobSet gives it
    (JOBSET-REPLICATEDJOB-JOBINDEX-PODINDEX.JOBSET, the form xpk gives its
    coordinators). GKE's TPU webhook may set them too; which wins has not been
    seen on a cluster.
    """
    coordinator = f"{name}-{REPLICATED_JOB}-0-0.{name}"
    return [
        {"name": key, "valueFrom": {"fieldRef": {"fieldPath": JOB_INDEX}}}
        if key == "MEGASCALE_SLICE_ID"
        else {"name": key, "value": value}
        for key, value in megascale_env(slices, 0, coordinator)
    ]


def container(
    kind: SliceType, image: str, command: list[str], env: tuple[tuple[str, str], ...], multislice: list[dict]
) -> dict:
    variables = [
        {"name": "PJRT_DEVICE", "value": "TPU"},
        # train.py's host index within its slice (tpustream.launch.hosts): host 0 of slice 0
        # counts shards the others wait for.
        {"name": "TPUSTREAM_HOST_INDEX", "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
        *multislice,
        *({"name": name, "value": value} for name, value in env),
    ]
    return {
        "name": CONTAINER,
        "image": image,
        "command": command,
        "env": variables,
        # As `docker run --privileged` in the Dockerfile's header: the host's TPU devices.
        "securityContext": {"privileged": True},
        "resources": {"limits": {"google.com/tpu": kind.chips_per_host}},
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }


def pod_spec(kind: SliceType, args: argparse.Namespace, command: list[str]) -> dict:
    selector = {ACCELERATOR_LABEL: kind.gke_accelerator, TOPOLOGY_LABEL: kind.topology}
    tolerations = [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    if args.spot:
        selector[SPOT_LABEL] = "true"
        tolerations.append({"key": SPOT_LABEL, "operator": "Equal", "value": "true", "effect": "NoSchedule"})
    return {
        "restartPolicy": "Never",  # podFailurePolicy requires it; JobSet restarts instead
        # The TPU runtimes of a slice's hosts reach each other on the hosts' network (as --net=host).
        "hostNetwork": True,
        "dnsPolicy": "ClusterFirstWithHostNet",
        # SIGTERM to last.pt takes a checkpoint write; a spot node gives about 30s.
        "terminationGracePeriodSeconds": args.termination_grace,
        "nodeSelector": selector,
        "tolerations": tolerations,
        "containers": [
            container(
                kind, args.image, command, parse_env(args.env), multislice_env(args.name, args.num_slices)
            )
        ],
        # DataLoader workers hand batches over through /dev/shm (as docker run --shm-size).
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": args.shm_size}}],
    }


def check_shm_size(size: str) -> None:
    """A size the cluster takes as emptyDir's sizeLimit, or one line naming what to write."""
    match = _QUANTITY.match(size)
    if match and float(match.group(1)) > 0:
        return
    if match:
        raise ConfigError(f"--shm-size {size!r}: /dev/shm needs a size above 0, e.g. 16Gi")
    docker = re.fullmatch(r"(\d+)([kmgt])b?", size, re.IGNORECASE)
    hint = f" (Docker's {size} is {docker.group(1)}{docker.group(2).upper()}i here)" if docker else ""
    raise ConfigError(
        f"--shm-size {size!r} is not a Kubernetes quantity of bytes{hint}: write e.g. 16Gi, 512Mi, 1G "
        "or a number of bytes"
    )


def check_output_dir(command: list[str]) -> None:
    """Every restart reruns the command on fresh pods: only a bucket keeps the last.pt it continues from."""
    output_dir = command_output_dir(command)
    if is_bucket_url(output_dir):
        return
    if output_dir is None:
        where = "the command sets no output_dir, so each pod writes under its own outputs/ (the default)"
    else:
        where = f"output_dir={output_dir} is not a gs://BUCKET/... URL, so it does not outlive the pods"
    raise ConfigError(
        f"{where}, and a restart on a fresh node would start over: add output_dir=gs://BUCKET/runs/NAME"
    )


def jobset_manifest(kind: SliceType, args: argparse.Namespace, command: list[str]) -> dict:
    """The JobSet for one slice of ``kind`` running ``command`` on every host."""
    if kind.gke_accelerator is None:
        raise ConfigError(
            f"--type {kind.name}: GKE offers no {kind.generation} slices, only {', '.join(gke_generations())}"
        )
    if not _NAME.match(args.name):
        raise ConfigError(
            f"--name {args.name!r}: lowercase letters, digits and -, at most 40, starting with a letter"
        )
    check_shm_size(args.shm_size)
    check_output_dir(command)
    check_num_slices(args.num_slices, command)
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {
            "name": args.name,
            # All pods of a Job on one node pool, i.e. one physical slice (JobSet's exclusive placement).
            "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
        },
        "spec": {
            "failurePolicy": failure_policy(args.max_restarts),
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": args.num_slices,  # one Job per slice, each on a node pool of its own
                    "template": {
                        "spec": {
                            "completionMode": "Indexed",
                            "parallelism": kind.hosts,
                            "completions": kind.hosts,
                            "backoffLimit": 0,  # one failed pod fails the Job: the JobSet restarts all
                            "podFailurePolicy": pod_failure_policy(),
                            "template": {"spec": pod_spec(kind, args, command)},
                        }
                    },
                }
            ],
        },
    }


def build_parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="tpustream-pod gke-manifest",
        usage="%(prog)s --type TYPE --image IMAGE [options] -- COMMAND [ARG ...]",
        description="Print a JobSet manifest that runs COMMAND on every host of a GKE TPU slice.",
    )
    parser.add_argument("--type", required=True, metavar="TYPE", help="accelerator type, e.g. v5litepod-16")
    parser.add_argument("--image", required=True, help="built from this repository's Dockerfile")
    parser.add_argument("--name", default="tpustream", help="the JobSet's name (default tpustream)")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help=f"restarts after a hang (exit {HUNG_EXIT_CODE}) or another failure; "
        f"exit {PREEMPTED_EXIT_CODE} and evictions are free (default 3)",
    )
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="set in every pod")
    parser.add_argument("--spot", action="store_true", help="run on spot nodes (cloud.google.com/gke-spot)")
    parser.add_argument("--termination-grace", type=int, default=30, metavar="SECONDS", help="default 30")
    parser.add_argument(
        "--shm-size", default="16Gi", help="/dev/shm per pod, a Kubernetes quantity (default 16Gi)"
    )
    parser.add_argument(
        "--num-slices",
        type=int,
        default=1,
        metavar="N",
        help="slices of --type joined over DCN (multislice; the command sets mesh.slices=N) (default 1)",
    )
    return parser


def gke_main(argv: list[str]) -> int:
    options, command = split_command(argv)
    args = build_parser().parse_args(options)
    if not command:
        raise ConfigError("no command: put it after --, e.g. -- python train.py accelerator=tpu")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    kind = slice_type(args.type)
    manifest = jobset_manifest(kind, args, command)
    slices = f"{args.num_slices} slices of " if args.num_slices > 1 else ""
    header = (
        f"# {slices}{kind.name} on GKE: {kind.hosts} pod(s) x {kind.chips_per_host} chip(s), topology "
        f"{kind.topology} (node pools of {kind.gke_machine_type}); made by tpustream-pod gke-manifest\n"
        f"# Restarts: after exit {PREEMPTED_EXIT_CODE} (preempted, last.pt saved) or an eviction, "
        f"as often as they come; after exit {HUNG_EXIT_CODE} (hung: stacks in output_dir/watchdog/) or "
        f"any other failure, at most {args.max_restarts} times (maxRestarts)"
    )
    print(header + "\n" + to_yaml(manifest), end="", flush=True)
    return 0
