"""bench.loaders' report: the machine and library versions, and the markdown table the docs take."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from typing import Any

from bench.harness import REPO

VERSIONED = (
    "torch",
    "torchvision",
    "pillow",
    "numpy",
    "webdataset",
    "mosaicml-streaming",
    "torchdata",
    "grain",
)


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str | None:
    """/proc/cpuinfo's first "model name" (Linux); None elsewhere."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment() -> dict[str, Any]:
    """The machine and the libraries the rows ran on."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        affinity = None
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "sched_getaffinity": affinity,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {package: version(package) for package in VERSIONED},
        "commit": commit.stdout.strip() if commit.returncode == 0 else None,
    }


def describe_environment(found: dict[str, Any]) -> str:
    versions = ", ".join(f"{name} {value}" for name, value in found["versions"].items() if value)
    return (
        f"{found['cpu']}, {found['sched_getaffinity'] or found['cpu_count']} usable CPUs; "
        f"Python {found['python']}; {versions}"
    )


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def state_cell(row: dict) -> str:
    if row.get("state_bytes") is None:
        return "none"
    return f"{row['state_bytes']:,} B ({row['state_format']})"


def resume_cell(row: dict) -> str:
    text = seconds(row.get("resume_seconds"))
    return text if row.get("resume_how") == "load state" else f"{text} (reads k batches)"


def elastic_cell(elastic: dict | None) -> str:
    """Duplicated / missed across the stop on 2 ranks and the resume on 1, or what went wrong."""
    if not elastic:
        return ""
    if "error" in elastic:
        return f"fails: {elastic['error']}".replace("|", "/")
    return f"{elastic['duplicated']} / {elastic['missed']}"


def format_table(results: dict[str, Any]) -> str:
    """The markdown table: a row per library and worker count; the elastic cell on a library's first."""
    settings = results["settings"]
    lines = [
        "| loader | workers | images/s | images/s per worker | first batch (s) | resume at step k (s) "
        "| state at step k | 2 ranks -> 1: duplicated / missed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for library in results["libraries"]:
        name, elastic = library["name"], library.get("elastic")
        if library.get("missing"):
            lines.append(f"| {name} | - | - | - | - | - | - | not installed |")
            continue
        for number, row in enumerate(library["rows"]):
            if "error" in row:
                cells = [name, str(row["workers"]), *["-"] * 5, f"fails: {row['error']}".replace("|", "/")]
            else:
                cells = [
                    name,
                    str(row["workers"]),
                    f"{row['images_per_second']:,.1f}",
                    f"{row['images_per_second_per_worker']:,.1f}",
                    seconds(row["first_batch_seconds"]),
                    resume_cell(row),
                    state_cell(row),
                    elastic_cell(elastic) if number == 0 else "",
                ]
            lines.append("| " + " | ".join(cells) + " |")
    step = settings["warmup"] + settings["measured"]
    data, env = results["data"], results["environment"]
    lines += [
        "",
        f"One rank, RandomResizedCrop 224 + flip to uint8 batches of {settings['batch_size']}: images/s over "
        f"{settings['measured']} batches after {settings['warmup']}; the state at step k = {step} (half an "
        "epoch) and the resume from it (a new loader to its first batch), each row and each resume in a "
        "fresh process. 2 ranks -> 1: a checkpoint at half an epoch on 2 ranks of "
        f"{settings['batch_size']}, resumed on 1 rank of {2 * settings['batch_size']}, "
        f"{settings['elastic_workers']} worker(s) a rank, against one uninterrupted epoch on 2 ranks. "
        f"{data['images']:,} JPEGs, {data['avg_bytes'] / 1000:.0f} KB and {data['avg_width']:.0f}x"
        f"{data['avg_height']:.0f} px on average. Machine: {describe_environment(env)}.",
    ]
    return "\n".join(lines)
