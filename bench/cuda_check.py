"""accelerator=cuda on a real GPU: correctness of the native path, and epoch times of its settings.

Run on a machine with an NVIDIA GPU, from the repository root (tpustream's
dependencies installed, or on PYTHONPATH with src/):

    python -m bench.cuda_check OUT_DIR            # ~5 min on one H100/H200
    python -m bench.cuda_check OUT_DIR --quick    # the correctness part only
    python -m bench.cuda_check OUT_DIR --quick --accelerator cpu_eager   # the script, without a GPU
    python -m bench.cuda_check OUT_DIR --fsdp     # strategy=fsdp (FSDP2) against ddp, ~4 min
    python -m bench.cuda_check OUT_DIR --fsdp --quick --accelerator cpu_eager   # its runs, no GPU

What one H200 gave: docs/gpus.md ("What has run on a GPU"); its OUT_DIR is not kept.

Correctness (the digits demo, small_cnn, 1 GPU, 4 workers,
accelerator.deterministic=true): a 3-epoch run; the same run stopped by
debug.stop_at_step=10 (exit 75) and resumed, whose last.pt must equal the
straight run's bit for bit (model, optimizer, position); the straight run's
best.pt is copied to OUT_DIR (it evaluates under XLA: tests/test_native.py
does the same with a cpu_eager checkpoint).

Timing: wrn_seed (the seed study's 103M WideResNet) at bf16, batch 256, on
the digits upsampled 10x with raw pixels (14,380 training samples an
epoch), optim.lr=0.02, 3 epochs, for: deterministic=true, the default
cudnn.benchmark, plus channels_last, plus torch.compile. Each row is metrics.jsonl's epochs
1-2 (epoch 0 holds cuDNN's autotuning and compilation): samples/s, step
time, input-wait share, MFU against the GPU's dense bf16 peak.

--fsdp: strategy=fsdp (PyTorch's FSDP2) on the same GPU(s): the deterministic
digits runs straight under ddp and under fsdp (fsdp_wrap_min_params=2000),
and fsdp stopped at step 10 and resumed (last.pt bit for bit against fsdp's
straight run, and fsdp's straight run against ddp's); then wrn_seed timed
under ddp and fsdp with the default cuDNN autotuning (one GPU holds the one
shard: this measures FSDP2's overhead, not its memory saving).

OUT_DIR gets summary.json, summary.md, cuda_best.pt and runs.log (each
run's command, exit code and last lines).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from bench.harness import log_tail, read_records, run_logged
from tpustream.observe.advice import measured

TIMED_VARIANTS = {
    "deterministic": ["accelerator.deterministic=true"],
    "cudnn.benchmark (default)": ["accelerator.deterministic=false"],
    "benchmark + channels_last": ["accelerator.deterministic=false", "accelerator.channels_last=true"],
    "benchmark + channels_last + compile": [
        "accelerator.deterministic=false",
        "accelerator.channels_last=true",
        "accelerator.compile=true",
    ],
}


class Runner:
    def __init__(self, out: Path, work: Path):
        self.out, self.work = out, work
        self.log = (out / "runs.log").open("w")

    def run(self, name: str, args: list[str], timeout: int = 600) -> int:
        command = [sys.executable, *args]
        log_path = self.work / "logs" / f"{name}.log"
        finished, seconds = run_logged(command, log_path, timeout)
        code = -9 if finished is None else finished  # -9: ran past its timeout and was killed
        self.log.write(f"=== {name}: exit {code} in {seconds:.0f} s\n$ {' '.join(command)}\n")
        self.log.write(log_tail(log_path) + "\n\n")
        self.log.flush()
        print(f"{name}: exit {code} in {seconds:.0f} s", flush=True)
        return code

    def train(self, name: str, *overrides: str, timeout: int = 180) -> int:
        return self.run(
            name, ["train.py", *overrides, f"hydra.run.dir={self.work / 'hydra' / name}"], timeout
        )


def same_checkpoints(a: Path, b: Path) -> dict:
    import torch

    first, second = (torch.load(p, map_location="cpu", weights_only=False) for p in (a, b))

    def tensors(state, prefix=""):
        if isinstance(state, torch.Tensor):
            yield prefix, state
        elif isinstance(state, dict):
            for key, value in state.items():
                yield from tensors(value, f"{prefix}.{key}")
        elif isinstance(state, list | tuple):
            for index, value in enumerate(state):
                yield from tensors(value, f"{prefix}.{index}")

    differ = []
    for part in ("model", "optimizer"):
        left, right = dict(tensors(first[part])), dict(tensors(second[part]))
        differ += [f"{part}{k}" for k in left if k not in right or not torch.equal(left[k], right[k])]
    return {
        "bitwise": not differ and first["position"] == second["position"],
        "differing_tensors": differ[:5],
        "positions": [first["position"], second["position"]],
        "global_steps": [first["global_step"], second["global_step"]],
    }


def steady(records: list[dict]) -> dict:
    later = measured(records)
    if not later:
        return {}
    mean = lambda key: sum(r.get(key) or 0 for r in later) / len(later)  # noqa: E731
    return {
        "samples_per_s": round(mean("global_rate"), 1),
        "train_seconds": round(mean("train_seconds"), 2),
        "step_seconds": round(mean("step_seconds"), 2),
        "input_wait_fraction": round(mean("input_wait_fraction"), 3),
        # The CUDA events' figures (observe.idle), first measured by this script on a GPU.
        **{
            key: round(mean(key), 3)
            for key in ("input_bound_fraction", "device_idle_fraction")
            if all(key in r for r in later)
        },
        "mfu": round(mean("mfu"), 3) if any("mfu" in r for r in later) else None,
        "epoch0_train_seconds": round(records[0].get("train_seconds", 0), 2),
        "val_accuracy": records[-1].get("val_accuracy"),
        "model_flops_per_sample": records[0].get("model_flops_per_sample"),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.cuda_check", description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--quick", action="store_true", help="the correctness part only")
    parser.add_argument("--timing-only", action="store_true", help="the timing part only")
    parser.add_argument("--work", type=Path, default=Path("/tmp/cuda_check"))
    parser.add_argument("--accelerator", default="cuda", help="cpu_eager tries the script without a GPU")
    parser.add_argument("--fsdp", action="store_true", help="strategy=fsdp (FSDP2) against ddp only")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work
    runner = Runner(args.out, work)
    import torch

    summary: dict = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
    }
    summary["correctness"] = {}
    if args.fsdp:
        fsdp(args, runner, summary)
        print(write_summary(args.out, summary))
        return 0
    if not args.timing_only:
        correctness(args, runner, summary)
    if not args.quick:
        timing(args, runner, summary)
    print(write_summary(args.out, summary))
    return 0


def correctness(args: argparse.Namespace, runner: Runner, summary: dict) -> None:
    work = args.work
    make = [str(work / "digits"), "--no-progress"]
    runner.run("shards", ["-m", "tpustream.data.write.command", "digits", *make])
    common = [
        f"accelerator={args.accelerator}",
        f"data.root={work / 'digits'}",
        "data.num_workers=4",
        "epochs=3",
        "accelerator.deterministic=true",  # bit for bit (the default autotunes cuDNN's kernels)
    ]
    straight, stopped = work / "straight", work / "stopped"
    codes = {
        "straight": runner.train("straight", *common, f"output_dir={straight}"),
        "stopped": runner.train("stopped", *common, f"output_dir={stopped}", "debug.stop_at_step=10"),
        "resumed": runner.train("resumed", *common, f"output_dir={stopped}"),
    }
    summary["correctness"] = {"exit_codes": codes, "history": read_records(straight)}
    write_summary(args.out, summary)
    if codes["straight"] == 0 and codes["resumed"] == 0:
        summary["correctness"]["resume"] = same_checkpoints(
            straight / "checkpoints" / "last.pt", stopped / "checkpoints" / "last.pt"
        )
        (args.out / "cuda_best.pt").write_bytes((straight / "checkpoints" / "best.pt").read_bytes())


FSDP = ["strategy=fsdp", "fsdp_wrap_min_params=2000"]


def fsdp(args: argparse.Namespace, runner: Runner, summary: dict) -> None:
    work = args.work
    make = ["-m", "tpustream.data.write.command", "digits"]
    runner.run("shards", [*make, str(work / "digits"), "--no-progress"])
    common = [
        f"accelerator={args.accelerator}",
        f"data.root={work / 'digits'}",
        "data.num_workers=4",
        "epochs=3",
        "accelerator.deterministic=true",
    ]
    ddp, straight, stopped = work / "ddp", work / "fsdp_straight", work / "fsdp_stopped"
    codes = {
        "ddp": runner.train("ddp", *common, f"output_dir={ddp}"),
        "fsdp_straight": runner.train("fsdp_straight", *common, *FSDP, f"output_dir={straight}"),
        "fsdp_stopped": runner.train(
            "fsdp_stopped", *common, *FSDP, f"output_dir={stopped}", "debug.stop_at_step=10"
        ),
        "fsdp_resumed": runner.train("fsdp_resumed", *common, *FSDP, f"output_dir={stopped}"),
    }
    histories = {"history_fsdp": read_records(straight), "history_ddp": read_records(ddp)}
    checks: dict = {"exit_codes": codes, **histories}
    last = lambda run: run / "checkpoints" / "last.pt"  # noqa: E731
    if codes["fsdp_straight"] == 0 and codes["fsdp_resumed"] == 0:
        checks["fsdp_resume"] = same_checkpoints(last(straight), last(stopped))
    if codes["ddp"] == 0 and codes["fsdp_straight"] == 0:
        checks["fsdp_vs_ddp"] = same_checkpoints(last(ddp), last(straight))
    summary["correctness"] = checks
    write_summary(args.out, summary)
    if args.quick:
        return
    timed_runs(args, runner, summary, {"ddp": [], "fsdp (FSDP2)": FSDP})


def timing(args: argparse.Namespace, runner: Runner, summary: dict) -> None:
    timed_runs(args, runner, summary, TIMED_VARIANTS)


def timed_runs(args: argparse.Namespace, runner: Runner, summary: dict, variants: dict) -> None:
    """wrn_seed at bf16, batch 256, on the digits x10, once per variant's overrides."""
    work = args.work
    upsampled = ["--upsample", "10", "--image-format", "raw", "--no-progress"]
    runner.run(
        "shards x10", ["-m", "tpustream.data.write.command", "digits", str(work / "digits10"), *upsampled]
    )
    timed = [
        f"accelerator={args.accelerator}",
        f"data.root={work / 'digits10'}",
        "data.num_workers=4",
        "model=wrn_seed",
        "precision=bf16",
        "batch_size=256",
        # The digits config's learning rate diverges wrn_seed at batch 256 (NaN by step 40, H200).
        "optim.lr=0.02",
        "epochs=3",
    ]
    summary["timing"] = {}
    for index, (name, settings) in enumerate(variants.items()):
        run = work / f"timed{index}"
        code = runner.train(f"timed{index}", *timed, *settings, f"output_dir={run}", timeout=240)
        summary["timing"][name] = {"exit_code": code, "overrides": settings, **steady(read_records(run))}
        write_summary(args.out, summary)


def write_summary(out: Path, summary: dict) -> str:
    """summary.json and summary.md as they stand (written after each part: a cut-off call keeps them)."""
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [
        f"{summary['device']}, torch {summary['torch']} (CUDA {summary['cuda']}), {summary['cpus']} CPUs",
        "",
    ]
    checks = {k: v for k, v in summary["correctness"].items() if not k.startswith("history")}
    lines.append(f"correctness: {json.dumps(checks)}")
    for name, row in summary.get("timing", {}).items():
        lines.append(f"- {name}: {json.dumps(row)}")
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    raise SystemExit(main())
