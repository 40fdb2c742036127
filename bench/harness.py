"""The benchmarks' one way to run train.py and read what it measured.

``compose_train_config`` checks overrides as train.py would compose them;
``train_command`` is `python train.py` into a fresh run folder; ``run_logged``
runs a command in a session of its own under a time limit, its output to a
file; ``read_records`` reads the run's metrics.jsonl and ``steady_rate`` gives
its samples/s by observe's rule (the epochs after the first, which compiles and
starts the workers), the rate tpustream-report and the synthetic twin use.
bench.ab, bench.limit, bench.feed and bench.cuda_check run on these.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tpustream.observe.advice import mean_of, measured

if TYPE_CHECKING:
    from tpustream.config import TrainConfig

REPO = Path(__file__).resolve().parent.parent


def compose_train_config(overrides: Sequence[str]) -> TrainConfig:
    """The TrainConfig train.py would run with these overrides (composed and resolved); Hydra's errors pass.

    output_dir and log_dir default to Hydra's run folder, which exists only inside
    train.py: placeholders here, nothing is written to them.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tpustream.config import register_configs
    from tpustream.launch.checks import resolve_config

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            placeholders = ["output_dir=/unused", "log_dir=null"]
            composed = compose(config_name="config", overrides=[*placeholders, *overrides])
        return resolve_config(composed)[0]
    finally:
        GlobalHydra.instance().clear()


def train_command(tree: Path, out: Path, epochs: int, overrides: Sequence[str]) -> list[str]:
    """`python train.py` of the tree at `tree`, for `epochs`, into the fresh run folder `out`."""
    return [
        sys.executable,
        str(tree / "train.py"),
        f"epochs={epochs}",
        *overrides,
        f"output_dir={out}",
        "resume=null",
        f"hydra.run.dir={out}",
    ]


def child_environment(tree: Path = REPO) -> dict[str, str]:
    """The tree's src/ and the tree itself first on PYTHONPATH (tpustream, and bench modules for -m)."""
    paths = [str(tree / "src"), str(tree), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def run_logged(
    command: Sequence[str], log_path: Path, timeout: float | None = None, tree: Path = REPO
) -> tuple[int | None, float]:
    """(exit code, or None when it ran past timeout; seconds), its output in log_path.

    A session of its own, so a timeout ends the whole tree (train.py's
    replicas and DataLoader workers), not only the process started here.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            list(command),
            cwd=tree,
            env=child_environment(tree),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            code = None
    return code, time.perf_counter() - started


def log_tail(log_path: Path, lines: int = 40) -> str:
    """The last lines of a run's log (what a failure is reported with)."""
    return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:]) if log_path.exists() else ""


def read_records(folder: Path) -> list[dict]:
    """The run folder's metrics.jsonl, one record per epoch ([] before its first epoch ends)."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def steady_rate(records: Sequence[dict]) -> float:
    """Mean global samples/s of the steady epochs (observe's rule: all but epoch 0 when there are others)."""
    rate = mean_of(measured(records), "global_rate")
    if rate is None:
        raise ValueError("no epoch records")
    return rate
