"""``tpustream-pod create`` and ``delete``: a pod asked for as a queued resource, recorded, and removed.

    tpustream-pod create tpustream --zone europe-west4-a --type v5litepod-16 --spot
    tpustream-pod delete tpustream --zone europe-west4-a

create asks for the slice as a Cloud TPU queued resource (it waits for capacity
instead of failing), with the runtime version that fits the type
(tpustream.pod.types) and the host set-up every host runs at boot
(queued.HOST_SETUP_SCRIPT), waits until it is ACTIVE, and records how it was
made on this machine, so that ``--recreate`` can ask for the same pod again.
"""

from __future__ import annotations

import argparse
import shlex
import time
from dataclasses import replace

from tpustream.pod import queued
from tpustream.pod.processes import Console, require_gcloud
from tpustream.pod.slice_spec import SliceSpec, load_record, save_record
from tpustream.pod.types import slice_type
from tpustream.pod.usage import UsageParser

STARTUP_PLACEHOLDER = "STARTUP_SCRIPT"  # the temporary file's path, in a dry run


def build_create_parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="tpustream-pod create",
        description="Ask for a Cloud TPU VM pod as a queued resource, set up for tpustream, and wait for it.",
    )
    parser.add_argument("name", metavar="NAME", help="the pod's name (its queued resource and node)")
    parser.add_argument("--zone", required=True, help="e.g. europe-west4-a")
    parser.add_argument("--type", required=True, metavar="TYPE", help="accelerator type, e.g. v5litepod-16")
    parser.add_argument("--project", help="default: gcloud's")
    parser.add_argument("--runtime-version", metavar="VERSION", help="default: the one for PyTorch on TYPE")
    parser.add_argument(
        "--num-slices",
        type=int,
        default=1,
        metavar="N",
        help="multislice: N slices of TYPE, nodes NAME-0 .. NAME-(N-1) of one queued resource (default 1)",
    )
    capacity = parser.add_mutually_exclusive_group()
    capacity.add_argument("--spot", action="store_true", help="spot capacity: cheaper, may be taken")
    capacity.add_argument(
        "--preemptible", action="store_true", help="preemptible TPU VM (tpu-vm create: no queued form)"
    )
    capacity.add_argument("--reserved", action="store_true", help="from the project's reservation")
    parser.add_argument("--network", help="VPC network (default: gcloud's, 'default')")
    parser.add_argument("--subnetwork", help="its subnetwork")
    parser.add_argument("--service-account", metavar="EMAIL", help="the hosts' account (reads the bucket)")
    parser.add_argument(
        "--create-timeout", type=float, default=7200.0, metavar="SECONDS", help="default 7200"
    )
    parser.add_argument("--poll-interval", type=float, default=30.0, metavar="SECONDS", help="default 30")
    parser.add_argument("--no-wait", action="store_true", help="return once the request is accepted")
    parser.add_argument("--dry-run", action="store_true", help="print the gcloud command, create nothing")
    return parser


def spec_from_args(args: argparse.Namespace) -> SliceSpec:
    known = slice_type(args.type)  # an unknown type: one line naming the known ones
    provisioning = next(
        (name for name in ("spot", "preemptible", "reserved") if getattr(args, name)), "on-demand"
    )
    return SliceSpec(
        name=args.name,
        zone=args.zone,
        project=args.project,
        accelerator_type=known.name,
        runtime_version=args.runtime_version or known.runtime_version,
        provisioning=provisioning,
        slices=args.num_slices,
        network=args.network,
        subnetwork=args.subnetwork,
        service_account=args.service_account,
    )


def create_dry_run_lines(spec: SliceSpec) -> list[str]:
    known = slice_type(spec.accelerator_type)
    lines = [
        "# dry run: nothing is created",
        f"# {spec.kind}: {known.hosts} host(s) x {known.chips_per_host} chip(s), topology {known.topology}"
        + (" each" if spec.slices > 1 else ""),
        shlex.join(queued.create_command(spec, STARTUP_PLACEHOLDER)),
    ]
    if spec.queued:
        describe = shlex.join(queued.queued_describe_command(spec))
        lines.append(f"# then, every --poll-interval seconds until ACTIVE: {describe}")
    lines.append(f"# {STARTUP_PLACEHOLDER} (a temporary file), run as root at every boot of every host:")
    lines += [f"#   {line}" for line in queued.HOST_SETUP_SCRIPT.splitlines()]
    return lines


def next_step(spec: SliceSpec) -> str:
    project = f" --project {spec.project}" if spec.project else ""
    slices = f" --num-slices {spec.slices}" if spec.slices > 1 else ""
    mesh = f" strategy=spmd mesh.slices={spec.slices}" if spec.slices > 1 else ""
    return (
        f"next: tpustream-pod --tpu {spec.name} --zone {spec.zone}{project}{slices} --sync --restart "
        f"--recreate -- .venv/bin/python train.py accelerator=tpu{mesh} output_dir=gs://BUCKET/runs/NAME ..."
    )


def create_main(argv: list[str]) -> int:
    args = build_create_parser().parse_args(argv)
    spec = spec_from_args(args)
    if args.dry_run:
        print("\n".join(create_dry_run_lines(spec)), flush=True)
        return 0
    require_gcloud(spec)
    console = Console()
    begun = time.monotonic()
    delete = " && ".join(shlex.join(argv) for argv in queued.delete_commands(spec))
    try:
        queued.request(spec, console)
        console.say(f"recorded how {spec.name} was made in {save_record(spec)} (for --recreate)")
        took = time.monotonic() - begun
        console.say(f"asked for {spec.name} ({spec.kind}, {spec.provisioning}) in {took:.0f}s")
        if not args.no_wait:
            queued.wait_until_active(spec, console, args.create_timeout, args.poll_interval)
    except KeyboardInterrupt:
        # The user asked for this pod: what gcloud made of the request stays, and is named.
        console.say(f"{spec.name} may exist (a Ctrl-C does not withdraw it); delete it with: {delete}")
        raise
    except queued.RequestRefused:
        raise  # nothing was made
    except queued.ProvisioningFailed:
        console.say(f"{spec.name} stays as it is; delete it with: {delete}")
        raise
    console.say(next_step(spec))
    return 0


def build_delete_parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="tpustream-pod delete",
        description="Delete a pod: its queued resource and its TPU VM, however it was made.",
    )
    parser.add_argument("name", metavar="NAME")
    parser.add_argument("--zone", required=True)
    parser.add_argument("--project")
    parser.add_argument(
        "--num-slices",
        type=int,
        metavar="N",
        help="its nodes are NAME-0 .. NAME-(N-1) (default: as recorded when it was made here, else 1)",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the gcloud commands, delete nothing")
    return parser


def delete_main(argv: list[str]) -> int:
    args = build_delete_parser().parse_args(argv)
    spec = load_record(args.name, args.zone, args.project) or SliceSpec(
        name=args.name, zone=args.zone, project=args.project, accelerator_type="", runtime_version=""
    )
    if args.num_slices is not None:
        spec = replace(spec, slices=args.num_slices)
    if args.dry_run:
        lines = ["# dry run: each runs only if describe finds what it deletes"]
        print("\n".join(lines + [shlex.join(argv) for argv in queued.delete_commands(spec)]), flush=True)
        return 0
    require_gcloud(spec)
    console = Console()
    begun = time.monotonic()
    if not queued.delete(spec, console):
        return 1
    console.say(f"deleted {spec.name}: nothing of it is left ({time.monotonic() - begun:.0f}s)")
    return 0
