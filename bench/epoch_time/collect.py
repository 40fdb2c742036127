"""What a finished train.py run measured: its summary from metrics.jsonl; the finished runs below a folder."""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.epoch_time.plan import NOT_SET, SWITCHES, RunSpec, Switch

if TYPE_CHECKING:  # imported where used: it imports torch, which must not load before a measurement
    from tpustream.training.epoch_report import EpochRecord

HORIZONS = (10, 20, 50, 100, 200, 500, 1000, 2000)
# What torch_xla prints when a persistent cache entry cannot be used (XLA:CPU
# in torch_xla 2.9 cannot deserialize executables, so its cache never hits).
DESERIALIZE_FAILURE = "Failed to deserialize executable"


def epoch_seconds(record: EpochRecord) -> float:
    if record.epoch_seconds is not None:
        return record.epoch_seconds
    return record.train_seconds + (record.val_seconds or 0.0)


def project_total(setup: float, epoch1: float, mean: float, epochs: int) -> float:
    """The seed's projection of a whole run: set-up + epoch 1 + mean(epochs 2+) * (N - 1)."""
    if epochs < 1:
        raise ValueError(f"epochs must be at least 1, not {epochs}")
    return setup + epoch1 + (mean * (epochs - 1) if epochs > 1 else 0.0)


def summarize(
    records: Sequence[EpochRecord], process_seconds: float | None = None, launched_at: float | None = None
) -> dict[str, Any]:
    """Set-up, epoch 1, mean/std of epochs 2+, samples/s, compilations from metrics.jsonl records.

    process_seconds (the run's wall time) and launched_at (time.time() when it
    was started) are for measuring set-up when train.py does not report it.
    """
    if not records:
        raise ValueError("no epochs in metrics.jsonl")
    records = sorted(records, key=lambda r: r.epoch)
    times = [epoch_seconds(r) for r in records]
    later = times[1:]
    if records[0].setup_seconds is not None:
        setup, setup_method = records[0].setup_seconds, "reported"
    elif launched_at is not None:
        setup, setup_method = records[0].wall_time - times[0] - launched_at, "wall_time"
    elif process_seconds is not None:
        setup, setup_method = process_seconds - sum(times), "process"
    else:
        setup, setup_method = math.nan, "unknown"
    train_samples = sum(r.train_samples for r in records[1:])
    train_seconds = sum(r.train_seconds for r in records[1:])
    mean = statistics.fmean(later) if later else math.nan
    summary = {
        "epochs": len(records),
        "setup_s": setup,
        "setup_method": setup_method,
        "epoch1_s": times[0],
        "mean_s": mean,
        "std_s": statistics.stdev(later) if len(later) >= 2 else math.nan,
        "epoch_time_method": (
            "epoch_seconds" if all(r.epoch_seconds is not None for r in records) else "train+val"
        ),
        "samples_per_s": train_samples / train_seconds if later and train_seconds > 0 else math.nan,
        "compilations": records[-1].compilations,
        "compilations_epoch1": records[0].compilations,
        "process_s": math.nan if process_seconds is None else process_seconds,
        "overhead_s": math.nan if process_seconds is None else process_seconds - setup - sum(times),
        "epoch_seconds": times,
    }
    for n in HORIZONS:
        summary[f"total_{n}_s"] = project_total(setup, times[0], mean, n)
    return summary


@dataclass
class RunResult:
    spec: RunSpec
    command: list[str]
    folder: Path
    returncode: int | None = None  # None: timed out
    error: str = ""  # why the run counts as failed ("" = it did not)
    stderr_tail: str = ""
    stdout_tail: str = ""  # Hydra's log handler writes train.py's errors to stdout
    summary: dict[str, Any] = field(default_factory=dict)
    other_load: float = math.nan
    cpu_s: float = math.nan
    deserialize_failures: int = 0

    @property
    def ok(self) -> bool:
        return not self.error


def setting_of(switch: Switch, cfg: Any) -> str:
    """Which setting of switch a run's resolved config has: its name, or NOT_SET for neither."""
    from omegaconf import OmegaConf

    for setting in (switch.baseline, switch.flipped):
        values = [override.split("=", 1) for override in setting.overrides]
        if all(str(OmegaConf.select(cfg, key)).lower() == value.lower() for key, value in values):
            return setting.name
    return NOT_SET


def collect_runs(folders: Sequence[Path]) -> tuple[list[RunResult], Any]:
    """Finished train.py runs below folders, one RunResult each, and the first run's config.

    A run is a folder with Hydra's .hydra/config.yaml, as every train.py run
    leaves, for instance each job of a multirun sweep
    (`python train.py -m batch_size=32,64,128 eval_every=0,1`). Its
    metrics.jsonl is read from the run folder, or from its output_dir when
    that was set to another place (a bucket). The switches whose setting
    differs between the runs label them, as in a sweep of this harness.
    """
    from omegaconf import OmegaConf

    from tpustream.errors import TpustreamError
    from tpustream.training.epoch_report import read_epoch_records

    jobs = sorted({path.parent.parent for folder in folders for path in folder.rglob(".hydra/config.yaml")})
    if not jobs:
        raise SystemExit(f"no train.py runs (.hydra/config.yaml) below {', '.join(map(str, folders))}")
    loaded = []
    for job in jobs:
        cfg = OmegaConf.load(job / ".hydra" / "config.yaml")
        overrides_file = job / ".hydra" / "overrides.yaml"
        overrides = [str(o) for o in OmegaConf.load(overrides_file)] if overrides_file.exists() else []
        output_dir = OmegaConf.to_container(cfg, resolve=False).get("output_dir")
        # ${hydra:runtime.output_dir} (the default) is the job folder itself.
        run_folder = str(job) if not output_dir or "${" in str(output_dir) else str(output_dir)
        loaded.append((job, cfg, overrides, run_folder))
    labels = {name: [setting_of(switch, cfg) for _, cfg, _, _ in loaded] for name, switch in SWITCHES.items()}
    varied = [name for name in SWITCHES if len(set(labels[name])) > 1]
    results = []
    common = os.path.commonpath([str(job) for job in jobs]) if len(jobs) > 1 else str(jobs[0].parent)
    for index, (job, cfg, overrides, run_folder) in enumerate(loaded):
        settings = tuple((name, labels[name][index]) for name in varied)
        name = os.path.relpath(job, common)
        spec = RunSpec(name, int(cfg.batch_size), settings, "off", tuple(overrides))
        result = RunResult(spec, ["python", "train.py", *overrides], job, returncode=0)
        try:
            records = read_epoch_records(run_folder)
        except TpustreamError as exc:  # an unreachable bucket: the run is reported, not the sweep
            records, result.error = [], f"no metrics: {exc}"
        if records:
            result.summary = summarize(records)
        elif not result.error:
            result.error = f"no metrics.jsonl lines in {run_folder}"
        stderr = job / "train.log"  # Hydra's job log: train.py's own lines
        result.deserialize_failures = (
            stderr.read_text(errors="replace").count(DESERIALIZE_FAILURE) if stderr.exists() else 0
        )
        results.append(result)
    return results, loaded[0][1]
