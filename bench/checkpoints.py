"""What a checkpoint costs the training loop: synchronous saves against checkpoint.asynchronous.

Reproduce (from the repository root; no accelerator needed):

    .venv/bin/python -m bench.checkpoints                          # wrn_seed and resnet50 on cpu_eager
    .venv/bin/python -m bench.checkpoints --models resnet50 --saves 3
    .venv/bin/python -m bench.checkpoints --runtime xla --batch-size 2   # the XLA CPU device

For each model it builds the full-size model (wrn_seed: conf/model/wrn_seed.yaml,
100 classes, 32x32 input; resnet50: torchvision's, 1000 classes, 224x224) and
an SGD optimizer with Nesterov momentum (one buffer per parameter: the state a
checkpoint holds is the weights and the buffers), trains one step so the
buffers exist, and then measures, on the replica runtime of cpu_eager
(runtime.native.NativeRuntime on the CPU) or, with --runtime xla, of the XLA
CPU device (runtime.xla.XlaRuntime: the host copy is a transfer from the
device, as on a TPU, into fresh host tensors), with the trainer's own
training.saving.CheckpointWriter writing to a local folder:

    host copy    runtime.state_to_host of the state alone, into fresh memory as a
                 synchronous save copies it (median of 3); an asynchronous save
                 copies into the previous save's buffers (runtime.staging)
    sync save    a save with checkpoint.asynchronous=false: host copy,
                 serialising, SHA-256, the atomic write, the read-back check
                 (median of --saves)
    stall        per save with checkpoint.asynchronous=true, what save() took
                 in the training thread, while real training steps (batch
                 --batch-size) run between saves for at least 1.5x the
                 synchronous save time and until the previous write is done,
                 as checkpoint.every_n_steps spaced wider than one write
                 does (a save that comes sooner waits for the previous one,
                 and that wait is stall too): the first save (it makes the
                 host buffers, a fresh copy like the baseline's), then the
                 mean and the worst of the others
    background   the writer thread's time per save (checkpoint_write_seconds)
    step         the training step's mean time with a write in flight, and
                 without one (two more steps once every write is done): the
                 writer shares the host's cores

The goal (issue 36): the stall at most the host copy and at most 10% of the
synchronous save (checked on the saves after the first). Results go to
bench/results/checkpoints/<time>.json and the table is printed. The batch
size does not change the state; it sets how long the steps between saves take.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn as nn

from tpustream.config import DataConfig, TrainConfig
from tpustream.models.registry import create_model
from tpustream.runtime.device import tensor_bytes
from tpustream.runtime.native import NativeRuntime
from tpustream.training.saving import CheckpointWriter

RESULTS = Path(__file__).parent / "results" / "checkpoints"
MODELS = {
    # name: (create_model arguments, input size)
    "wrn_seed": ({"num_classes": 100, "image_size": 32, "k": 7, "n": 4, "kernel_size": 7}, 32),
    "resnet50": ({"num_classes": 1000, "image_size": 224}, 224),
}


class Training:
    """A model, its optimizer and a batch: step() trains once, state() is what a checkpoint holds."""

    def __init__(self, name: str, batch_size: int, device: torch.device):
        options, size = MODELS[name]
        torch.manual_seed(0)
        self.device = device
        self.model = create_model(name, channels=3, **options).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        self.images = torch.randn(batch_size, 3, size, size).to(device)
        self.labels = torch.randint(0, options["num_classes"], (batch_size,)).to(device)
        self.steps = 0

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(self.model(self.images), self.labels).backward()
        self.optimizer.step()
        if self.device.type == "xla":
            import torch_xla

            torch_xla.sync(wait=True)  # the step runs here, as the trainer's loader cuts it
        self.steps += 1

    def state(self) -> dict:
        position = {"epoch": 0, "step": self.steps}
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "global_step": self.steps,
            "position": position,
        }


class CopyTimingRuntime:
    """The runtime, its state_to_host timed: the part of each save's stall that is the host copy."""

    def __init__(self, runtime: NativeRuntime):
        self.runtime = runtime
        self.copies: list[float] = []

    def __getattr__(self, name: str):
        return getattr(self.runtime, name)

    def state_to_host(self, state: dict, staging=None) -> dict | None:
        start = time.perf_counter()
        host = self.runtime.state_to_host(state, staging)
        self.copies.append(time.perf_counter() - start)
        return host


def writer_for(output_dir: str, asynchronous: bool, runtime) -> CheckpointWriter:
    cfg = TrainConfig()
    cfg.data = DataConfig(root="-")
    cfg.output_dir, cfg.log_dir = output_dir, output_dir
    cfg.checkpoint.asynchronous = asynchronous
    return CheckpointWriter(cfg, runtime)


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def make_runtime(kind: str):
    """cpu_eager's replica runtime, or the XLA CPU device's (one replica, as accelerator=cpu runs)."""
    if kind == "cpu_eager":
        return NativeRuntime(0, 1, 0, torch.device("cpu"))
    import os

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    from tpustream.runtime.xla import XlaRuntime

    return XlaRuntime()


