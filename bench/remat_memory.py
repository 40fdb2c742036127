"""One training step's peak memory with and without model.remat, measured, and its losses.

Reproduce (from the repository root, no accelerator needed):

    .venv/bin/python -m bench.remat_memory                   # native (CPU eager) and XLA:CPU
    .venv/bin/python -m bench.remat_memory --runtime native --model vit_large_patch16_224 --batch 16

Each measurement is a process of its own, one per runtime and model.remat
setting, building the model as train.py does (timm, seed 0, models.remat's
rematerialize) and taking one AdamW step on one fixed batch:

    native  PyTorch eager on the CPU (on a GPU when one is present): the peak
            is what the step adds to the process, CUDA's max_memory_allocated
            or, on the CPU, the peak resident set (ru_maxrss) minus the
            resident set just before the step; the parameters' gradients and
            the optimizer state are allocated before that (zeros and
            prime_optimizer_state), so the difference is the activations and
            the step's temporaries.
    xla     XLA:CPU on one device: the compiled step's memory as XLA's buffer
            assignment accounts for it ("Total bytes used" of the training
            step's program, from --xla_dump_to), parameters and optimizer
            state included, and the step's matmuls counted in its optimised
            program (the recomputation's are extra).

The losses of the two settings must agree (within float rounding). XLA:CPU's
peak is what XLA:CPU schedules, not what a TPU would: see docs/large-models.md
(Rematerialisation) for why it does not drop there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import REPO

DEFAULT_MODEL = "vit_base_patch16_224"


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_in_this_process(
    runtime: str, model_name: str, image_size: int, batch: int, remat: bool, patch_size: int | None
) -> dict:
    """The child: one step, its peak and its loss."""
    import timm
    import torch

    from tpustream.models.remat import rematerialize
    from tpustream.training.optimizer import prime_optimizer_state

    xla = runtime == "xla"
    torch.manual_seed(0)
    patch = {} if patch_size is None else {"patch_size": patch_size}
    model = timm.create_model(model_name, img_size=image_size, num_classes=1000, **patch)
    blocks = rematerialize(model, model_name, xla=xla) if remat else 0
    if xla:
        import torch_xla

        device = torch_xla.device()
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    prime_optimizer_state(optimizer)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device)
    labels = torch.randint(0, 1000, (batch,), generator=generator).to(device)
    if xla:
        torch_xla.sync(wait=True)
    elif device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = resident_bytes()
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=False)
    loss = torch.nn.functional.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    if xla:
        torch_xla.sync(wait=True)
    value = loss.item()
    seconds = time.perf_counter() - start
    result = {"loss": value, "blocks": blocks, "step_seconds": round(seconds, 2)}
    if xla:
        return result
    if device.type == "cuda":
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
        result["how"] = "torch.cuda.max_memory_allocated"
    else:
        result["peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        result["how"] = "peak resident set minus the resident set before the step"
    return result


def compiled_step(dump: Path) -> dict:
    """The training step's program in an XLA dump: the largest one compiled (the others copy data)."""
    programs = sorted(dump.glob("module_*.cpu_after_optimizations.txt"), key=lambda p: p.stat().st_size)
    program = programs[-1]
    assignment = program.with_name(program.name.replace(".txt", "-buffer-assignment.txt"))
    total = next(
        int(line.split()[3])
        for line in assignment.read_text().splitlines()
        if line.startswith("Total bytes used:")
    )
    return {
        "peak_bytes": total,
        "how": "XLA buffer assignment, Total bytes used",
        "matmuls": program.read_text().count(" dot("),
    }


def measure(
    runtime: str, model: str, image_size: int, batch: int, remat: bool, patch_size: int | None
) -> dict:
    env = {**os.environ}
    command = [sys.executable, "-m", "bench.remat_memory", "--child", runtime, "--model", model]
    command += [] if patch_size is None else ["--patch-size", str(patch_size)]
    command += ["--image-size", str(image_size), "--batch", str(batch), *(["--remat"] if remat else [])]
    with tempfile.TemporaryDirectory() as folder:
        if runtime == "xla":
            env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={folder}".strip()
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(
                f"{runtime} remat={remat} failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
            )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        if runtime == "xla":
            result.update(compiled_step(Path(folder)))
    row = {"runtime": runtime, "remat": remat, **result}
    print(
        f"{runtime} remat={remat}: {row['peak_bytes'] / 2**20:,.1f} MiB, loss {row['loss']:.6f}",
        file=sys.stderr,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.remat_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=["native", "xla"], nargs="+", default=["native", "xla"])
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"a timm ViT (default {DEFAULT_MODEL})")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--patch-size", type=int, help="the model's patch size, if not its own")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "remat_memory.json")
    parser.add_argument("--child", choices=["native", "xla"], help=argparse.SUPPRESS)
    parser.add_argument("--remat", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measured = measure_in_this_process(
            args.child, args.model, args.image_size, args.batch, args.remat, args.patch_size
        )
        print(json.dumps(measured))
        return
    start = time.perf_counter()
    rows = [
        measure(runtime, args.model, args.image_size, args.batch, remat, args.patch_size)
        for runtime in args.runtime
        for remat in (False, True)
    ]
    print("| runtime | model.remat | peak MiB | loss | how |\n| --- | --- | ---: | ---: | --- |")
    for row in rows:
        peak = f"{row['peak_bytes'] / 2**20:,.1f}"
        print(f"| {row['runtime']} | {row['remat']} | {peak} | {row['loss']:.6f} | {row['how']} |")
    import torch

    report = {
        "command": shlex.join(["python", "-m", "bench.remat_memory", *sys.argv[1:]]),
        "model": args.model,
        "image_size": args.image_size,
        "patch_size": args.patch_size,
        "batch": args.batch,
        "rows": rows,
        "seconds": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
