"""bench.feed's rows: each one's command, run in its own process group under its own time limit."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import REPO, read_records, run_logged, train_command
from tpustream.observe import trace_gaps
from tpustream.observe.advice import mean_of, measured

# What the run measured about its own input, where its metrics.jsonl has it.
SHARES = ("input_bound_fraction", "input_wait_fraction", "input_making_share")
# Lines of a failed row's output kept in results.json.
TAIL_LINES = 30


@dataclass
class Row:
    """One line of the table: a run of train.py or of the stock loop."""

    name: str  # "synthetic", "tpustream w=8", "tpustream device w=4", "stock w=15"
    input: str  # "synthetic", "tpustream" or "stock"
    workers: int | None
    folder: Path  # the run folder: metrics.jsonl and output.log
    command: list[str]
    result: dict[str, Any] = field(default_factory=dict)


def train_overrides(args: Any, root: Path) -> list[str]:
    """train.py's settings shared by the synthetic and tpustream rows (the stock loop takes the same)."""
    return [
        f"accelerator={args.accelerator}",
        "data=imagenet",
        f"data.root={root}",
        f"model={args.model}",
        f"data.image_size={args.image_size}",
        f"batch_size={args.batch_size}",
        "precision=bf16",
        "accelerator.channels_last=true",
        "eval_every=0",  # only the training loop's rate is compared
    ]


def stock_command(args: Any, root: Path, workers: int, folder: Path, num_classes: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "bench.feed.stock",
        f"--shards={root / 'train'}",
        f"--out={folder}",
        f"--workers={workers}",
        f"--epochs={args.epochs}",
        f"--model={args.model}",
        f"--image-size={args.image_size}",
        f"--batch-size={args.batch_size}",
        f"--num-classes={num_classes}",
        "--precision=bf16",
        f"--accelerator={args.accelerator}",
    ]


def plan_rows(args: Any, root: Path, runs: Path, num_classes: int) -> list[Row]:
    """synthetic, tpustream per --workers, tpustream decoding on the device per --device-workers,
    then stock per --stock-workers, in the order they run."""
    common = train_overrides(args, root)
    if getattr(args, "trace_steps", None):
        common.append(f"debug.profile_steps=[{args.trace_steps[0]},{args.trace_steps[1]}]")
    rows = [
        Row(
            "synthetic",
            "synthetic",
            None,
            runs / "synthetic",
            train_command(REPO, runs / "synthetic", args.epochs, [*common, "data.synthetic=true"]),
        )
    ]
    variants = [("", [], workers) for workers in args.workers]
    variants += [(" device", ["data.decode=device"], workers) for workers in args.device_workers]
    for label, extra, workers in variants:
        folder = runs / f"tpustream{label.replace(' ', '-')}-w{workers}"
        overrides = [*common, *extra, f"data.num_workers={workers}"]
        rows.append(
            Row(
                f"tpustream{label} w={workers}",
                "tpustream",
                workers,
                folder,
                train_command(REPO, folder, args.epochs, overrides),
            )
        )
    for workers in args.stock_workers:
        folder = runs / f"stock-w{workers}"
        command = stock_command(args, root, workers, folder, num_classes)
        rows.append(Row(f"stock w={workers}", "stock", workers, folder, command))
    return rows


def summarise_run(records: list[dict]) -> dict[str, Any]:
    """The steady rate (epochs after the first; none with fewer than two) and the run's own input shares."""
    steady = measured(records) if len(records) > 1 else []
    return {
        "images_per_second": mean_of(steady, "global_rate"),
        "epoch_rates": [r.get("global_rate") for r in records],
        **{key: mean_of(steady, key) for key in SHARES},
    }


def run_row(row: Row, timeout: float) -> dict[str, Any]:
    """Run the row; its result (what it measured, even if it failed after some epochs)."""
    log_path = row.folder / "output.log"
    code, seconds = run_logged(row.command, log_path, timeout)
    # Nothing here reads train.py's last.pt (ResNet-50's: ~200 MB with its momentum a row).
    shutil.rmtree(row.folder / "checkpoints", ignore_errors=True)
    result: dict[str, Any] = {
        "exit_code": code,
        "seconds": seconds,
        **summarise_run(read_records(row.folder)),
    }
    tensorboard = row.folder / "tensorboard"
    traces = trace_gaps.find_traces(tensorboard) if tensorboard.is_dir() else []
    if traces:  # --trace-steps: where the traced steps' GPU time went
        result["trace_gaps"] = {
            str(trace.relative_to(row.folder)): trace_gaps.summarise(trace_gaps.load_events(trace))
            for trace in traces
        }
    if code != 0:
        result["error"] = "timed out" if code is None else f"exit code {code}"
        result["output_tail"] = log_path.read_text(errors="replace").splitlines()[-TAIL_LINES:]
    return result


def describe_result(row: Row) -> str:
    """The line printed as each row finishes."""
    result = row.result
    rate = result.get("images_per_second")
    measured_text = "no steady rate" if rate is None else f"{rate:.1f} images/s"
    error = f" ({result['error']}; {row.folder / 'output.log'})" if "error" in result else ""
    lines = [f"{row.name}: {measured_text} in {result['seconds']:.0f} s{error}"]
    lines += [trace_gaps.describe(f"  {name}", gaps) for name, gaps in result.get("trace_gaps", {}).items()]
    return "\n".join(lines)
