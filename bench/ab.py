"""Samples/s of the same train.py run at two commits, alternating: did a change slow training down?

    python -m bench.ab BEFORE AFTER [--rounds 2] [--epochs 5] [-- HYDRA_OVERRIDE ...]

Each commit is checked out into a temporary git worktree and runs
`python train.py` from there (its own src/ first on PYTHONPATH), in the order
BEFORE, AFTER, BEFORE, AFTER, ... so that a machine whose load drifts
treats both alike. A run's rate is the mean of its epochs' samples/s
(metrics.jsonl's global_rate) leaving out epoch 0, which starts the workers
and compiles. The table gives each run's rate and each commit's mean, and
results.json keeps them with the command; the time breakdown's cost, for
one: `python -m bench.ab 688e6f2 c540fba` (before it, and with it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.harness import REPO, log_tail, read_records, run_logged, steady_rate, train_command

DEFAULT_OVERRIDES = ("data.num_workers=2",)


def run_order(refs: Sequence[str], rounds: int) -> list[tuple[str, int]]:
    """(ref, round) in the order they run: every ref once per round, alternating."""
    return [(ref, n) for n in range(rounds) for ref in refs]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.ab",
        description=__doc__.splitlines()[0],
        usage="%(prog)s BEFORE AFTER [options] [-- HYDRA_OVERRIDE ...]",
        epilog=f"Hydra overrides for every run go after -- (default: {' '.join(DEFAULT_OVERRIDES)})",
    )
    parser.add_argument("before", help="a commit (the reference)")
    parser.add_argument("after", help="a commit (the change)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each commit, alternating (default 2)")
    parser.add_argument(
        "--epochs", type=int, default=5, help="epochs per run (default 5; epoch 0 is left out)"
    )
    parser.add_argument("--out", type=Path, help="results folder (default bench/results/ab/<before>-<after>)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    if args.rounds < 1 or args.epochs < 2:
        parser.error("--rounds must be at least 1 and --epochs at least 2 (epoch 0 is left out)")
    args.overrides = argv[split + 1 :] or list(DEFAULT_OVERRIDES)
    return args


def resolve(ref: str) -> str:
    done = subprocess.run(["git", "rev-parse", "--short", ref], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{ref}: not a commit of this repository")
    return done.stdout.strip()


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    refs = [resolve(args.before), resolve(args.after)]
    out = (args.out or REPO / "bench" / "results" / "ab" / "-".join(refs)).resolve()
    work = Path(tempfile.mkdtemp(prefix="tpustream-ab-"))
    trees = {ref: work / ref for ref in refs}
    order = run_order(refs, args.rounds)
    if args.dry_run:
        for ref, n in order:
            print(
                shlex.join(
                    train_command(trees[ref], work / "runs" / f"{ref}-{n}", args.epochs, args.overrides)
                )
            )
        return 0
    rates: dict[str, list[float]] = {ref: [] for ref in refs}
    try:
        for ref in refs:
            subprocess.run(["git", "worktree", "add", "--detach", str(trees[ref]), ref], cwd=REPO, check=True)
        for ref, n in order:
            run = work / "runs" / f"{ref}-{n}"
            command = train_command(trees[ref], run, args.epochs, args.overrides)
            code, _ = run_logged(command, run / "output.log", tree=trees[ref])
            if code != 0:
                print(log_tail(run / "output.log"), file=sys.stderr)
                raise SystemExit(f"{ref} round {n}: train.py exited with {code}")
            rate = steady_rate(read_records(run))
            rates[ref].append(rate)
            print(f"{ref} round {n}: {rate:.1f} samples/s", flush=True)
    finally:
        for ref in refs:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(trees[ref])], cwd=REPO, capture_output=True
            )
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "bench.ab", *argv])
    means = {ref: statistics.fmean(values) for ref, values in rates.items()}
    result = {
        "command": command,
        "measured": datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
        "cpus": os.cpu_count(),
        "overrides": args.overrides,
        "epochs": args.epochs,
        "samples_per_second": rates,
        "mean": means,
        "after_over_before": means[refs[1]] / means[refs[0]],
    }
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{refs[0]}: {means[refs[0]]:.1f} samples/s; {refs[1]}: {means[refs[1]]:.1f} "
        f"({result['after_over_before']:.3f}x)"
    )
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
