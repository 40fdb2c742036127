"""tpustream-report RUN_DIR... : a run's epochs as a table, what to change, and its curves as a PNG.

Reads metrics.jsonl (and config.yaml) from local or gs:// run folders, so it
works on finished, running and preempted runs alike. One folder: a row per
epoch, the advice, and report.png beside it. Several folders, or a Hydra
multirun folder (numbered job folders whose .hydra/ names each job's
output_dir and overrides): a row per run with the config values that differ
between them, and one plot of all their curves.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from tpustream import storage
from tpustream.config.keys import facts_of, flatten
from tpustream.observe.advice import SavingSettings, advise, advise_runs, mean_of, measured, process_epochs
from tpustream.observe.best import best_record, describe_best, select_best_of
from tpustream.observe.runs import Run, find_runs
from tpustream.observe.synthetic_rate import describe_synthetic, is_synthetic, synthetic_twin_rate

__all__ = ["Run", "find_runs", "main", "report"]


def differing(runs: Sequence[Run]) -> list[str]:
    """Config keys whose values differ between runs (the run's own folders aside: they always do)."""
    flats = [flatten(run.config) for run in runs]
    keys = sorted(key for key in set().union(*flats) if not facts_of(key).per_run)
    return [key for key in keys if len({repr(flat.get(key)) for flat in flats}) > 1]


def percent(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def has_average(runs: Sequence[Run]) -> bool:
    """Whether any run evaluated a weight average (ema.decay): its columns are shown then."""
    return any(r.get("ema_val_accuracy") is not None for run in runs for r in run.records)


def compiles_per_epoch(records: Sequence[Mapping[str, Any]]) -> list[int | None]:
    """Graphs compiled in each epoch, from `compilations`: each process's running total since it started.

    A resumed run's process counts from 0 again; its first epoch's compiles
    are the process's whole total (observe.advice.process_epochs tells the
    processes apart).
    """
    return [epoch.compiles for epoch in process_epochs(records)]


# The note after a row a resumed process trained or ended first, and what it means under the table.
RESUMED = "resumed"
RESUMED_NOTE = (
    f"{RESUMED}: the first epoch a resumed process trained or ended; its samples/s and compiles "
    "include that process's start (its graphs compiled, its loaders started): the advice leaves it out"
)


def of_synthetic(rate: float | None, synthetic_rate: float | None) -> str:
    """A rate as a share of its synthetic twin's (the device's own rate for the same step)."""
    return "-" if rate is None or not synthetic_rate else f"{rate / synthetic_rate:.2f}"


def epoch_table(run: Run, synthetic_rate: float | None = None) -> str:
    """A row per epoch; the weight average's accuracy beside the raw one's where the run has one.

    synthetic_rate: its synthetic twin's steady rate, for each epoch's share of it ("of synth.").
    """
    average = has_average([run])
    columns = [("epoch", 5), ("acc", 7), *([("ema acc", 7)] if average else []), ("top5", 7), ("loss", 8)]
    # input-bound: the device idle for want of input; host wait: the training thread waiting for a batch.
    columns += [("samples/s", 10), *([("of synth.", 9)] if synthetic_rate else [])]
    columns += [("input-bound", 11), ("host wait", 9), ("MFU", 6)]
    lines = [" ".join(f"{name:>{width}}" for name, width in columns) + " compiles"]
    epochs = process_epochs(run.records)
    # Epoch 0 always starts a process (the run's); a later epoch that did was resumed in (advice.measured).
    resumed = [index > 0 and (e.started or e.process_start) for index, e in enumerate(epochs)]
    for r, epoch, note in zip(run.records, epochs, resumed, strict=True):
        compiles = epoch.compiles
        loss = f"{r['val_loss']:.4f}" if r.get("val_loss") is not None else "-"
        ema = f" {percent(r.get('ema_val_accuracy')):>7}" if average else ""
        share = f" {of_synthetic(r.get('global_rate'), synthetic_rate):>9}" if synthetic_rate else ""
        lines.append(
            f"{r['epoch']:>5} {percent(r.get('val_accuracy')):>7}{ema} {percent(r.get('val_top5')):>7} "
            f"{loss:>8} {r.get('global_rate', 0):>10.1f}{share} {percent(r.get('input_bound_fraction')):>11} "
            f"{percent(r.get('input_wait_fraction')):>9} "
            f"{percent(r.get('mfu')):>6} {'-' if compiles is None else compiles:>8}"
            + (f" {RESUMED}" if note else "")
        )
    if any(resumed):
        lines.append(RESUMED_NOTE)
    select_best = select_best_of(run.config)
    best = best_record(run.records, select_best)
    if best is not None:
        lines.append(f"best.pt: validation accuracy {describe_best(best, select_best)}")
    if is_synthetic(run.records):  # no accuracy: its rate is the yardstick for real runs of its config
        lines.append(f"{describe_synthetic(run.records)} (data.synthetic: one batch on the device, no data)")
    return "\n".join(lines)


def comparison_table(runs: Sequence[Run], twins: Mapping[str, float | None] | None = None) -> str:
    """A row per run: the accuracy of the epoch its best.pt holds, its speed, what differs.

    Where a run has a weight average: the average's accuracy in that epoch
    beside the raw weights', and the epoch with the weights its ema.select_best
    chose it by.
    """
    keys = differing(runs)
    average = has_average(runs)
    twins = {name: rate for name, rate in (twins or {}).items() if rate}
    ema_header = f" {'ema acc':>8} {'best.pt':>8}" if average else ""
    synth_header = f" {'of synth.':>9}" if twins else ""
    lines = [
        f"{'run':<24} {'best acc':>8}{ema_header} {'samples/s':>10}{synth_header} {'input-bound':>11} "
        f"{'host wait':>9} {'epochs':>6}  differs"
    ]
    for run in runs:
        steady = measured(run.records)
        select_best = select_best_of(run.config)
        best = best_record(run.records, select_best) or {}
        rate = mean_of(steady, "global_rate")
        wait, bound = mean_of(steady, "input_wait_fraction"), mean_of(steady, "input_bound_fraction")
        flat = flatten(run.config)
        overrides = " ".join(f"{key}={flat.get(key)}" for key in keys)
        rate_text = "-" if rate is None else f"{rate:.1f}"
        chosen = f"{best['epoch']} {select_best.value}" if best else "-"
        ema = f" {percent(best.get('ema_val_accuracy')):>8} {chosen:>8}" if average else ""
        accuracy = "synth." if is_synthetic(run.records) else percent(best.get("val_accuracy"))
        share = f" {of_synthetic(rate, twins.get(run.name)):>9}" if twins else ""
        lines.append(
            f"{run.name[:24]:<24} {accuracy:>8}{ema} {rate_text:>10}{share} "
            f"{percent(bound):>11} {percent(wait):>9} {len(run.records):>6}  {overrides}"
        )
    return "\n".join(lines)


def plot(runs: Sequence[Run], url: str) -> None:
    """Validation accuracy and training loss per epoch, every run in one figure, as a PNG at url."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (accuracy, loss) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        epochs = [r["epoch"] for r in run.records]
        evaluated = [
            (r["epoch"], r["val_accuracy"]) for r in run.records if r.get("val_accuracy") is not None
        ]
        if evaluated:
            (line,) = accuracy.plot(*zip(*evaluated, strict=True), marker="o", label=run.name)
            averaged = [
                (r["epoch"], r["ema_val_accuracy"])
                for r in run.records
                if r.get("ema_val_accuracy") is not None
            ]
            if averaged:  # the weight average's curve, dashed in its run's colour
                label, colour = f"{run.name} ema", line.get_color()
                accuracy.plot(*zip(*averaged, strict=True), linestyle="--", color=colour, label=label)
        loss.plot(epochs, [r["train_loss"] for r in run.records], marker="o", label=run.name)
    accuracy.set(xlabel="epoch", ylabel="validation accuracy", title="accuracy")
    loss.set(xlabel="epoch", ylabel="training loss", title="loss")
    for axes in (accuracy, loss):
        axes.grid(alpha=0.3)
    accuracy.legend(fontsize="small")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    storage.write_bytes(url, buffer.getvalue())


def report(urls: Sequence[str], plot_url: str | None, draw: bool = True) -> str:
    runs = [run for url in urls for run in find_runs(url)]
    pairs = [(run.config, run.records) for run in runs]
    # A real run given with its synthetic twin (data.synthetic, the same step): its share of that rate.
    twins = {
        run.name: synthetic_twin_rate(run.config, pairs) for run in runs if not is_synthetic(run.records)
    }
    real = [run for run in runs if not is_synthetic(run.records)]
    if len(runs) == 1 or (len(real) == 1 and twins[real[0].name] is not None):
        (run,) = real or runs
        synthetic_rate = twins.get(run.name)
        config = run.config.get("data", {})
        findings = advise(
            run.records,
            config.get("num_workers"),
            synthetic_rate=synthetic_rate,
            saving=SavingSettings.from_config(run.config),
        )
        table = run.records and epoch_table(run, synthetic_rate)
        text = "\n".join(part for part in (run.url, table, run.note) if part)
        if synthetic_rate:
            text += f"\nof synth.: the epoch's rate over its synthetic twin's {synthetic_rate:.1f} samples/s"
        if findings:
            text += "\n" + "\n".join(f"advice: {finding}" for finding in findings)
        target = plot_url or storage.join(run.url, "report.png")
    else:
        text = comparison_table(runs, twins)
        text += "".join(f"\n{run.name}: {run.note}" for run in runs if run.note)
        synthetic = [run.name for run in runs if is_synthetic(run.records)]
        if synthetic:
            text += f"\nsynth.: data.synthetic ({', '.join(synthetic)}): the accelerator's rate without input"
        findings = advise_runs([(flatten(run.config), run.records) for run in runs])
        text += "".join(f"\nadvice: {finding}" for finding in findings)
        target = plot_url or "tpustream-report.png"
    if draw and any(run.records for run in runs):
        plot(runs, target)
        text += f"\ncurves: {target}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpustream-report", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders (local or gs://) or a Hydra multirun folder")
    parser.add_argument("--plot", default=None, help="where the PNG goes (default: beside the run, or ./)")
    parser.add_argument("--no-plot", action="store_true", help="the tables only")
    args = parser.parse_args(argv)
    try:
        print(report(args.runs, args.plot, draw=not args.no_plot))
    except FileNotFoundError as exc:
        print(f"tpustream-report: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
