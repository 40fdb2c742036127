"""Time per epoch of real training runs: batch size, validation, augmentation, data source, workers.

Reproduce (from the repository root):

    # the CPU sweep of bench/EPOCH_TIME.md (small_cnn on digits; about 11 minutes on 2 cores)
    python scripts/make_shards.py digits data/digits
    .venv/bin/python bench/epoch_time.py --batch-sizes 32 64 128 256 --epochs 4 --cold-warm 128
    # the seed experiment on one TPU VM host (see bench/EPOCH_TIME.md for the full command)
    python bench/epoch_time.py --batch-sizes 8 16 32 64 128 256 512 --epochs 5 -- \\
        model=wrn_seed data=cifar100 data.root=gs://BUCKET/cifar100 accelerator=tpu precision=bf16
    # print the plan and the commands, run nothing
    .venv/bin/python bench/epoch_time.py --batch-sizes 32 64 --dry-run -- model=small_cnn
    # or sweep with Hydra's multirun and report the finished runs the same way
    python train.py -m batch_size=32,64,128 eval_every=1,0 epochs=4 hydra.sweep.dir=multirun/bs
    .venv/bin/python bench/epoch_time.py --collect multirun/bs

Every run is `python train.py <overrides>`, the command users run, in its own
process: the overrides after `--` (any Hydra override of conf/), then
`epochs=`, `batch_size=`, the settings of the run's switches, the compile
cache key, and `output_dir=<run folder> resume=null hydra.run.dir=<run folder>`.
The harness is the sweep: do not pass `-m`/`--multirun`, and do not set the keys
it sets itself (it refuses, naming the key). Every run's overrides are composed
with Hydra before the first run starts, so a typo costs a second, not a sweep.
--collect DIR instead reports runs that train.py made elsewhere (a Hydra
multirun, runs on a TPU host): every folder below DIR with .hydra/config.yaml,
labelled by the switches whose settings differ between them.

Switches (a run is the base overrides + a batch size + one combination):

    validation     on: eval_every=1                          off: eval_every=0
    augmentation   on: data.crop_padding=4 data.hflip=true   off: data.crop_padding=0 data.hflip=false
    source         shards: data.in_memory=false              memory: data.in_memory=true
    workers        4: data.num_workers=4                     1: data.num_workers=1

The first setting of each is the baseline. By default each batch size gets the
baseline and one run per switch flipped; --full runs the whole cross product.
--switches limits the switches; those left out are not set at all (the config
and the overrides decide). Sweep runs set the compile cache key to null (the
tpu accelerator config enables a persistent cache, which would make every run
after the first one with the same graphs start warm). --cold-warm B runs the
baseline at batch size B twice more with a fresh cache folder: cold, then warm.

What is measured, from <run folder>/metrics.jsonl (one line per epoch):

    epoch time     epoch_seconds (training + validation of the epoch), or, when
                   train.py does not write it, train_seconds + val_seconds.
    set-up         setup_seconds (train.py: process start to the first training
                   step); else the first line's wall_time minus its epoch time
                   minus the moment the harness started the process ("wall_time");
                   else process wall time minus all epoch times ("process").
                   The column setup_method says which.
    epoch 1        the first epoch: it compiles the train (and eval) graphs.
    mean, std      over epochs 2+ (std with n-1; NaN with fewer than 2 such epochs).
    samples/s      training samples per training second over epochs 2+ (all replicas).
    compilations   the master replica's XLA compile count after the last epoch
                   (compilations_epoch1: after the first).
    total N        the seed's projection: set-up + epoch 1 + mean * (N - 1).
    overhead       process wall time - set-up - all epochs: checkpoints, teardown.
    other load     CPU cores that programs other than this run used meanwhile
                   (on a shared machine, anything above ~0.1 slows the run down).

Outputs in --out (default bench/results/epoch_time/<model>-<data>-<device>):
runs.csv (one row per run), table.md (the seed's layout), epoch_time.png
(epoch time vs batch size, linear and log), ratios.png (switched / baseline
per switch vs batch size), sweep.json (command, environment, settings) and
runs/<run>/ (stdout.log, stderr.log, Hydra's logs, metrics.jsonl; checkpoints
are deleted unless --keep-checkpoints). A failed run is reported with its
command and the tail of its stderr; the sweep goes on and exits 1 at the end.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import itertools
import json
import math
import os
import platform
import re
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: it imports torch, which must not load before a measurement
    from tpustream.training.report import EpochRecord

REPO = Path(__file__).resolve().parent.parent
HORIZONS = (10, 20, 50, 100, 200, 500, 1000, 2000)
DEFAULT_EPOCHS = 5
STDERR_TAIL_LINES = 25
STDOUT_TAIL_LINES = 10
# What torch_xla prints when a persistent cache entry cannot be used (XLA:CPU
# in torch_xla 2.9 cannot deserialize executables, so its cache never hits).
DESERIALIZE_FAILURE = "Failed to deserialize executable"


# ------------------------------------------------------------------- switches


@dataclass(frozen=True)
class Setting:
    name: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Switch:
    """Two settings of the same keys; the first is the baseline."""

    name: str
    baseline: Setting
    flipped: Setting

    @property
    def keys(self) -> set[str]:
        return {override_key(o) for o in self.baseline.overrides + self.flipped.overrides}

    def setting(self, name: str) -> Setting:
        return self.baseline if name == self.baseline.name else self.flipped


SWITCHES = {
    s.name: s
    for s in (
        Switch("validation", Setting("on", ("eval_every=1",)), Setting("off", ("eval_every=0",))),
        Switch(
            "augmentation",
            Setting("on", ("data.crop_padding=4", "data.hflip=true")),
            Setting("off", ("data.crop_padding=0", "data.hflip=false")),
        ),
        Switch(
            "source",
            Setting("shards", ("data.in_memory=false",)),
            Setting("memory", ("data.in_memory=true",)),
        ),
        Switch("workers", Setting("4", ("data.num_workers=4",)), Setting("1", ("data.num_workers=1",))),
    )
}
# Written for a switch the sweep does not vary: the config decides.
NOT_SET = "config"


def override_key(override: str) -> str:
    """'data.num_workers=4' -> 'data.num_workers'; '+foo=1' / '~foo' -> 'foo'."""
    return override.split("=", 1)[0].lstrip("+~")


def cache_key() -> str:
    """The config key of the persistent XLA compile cache (checked against the schema)."""
    from tpustream.config import TrainConfig

    if "xla_cache_dir" not in TrainConfig.__dataclass_fields__:
        raise SystemExit("found no XLA compile cache key in tpustream.config (xla_cache_dir)")
    return "xla_cache_dir"


# ----------------------------------------------------------------------- plan


@dataclass(frozen=True)
class RunSpec:
    """One train.py run of the sweep."""

    name: str  # folder name under runs/
    batch_size: int
    settings: tuple[tuple[str, str], ...]  # (switch, setting) for the switches varied
    cache: str  # "off" (key set to null), "cold" or "warm"
    overrides: tuple[str, ...]  # everything but the run folder keys

    @property
    def label(self) -> str:
        """The configuration without the batch size: 'baseline', 'validation off', ..."""
        flipped = [f"{s} {v}" for s, v in self.settings if v != SWITCHES[s].baseline.name]
        text = ", ".join(flipped) or "baseline"
        return text if self.cache == "off" else f"{text}, compile cache {self.cache}"

    def setting(self, switch: str) -> str:
        return dict(self.settings).get(switch, NOT_SET)


def combinations(switches: Sequence[str], full: bool) -> list[tuple[tuple[str, str], ...]]:
    """Baseline first; then one switch flipped at a time, or (full) every combination."""
    baseline = tuple((s, SWITCHES[s].baseline.name) for s in switches)
    if full:
        choices = [(SWITCHES[s].baseline.name, SWITCHES[s].flipped.name) for s in switches]
        return [tuple(zip(switches, values, strict=True)) for values in itertools.product(*choices)]
    flips = [tuple((t, SWITCHES[t].flipped.name if t == s else v) for t, v in baseline) for s in switches]
    return [baseline, *flips]


def reserved_keys(cache: str) -> set[str]:
    return {"epochs", "batch_size", "output_dir", "resume", "hydra.run.dir", cache}


def check_extra_overrides(extra: Sequence[str], switches: Sequence[str], cache: str) -> None:
    """Refuse overrides that the harness sets itself or that a varied switch controls."""
    for override in extra:
        if override.startswith("-"):
            raise SystemExit(
                f"{override!r}: the harness runs the sweep itself; pass Hydra overrides "
                "(key=value) after --, and batch sizes with --batch-sizes"
            )
        if "=" not in override and not override.startswith("~"):
            raise SystemExit(f"{override!r} is not a Hydra override (key=value)")
        key = override_key(override)
        if key in reserved_keys(cache):
            raise SystemExit(f"{override!r}: the harness sets {key} itself; drop it from the overrides")
        for name in switches:
            if key in SWITCHES[name].keys:
                raise SystemExit(
                    f"{override!r}: {key} belongs to the switch {name!r}, which the sweep varies; "
                    f"leave {name!r} out of --switches to set it yourself"
                )


def build_plan(
    batch_sizes: Sequence[int],
    switches: Sequence[str],
    *,
    epochs: int,
    extra: Sequence[str] = (),
    full: bool = False,
    cold_warm: Sequence[int] = (),
    cache: str = "xla_cache_dir",
    cache_root: Path | None = None,
) -> list[RunSpec]:
    """Every run of the sweep, in order: per batch size the combinations, then cold/warm pairs."""
    check_extra_overrides(extra, switches, cache)
    runs = []

    def add(batch: int, settings: tuple[tuple[str, str], ...], mode: str, cache_value: str) -> None:
        flipped = [f"{s}-{v}" for s, v in settings if v != SWITCHES[s].baseline.name]
        name = f"bs{batch}-" + ("-".join(flipped) or "baseline")
        if mode != "off":
            name += f"-cache-{mode}"
        switch_overrides = [o for s, v in settings for o in SWITCHES[s].setting(v).overrides]
        overrides = (
            *extra,
            f"epochs={epochs}",
            f"batch_size={batch}",
            *switch_overrides,
            f"{cache}={cache_value}",
        )
        runs.append(RunSpec(name, batch, settings, mode, overrides))

    for batch in batch_sizes:
        for settings in combinations(switches, full):
            add(batch, settings, "off", "null")
    for batch in cold_warm:
        folder = (cache_root or Path("xla-cache")) / f"bs{batch}"
        for mode in ("cold", "warm"):
            add(batch, combinations(switches, False)[0], mode, str(folder))
    return runs


def check_with_hydra(runs: Sequence[RunSpec]) -> Any:
    """Compose every distinct override list as train.py would; return the first config.

    A key that does not exist (yet) in conf/ fails here, naming the run,
    before anything is started.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tpustream.config import register_configs

    register_configs()
    first, seen = None, set()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for run in runs:
            overrides = tuple(
                o for o in run.overrides if not override_key(o).startswith(("hydra.", "hydra/"))
            )
            if overrides in seen:
                continue
            seen.add(overrides)
            try:
                cfg = compose(
                    config_name="config", overrides=["output_dir=/unused", "log_dir=null", *overrides]
                )
            except Exception as exc:  # Hydra raises several types; all mean "train.py would refuse"
                missing = re.search(r"Could not override '([^']+)'", str(exc))
                owners = [s for s in SWITCHES.values() if missing and missing[1] in s.keys]
                hint = (
                    f"; this checkout has no {missing[1]}: leave the switch {owners[0].name!r} "
                    "out of --switches to sweep without it"
                    if owners
                    else ""
                )
                raise SystemExit(
                    f"train.py would refuse run {run.name} ({' '.join(overrides)}): {exc}{hint}"
                ) from None
            first = first if first is not None else cfg
    GlobalHydra.instance().clear()
    return first


