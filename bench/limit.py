"""How far a configuration runs from the accelerator's own rate, and how much of the gap the input is.

    python -m bench.limit [--epochs 3] [--rounds 1] [--out DIR] [--dry-run] -- TRAIN_PY_OVERRIDE ...

Runs `python train.py OVERRIDES` twice per round, first with data.synthetic=true
(the same step on one batch resident on the device: the accelerator's own
rate for this model, batch, precision and strategy), then with its data, and
prints their steady rates (epochs after the first, as bench.ab), the ratio,
the input-bound share that ratio implies (1 - real / synthetic), and the
shares the real run measured itself: the device's idle time waiting for input
(input_bound_fraction, where the accelerator can measure it) and the training
thread's wait for batches (input_wait_fraction, host-side). Both runs skip
evaluation (eval_every=0): only the training loop's rate is compared.
results.json in --out (default bench/results/limit/<time>) keeps every number
with the command. The overrides are composed as train.py would before anything
runs, and the real run's shards listed: a missing folder (data/digits in a
fresh checkout) is one line, not two failed runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.harness import (
    REPO,
    compose_train_config,
    log_tail,
    read_records,
    run_logged,
    steady_rate,
    train_command,
)
from tpustream.observe.advice import mean_of, measured

KINDS = ("synthetic", "real")
# Both runs: no evaluation (only the loop's rate counts), and their own folders.
COMMON = ("eval_every=0",)
# Set per run by bench.limit (train_command: each run's own folder under --out, from scratch).
OWN_KEYS = ("data.synthetic", "output_dir", "resume", "hydra.run.dir", "epochs")


def summarise(synthetic: Sequence[float], real: Sequence[float], measured: dict[str, Any]) -> dict[str, Any]:
    """The comparison: mean rates over rounds, ratio, implied and measured input-bound shares."""
    synthetic_rate, real_rate = statistics.fmean(synthetic), statistics.fmean(real)
    ratio = real_rate / synthetic_rate
    return {
        "samples_per_second": {"synthetic": list(synthetic), "real": list(real)},
        "synthetic_rate": synthetic_rate,
        "real_rate": real_rate,
        "of_synthetic": ratio,
        "implied_input_bound": max(0.0, 1.0 - ratio),
        **measured,
    }


def describe(summary: Mapping[str, Any]) -> str:
    """The printed lines."""

    def share(key: str) -> str:
        value = summary.get(key)
        return "not measured here" if value is None else f"{100 * value:.1f}%"

    ratio = summary["of_synthetic"]
    # Synthetic is the same step without the input: a real run faster than it is the machine's
    # drift between the runs, not an input that costs nothing; the gap is below what one round sees.
    noise = (
        " (above 1: the real run was faster than its synthetic twin, so the gap is within this "
        "machine's noise; more --rounds narrow it)"
        if ratio > 1
        else ""
    )
    return "\n".join(
        [
            f"synthetic (data.synthetic=true): {summary['synthetic_rate']:.1f} samples/s",
            f"real:                            {summary['real_rate']:.1f} samples/s",
            f"real / synthetic:                {ratio:.3f}{noise}",
            f"input-bound, implied:            {100 * summary['implied_input_bound']:.1f}% "
            + ("(noise: real/synthetic above 1)" if noise else "(1 - real/synthetic)"),
            f"input-bound, measured:           {share('input_bound_fraction')} "
            "(the device idle for input: input_bound_fraction)",
            f"host wait for batches:           {share('input_wait_fraction')} "
            "(the training thread's, host-side: input_wait_fraction)",
            f"of the waits, for the making:    {share('input_making_share')} "
            "(batches the workers had not made yet; the rest, their delivery: input_making_share)",
        ]
    )


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.limit",
        description=__doc__.splitlines()[0],
        usage="%(prog)s [options] [-- TRAIN_PY_OVERRIDE ...]",
    )
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3; epoch 0 left out)")
    parser.add_argument("--rounds", type=int, default=1, help="synthetic-real pairs, alternating (default 1)")
    parser.add_argument("--out", type=Path, help="results folder (default bench/results/limit/<time>)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands; run nothing")
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    if args.rounds < 1 or args.epochs < 2:
        parser.error("--rounds must be at least 1 and --epochs at least 2 (epoch 0 is left out)")
    args.overrides = list(argv[split + 1 :])
    for override in args.overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key == "data.synthetic":
            parser.error("leave data.synthetic out of the overrides: each pair runs it both ways")
        if key in OWN_KEYS:
            parser.error(
                f"leave {key} out of the overrides: bench.limit sets it for each run "
                "(its own folder under --out, from scratch; --epochs for epochs)"
            )
    return args


def check_runnable(overrides: Sequence[str]) -> None:
    """Compose the overrides as train.py would and list the real run's shards; or exit in one line."""
    from tpustream.data.resolve.shard_spec import expand_spec
    from tpustream.errors import ConfigError

    try:
        cfg = compose_train_config(overrides)
    except Exception as exc:  # Hydra raises several types; all mean "train.py would refuse"
        refused = shlex.join(overrides) or "the defaults"
        raise SystemExit(f"bench.limit: train.py would refuse {refused}: {exc}") from None
    if cfg.data.train_shards is None:
        return
    try:
        expand_spec(cfg.data.train_shards)
    except ConfigError as exc:
        hint = (
            f"; make the embedded digits first: tpustream-make-shards digits {cfg.data.root}"
            if str(cfg.data.root).rstrip("/").endswith("/digits")
            else ""
        )
        raise SystemExit(f"bench.limit: the real run has no shards to read: {exc}{hint}") from None


def commands(args: argparse.Namespace, runs: Path) -> list[tuple[str, Path, list[str]]]:
    """(kind, run folder, train.py command) in the order they run: synthetic, then real, per round."""
    planned = []
    for n in range(args.rounds):
        for kind in KINDS:
            folder = runs / f"{kind}-{n}"
            overrides = [*args.overrides, *COMMON, f"data.synthetic={str(kind == 'synthetic').lower()}"]
            planned.append((kind, folder, train_command(REPO, folder, args.epochs, overrides)))
    return planned


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = (args.out or REPO / "bench" / "results" / "limit" / stamp).resolve()
    planned = commands(args, out / "runs")
    if args.dry_run:
        for _, _, command in planned:
            print(shlex.join(command))
        return 0
    check_runnable(args.overrides)
    rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
    real_records: list[dict[str, Any]] = []
    for kind, folder, command in planned:
        code, _ = run_logged(command, folder / "output.log")
        if code != 0:
            print(log_tail(folder / "output.log"), file=sys.stderr)
            raise SystemExit(f"{kind} run {folder.name}: train.py exited with {code}")
        records = read_records(folder)
        rates[kind].append(steady_rate(records))
        if kind == "real":
            real_records.extend(measured(records))
        print(f"{folder.name}: {rates[kind][-1]:.1f} samples/s", flush=True)
    keys = ("input_bound_fraction", "input_wait_fraction", "input_making_share")
    shares = {key: mean_of(real_records, key) for key in keys}
    summary = summarise(rates["synthetic"], rates["real"], shares)
    summary.update(
        command=shlex.join(["python", "-m", "bench.limit", *argv]),
        measured=datetime.datetime.now().astimezone().isoformat(timespec="minutes"),
        cpus=os.cpu_count(),
        overrides=args.overrides,
        epochs=args.epochs,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(describe(summary))
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
