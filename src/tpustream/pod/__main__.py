"""python -m tpustream.pod (or tpustream-pod): run one command on every host of a Cloud TPU VM pod.

    python -m tpustream.pod --tpu NAME --zone ZONE --sync -- \\
        .venv/bin/python train.py accelerator=tpu data=cifar10 data.root=gs://BUCKET/cifar10 ...

and the pod's life around it: ``create`` (tpustream.pod.create), ``delete``, and
``gke-manifest`` (tpustream.pod.gke), the same training as a GKE JobSet.

This is the only place that turns errors into exit codes: a TpustreamError is
one line on stderr and exit code 2; a Ctrl-C at any moment is 130 (see
tpustream.pod.interrupts); otherwise the exit code is 0 if every worker exited
0, else the first failing worker's (see tpustream.pod.supervise).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

from tpustream.errors import HUNG_EXIT_CODE, PREEMPTED_EXIT_CODE, ConfigError, TpustreamError
from tpustream.pod import interrupts
from tpustream.pod.commands import dry_run_lines
from tpustream.pod.create import create_main, delete_main
from tpustream.pod.gke import gke_main
from tpustream.pod.recreate import recreate_dry_run_lines
from tpustream.pod.spec import DEFAULT_WORKDIR, LaunchSpec, parse_env
from tpustream.pod.supervise import launch_pod
from tpustream.pod.usage import UsageParser, split_command

EPILOG = f"""\
The command after -- runs in WORKDIR on every host as
  cd WORKDIR && env PJRT_DEVICE=TPU TPUSTREAM_HOST_INDEX=I K=V ... COMMAND
