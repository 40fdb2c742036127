"""bench.augment's device side from the parent: a child process per model and backend, and their summary.

The children run one after the other, never beside each other or the host
measurements: on 2 shared cores a second busy process slows the first one's
compilation about as much as it saves, and would be in every timed step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.augment.device import FORMS

REPO = Path(__file__).resolve().parents[2]  # python -m bench.augment.device runs from here
LOG_TAIL = 3000  # characters of a failed child's output put in the error
EAGER_REPEATS = 3


@dataclass(frozen=True)
class Plan:
    """What every child gets: the batches file, timed steps and calls per form, where it writes."""

    batches: Path
    steps: int
    calls: int
    workdir: Path
    pjrt_device: str = "CPU"  # the XLA children's PJRT_DEVICE (CPU here; TPU on a TPU VM)

    def for_backend(self, backend: str) -> Plan:
        """Eager CPU is a reference for XLA:CPU's own speed: at most EAGER_REPEATS steps and calls
        (its augmentation takes seconds a batch)."""
        if backend == "xla":
            return self
        return dataclasses.replace(
            self, steps=min(self.steps, EAGER_REPEATS), calls=min(self.calls, EAGER_REPEATS)
        )


def run_child(model: str, backend: str, plan: Plan) -> dict:
    """One child's results (bench.augment.device); its output goes to workdir/<model>-<backend>.log."""
    stem = f"{model}-{backend}"
    log, out = plan.workdir / f"{stem}.log", plan.workdir / f"{stem}.json"
    command = [
        sys.executable, "-m", "bench.augment.device", "--model", model, "--backend", backend,
        "--batches", str(plan.batches), "--steps", str(plan.steps), "--calls", str(plan.calls),
        "--out", str(out),
    ]  # fmt: skip
    # Set either way: torch_xla warns and picks the CPU when PJRT_DEVICE is unset.
    env = {**os.environ, "PJRT_DEVICE": plan.pjrt_device}
    print(
        f"  {model} {backend}: warm-up, {plan.steps} steps and {plan.calls} augmentation calls per form ..."
    )
    sys.stdout.flush()
    with open(log, "w") as output:
        status = subprocess.run(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT
        ).returncode
    if status != 0:
        tail = log.read_text(errors="replace")[-LOG_TAIL:]
        raise RuntimeError(f"bench.augment.device ({model} {backend}) exited with status {status}:\n{tail}")
    return {**json.loads(out.read_text()), "pjrt_device": plan.pjrt_device if backend == "xla" else None}


def stats(seconds: list[float]) -> dict:
    ms = [1000 * s for s in seconds]
    return {
        "median_ms": statistics.median(ms),
        "mean_ms": statistics.fmean(ms),
        "min_ms": min(ms),
        "max_ms": max(ms),
    }


def max_or_none(values: list[int | None]) -> int | None:
    return None if None in values else max(values)


def summarize(result: dict) -> dict:
    """One child's numbers: medians (a shared machine's outliers stay out), the ratio, the compile counts."""
    batch = result["batch_size"]
    step = {form: stats(result["seconds"]["step"][form]) for form in FORMS}
    alone = {form: stats(times) for form, times in result["seconds"]["augment_only"].items()}
    off, on = step["off"]["median_ms"], step["on"]["median_ms"]
    augment = alone["on"]["median_ms"] - alone["off"]["median_ms"]  # beyond the Normalizer, which both have
    counts = result["compilations"]
    recompiled = (
        None if counts["after_warmup"] is None else counts["after_augment_only"] - counts["after_warmup"]
    )
    return {
        "model": result["model"],
        "backend": result["backend"],
        "batch_size": batch,
        "steps": len(result["seconds"]["step"]["off"]),
        "step": step,
        "ratio_on_over_off": on / off,
        "step_added_ms": on - off,
        "augment_only": alone,
        "augment_ms_per_batch": augment,
        "augment_ms_per_image": augment / batch,
        "augment_share_of_step_off": augment / off,
        "compilations": counts,
        "compilations_after_warmup": recompiled,
        # Graphs run per step (most seen): 1 when the step is one graph; None on eager CPU.
        "graphs_per_step": {form: max_or_none(result["graphs"]["step"][form]) for form in FORMS},
        "cpu_fallbacks": result["cpu_fallbacks"],
        "foreign_cores": result["foreign_cores"],
        "own_cores": result.get("own_cores"),  # how many cores the backend kept busy while timing
    }


def format_line(summary: dict) -> str:
    counts = summary["compilations"]
    compiled = "" if counts["after_warmup"] is None else f", compilations {counts['after_warmup']}"
    compiled += "" if counts["after_warmup"] is None else f" -> {counts['after_augment_only']}"
    off, on = (summary["step"][form]["median_ms"] for form in FORMS)
    return (
        f"    step off {off:.0f} ms, on {on:.0f} ms (x{summary['ratio_on_over_off']:.3f}); "
        f"augmentation alone {summary['augment_ms_per_batch']:.1f} ms/batch{compiled} "
        f"(other load {summary['foreign_cores']:.2f} cores)"
    )


def run_device(models: list[str], backends: list[str], plan: Plan) -> list[dict]:
    """Each model on each backend (XLA first), one child at a time; each child's raw result and summary."""
    results = []
    for backend in backends:
        for model in models:
            result = run_child(model, backend, plan.for_backend(backend))
            summary = summarize(result)
            print(format_line(summary), flush=True)
            results.append({"summary": summary, "raw": result})
    return results