def measure(name: str, saves: int, batch_size: int, folder: str, kind: str = "cpu_eager") -> dict:
    runtime = make_runtime(kind)
    training = Training(name, batch_size, runtime.device)
    training.step()  # the momentum buffers exist from here on
    state_bytes = tensor_bytes(training.state())
    copies = [timed(lambda: runtime.state_to_host(training.state())) for _ in range(3)]

    synchronous = writer_for(f"{folder}/{name}-sync", False, runtime)
    sync_saves = []
    for index in range(saves):
        position = (training.steps, 0, index)
        sync_saves.append(timed(lambda p=position: synchronous.save("last.pt", training.state, position=p)))
    sync_save = statistics.median(sync_saves)

    timing = CopyTimingRuntime(runtime)
    asynchronous = writer_for(f"{folder}/{name}-async", True, timing)
    stalls, busy_steps, idle_steps = [], [], []
    for index in range(saves):
        stalls.append(timed(lambda i=index: asynchronous.save("last.pt", training.state, position=(i, 1, i))))
        # Train until the next save is due: at least 1.5x a synchronous save later, and the
        # previous write done (checkpoint.every_n_steps spaced wider than one write; a save
        # that comes sooner waits for the previous one, and that wait is stall too).
        until = time.perf_counter() + 1.5 * sync_save
        while time.perf_counter() < until or asynchronous.background.in_flight is not None:
            in_flight = asynchronous.background.in_flight is not None
            (busy_steps if in_flight else idle_steps).append(timed(training.step))
    asynchronous.wait_durable()
    background = asynchronous.take_seconds().write
    idle_steps += [timed(training.step) for _ in range(2)]  # the same steps with no write in flight
    return {
        "model": name,
        "runtime": kind,
        "state_mb": state_bytes / 1e6,
        "host_copy_s": statistics.median(copies),
        "sync_save_s": sync_save,
        "stalls_s": stalls,
        # The first save makes the host buffers later saves reuse: a fresh copy, like the baseline.
        "stall_first_s": stalls[0],
        "stall_mean_s": statistics.mean(stalls[1:]),
        "stall_max_s": max(stalls[1:]),
        # The stall less its own host copy: taking the state, sizing it, starting the writer.
        "stall_overhead_mean_s": statistics.mean(s - c for s, c in zip(stalls, timing.copies, strict=True)),
        "background_s_per_save": background / saves,
        "step_s_writing": statistics.mean(busy_steps) if busy_steps else None,
        "step_s_idle": statistics.mean(idle_steps) if idle_steps else None,
        "steps_writing": len(busy_steps),
        "steps_idle": len(idle_steps),
        "saves": saves,
        "batch_size": batch_size,
    }


def report(rows: list[dict]) -> str:
    head = (
        f"{'model':<9} {'state MB':>9} {'host copy':>10} {'sync save':>10} {'1st stall':>10} "
        f"{'stall mean':>11} {'stall max':>10} {'max/sync':>9} {'background':>11} {'step idle':>10} "
        f"{'step writing':>13}"
    )
    lines = [head]
    for r in rows:
        idle = "-" if r["step_s_idle"] is None else f"{r['step_s_idle']:.2f}s"
        writing = "-" if r["step_s_writing"] is None else f"{r['step_s_writing']:.2f}s"
        lines.append(
            f"{r['model']:<9} {r['state_mb']:>9.0f} {r['host_copy_s']:>9.3f}s {r['sync_save_s']:>9.2f}s "
            f"{r['stall_first_s']:>9.3f}s {r['stall_mean_s']:>10.3f}s {r['stall_max_s']:>9.3f}s "
            f"{r['stall_max_s'] / r['sync_save_s']:>9.3f} "
            f"{r['background_s_per_save']:>10.2f}s {idle:>10} {writing:>13}"
        )
    for r in rows:
        copy_ok = r["stall_max_s"] <= r["host_copy_s"]
        tenth_ok = r["stall_max_s"] <= 0.1 * r["sync_save_s"]
        lines.append(
            f"{r['model']}: worst stall after the first {r['stall_max_s']:.3f}s "
            f"vs host copy {r['host_copy_s']:.3f}s "
            f"({'met' if copy_ok else 'NOT met'}; beyond its own copy a stall took "
            f"{r['stall_overhead_mean_s']:.4f}s on average), vs 10% of the synchronous save "
            f"{0.1 * r['sync_save_s']:.3f}s "
            f"({'met' if tenth_ok else 'NOT met'})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.checkpoints", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="wrn_seed,resnet50", help="comma-separated: wrn_seed, resnet50")
    parser.add_argument("--saves", type=int, default=4, help="saves per mode (default 4)")
    parser.add_argument(
        "--batch-size", type=int, default=8, help="the steps' batch between saves (default 8)"
    )
    parser.add_argument(
        "--runtime",
        choices=["cpu_eager", "xla"],
        default="cpu_eager",
        help="the replica runtime: cpu_eager, or xla (the XLA CPU device; slow convolutions: a small batch)",
    )
    args = parser.parse_args(argv)
    names = [name for name in args.models.split(",") if name]
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(MODELS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-checkpoints-") as folder:
        for name in names:
            rows.append(measure(name, args.saves, args.batch_size, folder, args.runtime))
            print(report(rows[-1:]).splitlines()[1], flush=True)
    print(report(rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    path = RESULTS / f"{stamp}.json"
    command = " ".join(["python -m bench.checkpoints", *(sys.argv[1:] if argv is None else argv)])
    path.write_text(json.dumps({"command": command, "rows": rows}, indent=1) + "\n")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