in a process group of its own (recorded in ~/.tpustream/runs/RUN_ID.I.pid, its
processes marked with TPUSTREAM_RUN_ID), with every token quoted, so overrides
arrive exactly as typed here (spaces, $, quotes, *, brace patterns such as
gs://b/train-{{000000..000639}}.tar).

--sync copies the git-tracked files of this checkout to WORKDIR on every host and
installs them into WORKDIR/.venv (pip install -e '.[tpu]'): the command is then
  .venv/bin/python train.py accelerator=tpu ...

If a worker fails, the others are stopped: SIGTERM (then SIGKILL) to exactly the process
groups this launch started on each host, never to other jobs that look alike.
--restart relaunches after exit {PREEMPTED_EXIT_CODE} (preempted, last.pt saved), {HUNG_EXIT_CODE} (hung: the
watchdog wrote the stacks to output_dir/watchdog/) or 255 (ssh connection lost) once
the TPU VM is READY again; train.py resumes from last.pt (resume=auto). Every relaunch
counts against --max-restarts, once per attempt however many workers failed.

--recreate (with --restart and --sync) recreates a pod that was taken (PREEMPTED,
TERMINATED, gone): it deletes what is left, asks for the same pod again as a queued
resource, waits until it is ACTIVE, syncs and reruns the command; at most
--max-restarts requests, --backoff seconds (doubling) after one that failed. With
--type TYPE [--spot|--preemptible|--reserved] it also makes the pod if it does not
exist yet, so one command takes a spot run from nothing to its end.

--num-slices N runs one job on the N slices of a multislice pod, the nodes
NAME-0 .. NAME-(N-1) of queued resource NAME (as `create NAME --num-slices N`
makes them): every host also gets MEGASCALE_NUM_SLICES, MEGASCALE_SLICE_ID and
MEGASCALE_COORDINATOR_ADDRESS (the first host of NAME-0), and TPUSTREAM_HOST_INDEX
counts hosts within its slice.

other commands (each with --help):
  create NAME --zone Z --type T [--spot|--preemptible|--reserved] [--num-slices N]   ask for a pod
  delete NAME --zone Z                                               delete a pod
  gke-manifest --type T --image IMAGE -- COMMAND ...                 a GKE JobSet manifest

example (a spot v5e pod, made if missing, recreated whenever it is taken):
  python -m tpustream.pod --tpu tpustream --zone europe-west4-a --type v5litepod-16 --spot \\
      --sync --restart --recreate --max-restarts 20 -- \\
      .venv/bin/python train.py accelerator=tpu data=cifar10 data.root=gs://BUCKET/cifar10 \\
      output_dir=gs://BUCKET/runs/cifar10-r50 model=resnet50
"""


def add_recreate_options(parser: argparse.ArgumentParser) -> None:
    """--recreate and what it needs: backoff, the wait for capacity, how to make a missing pod."""
    parser.add_argument(
        "--recreate",
        action="store_true",
        help="ask for a pod that was taken again (queued resource) and rerun (needs --restart --sync)",
    )
    parser.add_argument(
        "--backoff",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="--recreate: wait before asking again after a failed request, doubling (default 60)",
    )
    parser.add_argument(
        "--create-timeout",
        type=float,
        default=7200.0,
        metavar="SECONDS",
        help="--recreate: give up on a request not ACTIVE after this long (default 7200)",
    )
    parser.add_argument(
        "--type",
        dest="slice_type",
        metavar="TYPE",
        help="--recreate: if the pod does not exist yet, make it first, of this type (e.g. v5litepod-16)",
    )
    capacity = parser.add_mutually_exclusive_group()
    for name in ("spot", "preemptible", "reserved"):
        capacity.add_argument(f"--{name}", action="store_true", help=f"with --type: a {name} pod")


def build_parser() -> argparse.ArgumentParser:
    parser = UsageParser(
        prog="python -m tpustream.pod",
        usage="%(prog)s --tpu NAME --zone ZONE [options] -- COMMAND [ARG ...]\n"
        "       %(prog)s {create,delete,gke-manifest} ... (see below)",
        description="Run COMMAND on every host of a Cloud TPU VM pod through gcloud, each output line "
        "prefixed with its host ([worker I]).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tpu", required=True, metavar="NAME", help="TPU VM name")
    parser.add_argument("--zone", required=True, metavar="ZONE", help="its zone, e.g. europe-west4-a")
    parser.add_argument("--project", metavar="PROJECT", help="its project (default: gcloud's)")
    parser.add_argument(
        "--env", action="append", default=[], metavar="K=V", help="set on every host (repeatable)"
    )
    parser.add_argument(
        "--workdir", default=DEFAULT_WORKDIR, help=f"folder on every host (default {DEFAULT_WORKDIR})"
    )
    parser.add_argument(
        "--sync", action="store_true", help="copy this checkout to every host and pip install it first"
    )
    parser.add_argument(
        "--source", type=Path, metavar="DIR", help="what --sync copies (default: this tpustream checkout)"
    )
    parser.add_argument(
        "--restart",
        action="store_true",
        help=f"relaunch after exit {PREEMPTED_EXIT_CODE} (preempted), {HUNG_EXIT_CODE} (hung) "
        "or 255 (ssh connection lost)",
    )
    parser.add_argument(
        "--max-restarts", type=int, default=3, metavar="N", help="relaunches, whatever the cause (default 3)"
    )
    parser.add_argument(
        "--num-workers", type=int, metavar="N", help="hosts of the TPU VM (default: from gcloud describe)"
    )
    parser.add_argument(
        "--num-slices",
        type=int,
        default=1,
        metavar="N",
        help="multislice: run on the N slices NAME-0 .. NAME-(N-1) of one queued resource as one job "
        "(the command sets mesh.slices=N; default 1)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="after a worker fails, time the others get to end on their own (default 30)",
    )
    parser.add_argument(
        "--poll-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="between describe calls while waiting for READY (default 30)",
    )
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="give up waiting for READY after this long (default 3600)",
    )
    add_recreate_options(parser)
    parser.add_argument(
        "--dry-run", action="store_true", help="print the gcloud commands, one per line, and run nothing"
    )
    return parser


def parse_args(argv: list[str]) -> tuple[LaunchSpec, bool]:
    """The launch spec and whether this is a dry run; the command is everything after the first --."""
    options, command = split_command(argv)
    args = build_parser().parse_args(options)
    if not command:
        raise ConfigError("no command: put it after --, e.g. -- .venv/bin/python train.py accelerator=tpu")
    spec = LaunchSpec(
        tpu=args.tpu,
        zone=args.zone,
        project=args.project,
        command=tuple(command),
        env=parse_env(args.env),
        workdir=args.workdir,
        sync=args.sync,
        source=args.source,
        restart=args.restart,
        max_restarts=args.max_restarts,
        num_workers=args.num_workers,
        grace=args.grace,
        poll_interval=args.poll_interval,
        ready_timeout=args.ready_timeout,
        recreate=args.recreate,
        backoff=args.backoff,
        create_timeout=args.create_timeout,
        slice_type=args.slice_type,
        provisioning=next((n for n in ("spot", "preemptible", "reserved") if getattr(args, n)), "on-demand"),
        num_slices=args.num_slices,
    )
    return spec, args.dry_run


def launch_main(argv: list[str]) -> int:
    if argv and not argv[0].startswith("-"):
        # A launch begins with its options; else argparse would answer that --tpu and --zone are missing.
        raise ConfigError(unknown_command(argv[0]))
    spec, dry_run = parse_args(argv)
    if dry_run:
        lines = dry_run_lines(spec) + (recreate_dry_run_lines(spec) if spec.recreate else [])
        print("\n".join(lines), flush=True)
        return 0
    return launch_pod(spec)


SUBCOMMANDS = {"create": create_main, "delete": delete_main, "gke-manifest": gke_main}


def unknown_command(name: str) -> str:
    """One line naming the unknown command, a close known one if any, and all of them."""
    close = difflib.get_close_matches(name, SUBCOMMANDS, n=1)
    guess = f"; did you mean {close[0]!r}?" if close else ""
    return (
        f"unknown command {name!r}{guess} (known: {', '.join(SUBCOMMANDS)}; "
        "a launch starts with its options: --tpu NAME --zone ZONE ... -- COMMAND)"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    run = SUBCOMMANDS.get(argv[0]) if argv else None
    try:
        with interrupts.handling():
            code = run(argv[1:]) if run else launch_main(argv)
    except TpustreamError as exc:
        if not interrupts.received():  # else the Ctrl-C is the cause (it also reaches gcloud run here)
            print(f"python -m tpustream.pod: error: {exc}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        pass
    else:
        if not interrupts.received():  # else one came as the launch ended: it still counts
            return code
    print("python -m tpustream.pod: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