def default_name(cfg: Any) -> str:
    return f"{cfg.model.name}-{cfg.data.name}-{str(cfg.accelerator.device).split('.')[-1].lower()}"


# ---------------------------------------------------------------- statistics


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


# ------------------------------------------------------------------- running


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


def train_command(spec: RunSpec, folder: Path) -> list[str]:
    return [
        sys.executable,
        str(REPO / "train.py"),
        *spec.overrides,
        f"output_dir={folder}",
        "resume=null",
        f"hydra.run.dir={folder}",
    ]


def busy_cpu_seconds() -> float:
    """CPU seconds all programs on this machine have used (for the other-load column)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - t.iowait - t.guest - t.guest_nice  # guest time is also in user


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def tail(path: Path, lines: int = STDERR_TAIL_LINES) -> str:
    if not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def run_one(spec: RunSpec, folder: Path, timeout: float | None, keep_checkpoints: bool) -> RunResult:
    """Run train.py once in its own session; measure it; never raise for a failed run."""
    if folder.exists():
        shutil.rmtree(folder)  # a stale metrics.jsonl would pass for this run's
    folder.mkdir(parents=True)
    result = RunResult(spec, train_command(spec, folder), folder)
    (folder / "command.txt").write_text(shlex.join(result.command) + "\n")
    busy0, ours0 = busy_cpu_seconds(), children_cpu_seconds()
    with open(folder / "stdout.log", "wb") as out, open(folder / "stderr.log", "wb") as err:
        launched_at, start = time.time(), time.perf_counter()
        # Own session: a timeout or Ctrl-C stops train.py and its replicas and workers together.
        process = subprocess.Popen(result.command, stdout=out, stderr=err, cwd=REPO, start_new_session=True)
        try:
            result.returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except BaseException:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise
        process_seconds = time.perf_counter() - start
    result.cpu_s = children_cpu_seconds() - ours0
    result.other_load = max(0.0, busy_cpu_seconds() - busy0 - result.cpu_s) / process_seconds
    stderr = folder / "stderr.log"
    result.stderr_tail = tail(stderr)
    result.stdout_tail = tail(folder / "stdout.log", STDOUT_TAIL_LINES)
    result.deserialize_failures = stderr.read_text(errors="replace").count(DESERIALIZE_FAILURE)
    from tpustream.training.report import read_epoch_records  # after the measurements: it imports torch

    records = read_epoch_records(str(folder))
    if result.returncode is None:
        result.error = f"timed out after {timeout:g} s"
    elif result.returncode != 0:
        result.error = f"exit code {result.returncode}"
    elif not records:
        result.error = "exit code 0 but no metrics.jsonl lines"
    if records:
        result.summary = summarize(records, process_seconds, launched_at)
    if not keep_checkpoints:
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)
    return result


# ------------------------------------------------------------------- collect


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
    from tpustream.training.report import read_epoch_records

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


# -------------------------------------------------------------------- report


def format_duration(seconds: float) -> str:
    """12.3s, 4m 05s, 1h 02m, 2d 03h; 'n/a' for NaN."""
    if seconds is None or math.isnan(seconds):
        return "n/a"
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds < 59.95:
        return f"{seconds:.1f}s"
    if round(seconds) < 3600:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes}m {rest:02d}s"
    if round(seconds / 60) < 24 * 60:
        hours, minutes = divmod(round(seconds / 60), 60)
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(round(seconds / 3600), 24)
    return f"{days}d {hours:02d}h"


def format_mean(mean: float, std: float) -> str:
    if math.isnan(std):
        return format_duration(mean)
    return f"{format_duration(mean)} ± {format_duration(std)}"


CSV_COLUMNS = [
    "name",
    "batch_size",
    *SWITCHES,
    "cache",
    "status",
    "epochs",
    "setup_s",
    "setup_method",
    "epoch1_s",
    "mean_s",
    "std_s",
    "epoch_time_method",
    "samples_per_s",
    "compilations",
    "compilations_epoch1",
    *(f"total_{n}_s" for n in HORIZONS),
    "process_s",
    "overhead_s",
    "cpu_s",
    "other_load_cores",
    "deserialize_failures",
    "epoch_seconds",
    "command",
]


def csv_value(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list):
        return ";".join(f"{v:.3f}" for v in value)
    return str(value)


def csv_row(result: RunResult) -> dict[str, str]:
    spec = result.spec
    row: dict[str, Any] = {
        "name": spec.name,
        "batch_size": spec.batch_size,
        **{s: spec.setting(s) for s in SWITCHES},
        "cache": spec.cache,
        "status": "ok" if result.ok else f"failed: {result.error}",
        **{k: v for k, v in result.summary.items() if k in CSV_COLUMNS},
        "cpu_s": result.cpu_s,
        "other_load_cores": result.other_load,
        "deserialize_failures": result.deserialize_failures,
        "command": shlex.join(result.command),
    }
    return {column: csv_value(row.get(column)) for column in CSV_COLUMNS}


def write_csv(results: Iterable[RunResult], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        writer.writerows(csv_row(r) for r in results)


TABLE_HEADER = ["configuration", "set-up", "epoch 1", "mean epoch (2+)", *(f"{n} epochs" for n in HORIZONS)]


def table_row(label: str, summary: dict[str, Any]) -> str:
    cells = [
        label,
        format_duration(summary["setup_s"]),
        format_duration(summary["epoch1_s"]),
        format_mean(summary["mean_s"], summary["std_s"]),
        *(format_duration(summary[f"total_{n}_s"]) for n in HORIZONS),
    ]
    return "| " + " | ".join(cells) + " |"


def markdown_table(results: Sequence[RunResult]) -> str:
    lines = [
        "| " + " | ".join(TABLE_HEADER) + " |",
        "| --- | " + " | ".join("---:" for _ in TABLE_HEADER[1:]) + " |",
    ]
    for r in results:
        label = f"batch {r.spec.batch_size}, {r.spec.label}"
        if r.ok:
            lines.append(table_row(label, r.summary))
        else:
            lines.append(
                "| " + " | ".join([label, f"failed ({r.error})", *[""] * (len(TABLE_HEADER) - 2)]) + " |"
            )
    return "\n".join(lines)


def cache_table(results: Sequence[RunResult]) -> str:
    """Cold against warm compile cache, per batch size, from the runs with cache cold/warm."""
    pairs: dict[int, dict[str, RunResult]] = {}
    for r in results:
        if r.spec.cache in ("cold", "warm"):
            pairs.setdefault(r.spec.batch_size, {})[r.spec.cache] = r
    lines = [
        "| configuration | epoch 1, cold | epoch 1, warm | warm / cold | set-up, cold | set-up, warm "
        "| compilations cold / warm | cache entries unusable (warm) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for batch, pair in pairs.items():
        cold, warm = pair.get("cold"), pair.get("warm")
        if not (cold and warm and cold.ok and warm.ok):
            lines.append(f"| batch {batch}, baseline | failed | | | | | | |")
            continue
        c, w = cold.summary, warm.summary
        lines.append(
            f"| batch {batch}, baseline "
            f"| {format_duration(c['epoch1_s'])} | {format_duration(w['epoch1_s'])} "
            f"| {w['epoch1_s'] / c['epoch1_s']:.2f} | {format_duration(c['setup_s'])} "
            f"| {format_duration(w['setup_s'])} | {c['compilations']} / {w['compilations']} "
            f"| {warm.deserialize_failures} |"
        )
    return "\n".join(lines)


def failure_report(result: RunResult) -> str:
    lines = [
        f"run {result.spec.name} failed ({result.error})",
        f"  command: {shlex.join(result.command)}",
        f"  logs: {result.folder}/stdout.log, stderr.log",
    ]
    for stream, text, count in (
        ("stderr", result.stderr_tail, STDERR_TAIL_LINES),
        ("stdout", result.stdout_tail, STDOUT_TAIL_LINES),
    ):
        if text.strip():
            lines.append(f"  {stream} (last {count} lines):")
            lines.extend(f"    {line}" for line in text.splitlines())
        else:
            lines.append(f"  {stream}: empty")
    return "\n".join(lines)


def write_table(results: Sequence[RunResult], path: Path, title: str, notes: Sequence[str]) -> None:
    sweep = [r for r in results if r.spec.cache == "off"]
    cached = [r for r in results if r.spec.cache != "off"]
    out = io.StringIO()
    out.write(f"# {title}\n\n")
    for note in notes:
        out.write(f"{note}\n")
    out.write(
        "\nTotals for N epochs are the seed's projection: set-up + epoch 1 + mean epoch (2+) x (N - 1). "
        "Mean epoch: mean ± standard deviation over epochs 2+.\n\n"
    )
    out.write(markdown_table(sweep) + "\n")
    if cached:
        out.write("\n## Compile cache: the baseline twice with a fresh cache folder\n\n")
        out.write(cache_table(cached) + "\n")
    failed = [r for r in results if not r.ok]
    if failed:
        out.write("\n## Failed runs\n\n")
        for r in failed:
            out.write(f"```\n{failure_report(r)}\n```\n")
    path.write_text(out.getvalue())


def ratios(results: Sequence[RunResult], key: str = "mean_s") -> dict[str, dict[int, float]]:
    """switch -> batch size -> (run with only that switch flipped)[key] / baseline[key]."""
    base = {
        r.spec.batch_size: r for r in results if r.ok and r.spec.cache == "off" and r.spec.label == "baseline"
    }
    out: dict[str, dict[int, float]] = {}
    for r in results:
        if not r.ok or r.spec.cache != "off" or r.spec.batch_size not in base:
            continue
        flipped = [s for s, v in r.spec.settings if v != SWITCHES[s].baseline.name]
        if len(flipped) == 1:
            denominator = base[r.spec.batch_size].summary[key]
            out.setdefault(r.spec.label, {})[r.spec.batch_size] = r.summary[key] / denominator
    return out


def plot(results: Sequence[RunResult], folder: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    sweep = [r for r in results if r.ok and r.spec.cache == "off"]
    labels = list(dict.fromkeys(r.spec.label for r in sweep))
    batch_sizes = sorted({r.spec.batch_size for r in sweep})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, scale in zip(axes, ("linear", "log"), strict=True):
        for index, label in enumerate(labels):
            runs = sorted((r for r in sweep if r.spec.label == label), key=lambda r: r.spec.batch_size)
            x = [r.spec.batch_size for r in runs]
            color = colors[index % len(colors)]
            mean = [r.summary["mean_s"] for r in runs]
            std = [0.0 if math.isnan(r.summary["std_s"]) else r.summary["std_s"] for r in runs]
            ax.errorbar(
                x, mean, yerr=std, color=color, marker="o", capsize=3, label=f"{label}: mean epoch 2+"
            )
            ax.plot(
                x,
                [r.summary["epoch1_s"] for r in runs],
                color=color,
                marker="x",
                linestyle="--",
                alpha=0.6,
                label=f"{label}: epoch 1",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale(scale)
        if scale == "log":  # plain numbers, not 6x10^0
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size (per replica)")
        ax.set_ylabel("seconds per epoch")
        ax.set_title(f"{scale} scale", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    written.append(folder / "epoch_time.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (key, what) in zip(axes, (("mean_s", "mean epoch 2+"), ("epoch1_s", "epoch 1")), strict=True):
        for label, by_batch in ratios(sweep, key).items():
            x = sorted(by_batch)
            color = colors[labels.index(label) % len(colors)]
            ax.plot(x, [by_batch[b] for b in x], marker="o", color=color, label=label)
        ax.axhline(1.0, color="k", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
        ax.set_xlabel("batch size (per replica)")
        ax.set_ylabel("switched / baseline")
        ax.set_title(f"{what} time, relative to the baseline", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    written.append(folder / "ratios.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def environment() -> dict[str, Any]:
    versions = {}
    for package in ("torch", "torch_xla", "hydra-core"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "python": platform.python_version(),
        **versions,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }


# ---------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
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
    if args.collect and (args.overrides or args.dry_run or args.cold_warm):
        parser.error("--collect reports finished runs: no overrides, --dry-run or --cold-warm with it")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", os.path.relpath(__file__), *(sys.argv[1:] if argv is None else argv)])
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
        f"Set-up measured as: {setup_methods(results)}; epoch time from: {epoch_methods(results)}.",
    ]
    sweep = {
        "command": command,
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


def setup_methods(results: Sequence[RunResult]) -> str:
    return ", ".join(sorted({r.summary["setup_method"] for r in results if r.summary})) or "n/a"


def epoch_methods(results: Sequence[RunResult]) -> str:
    return ", ".join(sorted({r.summary["epoch_time_method"] for r in results if r.summary})) or "n/a"


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


def write_report(
    results: Sequence[RunResult], out: Path, title: str, notes: Sequence[str], sweep: dict, plot_title: str
) -> int:
    """runs.csv, table.md, the plots and sweep.json in out; 1 if any run failed."""
    write_csv(results, out / "runs.csv")
    write_table(results, out / "table.md", title, notes)
    written = [out / "runs.csv", out / "table.md"]
    if any(r.ok and r.spec.cache == "off" for r in results):
        written += plot(results, out, f"{plot_title}, {os.cpu_count()} CPUs")
    (out / "sweep.json").write_text(json.dumps({**sweep, "environment": environment()}, indent=1) + "\n")
    written.append(out / "sweep.json")
    print((out / "table.md").read_text())
    print("wrote " + ", ".join(str(p) for p in written))
    failed = [r for r in results if not r.ok]
    if failed:
        print(f"\n{len(failed)} of {len(results)} runs failed:", file=sys.stderr)
        for r in failed:
            print(failure_report(r), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
