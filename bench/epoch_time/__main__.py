"""The epoch-time benchmark's command line: python -m bench.epoch_time [options] [-- HYDRA_OVERRIDE ...]."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
import shutil
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from bench import epoch_time
from bench.epoch_time.collect import RunResult, collect_runs
from bench.epoch_time.plan import (
    ACCELERATORS,
    REPO,
    SWITCHES,
    build_plan,
    cache_key,
    check_with_hydra,
    default_name,
    describe_device,
)
from bench.epoch_time.report import (
    epoch_methods,
    failure_report,
    format_duration,
    format_mean,
    setup_methods,
    write_report,
)
from bench.epoch_time.run import run_one, train_command

DEFAULT_EPOCHS = 5


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.epoch_time",
        description=epoch_time.__doc__.splitlines()[0],
        usage="%(prog)s [options] [-- HYDRA_OVERRIDE ...]",
        epilog="Everything after -- goes to every train.py run, e.g. -- model=resnet18 accelerator=tpu",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="+",
        default=[32, 64, 128, 256],
        metavar="B",
        help="values of batch_size (per replica; default 32 64 128 256)",
    )
    parser.add_argument(
        "--epochs", type=int, default=DEFAULT_EPOCHS, help=f"epochs per run (default {DEFAULT_EPOCHS})"
    )
    parser.add_argument(
        "--switches",
        nargs="*",
        choices=list(SWITCHES),
        default=list(SWITCHES),
        help="switches to vary (default all; none: the baseline only); the others are left to the config",
    )
    parser.add_argument(
        "--full", action="store_true", help="every combination of the switches, not one flip at a time"
    )
    parser.add_argument(
        "--cold-warm",
        type=int,
        nargs="*",
        default=None,
        metavar="B",
        help="also run the baseline twice with a fresh compile cache at these batch sizes "
        "(no value: every batch size)",
    )
    parser.add_argument(
        "--accelerator",
        choices=ACCELERATORS,
        help="accelerator config of every run (default: the config's); the report names the device",
    )
    parser.add_argument("--name", help="results folder name (default <model>-<data>-<device>)")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results/epoch_time/<name>)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per run before it is killed")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep each run's checkpoints/")
    parser.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    parser.add_argument(
        "--collect",
        type=Path,
        nargs="+",
        metavar="DIR",
        help="run nothing: report the finished train.py runs below DIR (e.g. a Hydra multirun folder)",
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args(argv)
    if args.epochs < 1:
        parser.error("--epochs must be at least 1")
    if any(b < 1 for b in args.batch_sizes):
        parser.error("--batch-sizes must be positive")
    if args.cold_warm is not None and not args.cold_warm:
        args.cold_warm = list(args.batch_sizes)
    args.cold_warm = args.cold_warm or []
    if args.accelerator:
        if any(o.split("=", 1)[0].lstrip("+~") == "accelerator" for o in args.overrides):
            parser.error("--accelerator and an accelerator= override: give one")
        args.overrides = [f"accelerator={args.accelerator}", *args.overrides]
    if args.collect and (args.overrides or args.dry_run or args.cold_warm):
        parser.error("--collect reports finished runs: no overrides, --dry-run or --cold-warm with it")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join(["python", "-m", "bench.epoch_time", *argv])
    if args.collect:
        return report_collected(args, command)
    key = cache_key()
    plan_args = dict(
        epochs=args.epochs, extra=args.overrides, full=args.full, cold_warm=args.cold_warm, cache=key
    )
    # Composed once with a placeholder cache folder to learn the names; the real folder needs --out.
    cfg = check_with_hydra(build_plan(args.batch_sizes, args.switches, **plan_args))
    name = args.name or default_name(cfg)
    out = (args.out or REPO / "bench" / "results" / "epoch_time" / name).resolve()
    plan = build_plan(args.batch_sizes, args.switches, cache_root=out / "xla-cache", **plan_args)
    print(f"{len(plan)} run(s) of `python train.py`, {args.epochs} epoch(s) each -> {out}", flush=True)
    if args.dry_run:
        for spec in plan:
            print(f"{spec.name}: {shlex.join(train_command(spec, out / 'runs' / spec.name))}")
        return 0

    out.mkdir(parents=True, exist_ok=True)
    if args.cold_warm:
        shutil.rmtree(out / "xla-cache", ignore_errors=True)  # cold means cold
    started = datetime.datetime.now().astimezone()
    results: list[RunResult] = []
    for index, spec in enumerate(plan, 1):
        print(f"[{index}/{len(plan)}] {spec.name} ...", end=" ", flush=True)
        result = run_one(spec, out / "runs" / spec.name, args.timeout, args.keep_checkpoints)
        results.append(result)
        s = result.summary
        if result.ok:
            print(
                f"set-up {format_duration(s['setup_s'])}, epoch 1 {format_duration(s['epoch1_s'])}, "
                f"mean {format_mean(s['mean_s'], s['std_s'])}, {s['compilations']} compilations, "
                f"other load {result.other_load:.2f} cores",
                flush=True,
            )
        else:
            print(f"FAILED ({result.error})\n{failure_report(result)}", flush=True)
    finished = datetime.datetime.now().astimezone()

    loads = [r.other_load for r in results if not math.isnan(r.other_load)]
    notes = [
        f"Command: `{command}`  ",
        f"Measured {started:%Y-%m-%d %H:%M}-{finished:%H:%M %Z} on {os.cpu_count()} CPUs "
        f"({platform.machine()}); other programs used {statistics.fmean(loads) if loads else math.nan:.2f} "
        f"cores on average during the runs (max {max(loads, default=math.nan):.2f}; per run in runs.csv).  ",
        f"Set-up measured as: {setup_methods(results)}; epoch time from: {epoch_methods(results)}.  ",
        f"Device: {describe_device(cfg)}.",
    ]
    sweep = {
        "command": command,
        "device": describe_device(cfg),
        "started": started.isoformat(),
        "finished": finished.isoformat(),
        "overrides": args.overrides,
        "batch_sizes": args.batch_sizes,
        "epochs": args.epochs,
        "switches": {
            s: {"baseline": vars(SWITCHES[s].baseline), "flipped": vars(SWITCHES[s].flipped)}
            for s in args.switches
        },
        "full": args.full,
        "cold_warm": args.cold_warm,
        "cache_key": key,
    }
    title = f"Epoch time: {name}, {args.epochs} epochs per run"
    return write_report(results, out, title, notes, sweep, f"{name}: {args.epochs} epochs per run")


def report_collected(args: argparse.Namespace, command: str) -> int:
    """--collect: the same report for runs made elsewhere (a Hydra multirun, runs on a TPU host)."""
    results, cfg = collect_runs(args.collect)
    name = args.name or default_name(cfg)
    out = (args.out or REPO / "bench" / "results" / "epoch_time" / name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    epochs = sorted({r.summary["epochs"] for r in results if r.summary})
    varied = sorted({switch for r in results for switch, _ in r.spec.settings})
    notes = [
        f"Command: `{command}`  ",
        f"Collected {len(results)} finished train.py run(s) from {', '.join(map(str, args.collect))}; "
        "the load from other programs was not measured.  ",
        f"Switches told apart by the runs' configs: {', '.join(varied) or 'none'}.  ",
        f"Set-up measured as: {setup_methods(results)}; epoch time from: {epoch_methods(results)}. In a "
        "Hydra multirun every job after the first runs in the same process: its set-up starts at its own "
        "start and leaves out the imports the first job paid for.",
    ]
    sweep = {"command": command, "collected": [str(folder) for folder in args.collect], "runs": len(results)}
    per_run = "/".join(map(str, epochs)) or "?"
    title = f"Epoch time: {name}, {per_run} epochs per run (collected)"
    return write_report(results, out, title, notes, sweep, f"{name}: {per_run} epochs per run (collected)")


if __name__ == "__main__":
    sys.exit(main())
