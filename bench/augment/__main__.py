"""The augmentation benchmark's command line: python -m bench.augment [--quick] [options]."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

from bench import augment
from bench.augment import host, report, steps
from bench.augment.recipe import AUGMENT_ON, LABEL_SMOOTHING
from bench.pipeline import harness
from bench.pipeline.harness import SEED
from bench.pipeline.imagenet_configs import MEAN, STD
from bench.pipeline.imagenet_data import make_photos, prepare_data

RESULTS = "results/augment"  # under bench/ (quick: results/augment/quick)
MODELS = ["resnet50", "vit_small_patch16_224"]
# (full, quick) of each sizing option.
SIZES = {
    "num_images": (2048, 512),
    "rounds": (5, 2),  # of the pipeline's off / on pair
    "min_seconds": (3.0, 1.0),
    "crops": (512, 128),  # for the libraries' host transforms
    "steps": (6, 2),  # timed steps per form and model
    "calls": (10, 3),  # timed augmentation-alone calls per form
}
WARMUP_BATCHES = 2  # of a pipeline pass, untimed (quick: 1)
DEVICE_BATCH = 8
DEVICE_BATCHES = 8  # distinct batches (other crops, other draws) the steps cycle through


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.augment", description=augment.__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run (about 4 minutes): fewer images and steps"
    )
    for name, (full, quick) in SIZES.items():
        kind = float if isinstance(full, float) else int
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, default=None, help=f"{full} (quick {quick})"
        )
    parser.add_argument("--models", nargs="+", default=MODELS, help=f"default {' '.join(MODELS)}")
    parser.add_argument("--device-batch", type=int, default=DEVICE_BATCH, help=f"default {DEVICE_BATCH}")
    parser.add_argument(
        "--eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time the steps on eager CPU, for XLA:CPU's own speed (default: on, quick off)",
    )
    parser.add_argument("--skip", choices=("host", "device"), help="leave one side out")
    parser.add_argument(
        "--pjrt-device",
        default="CPU",
        help="PJRT_DEVICE of the XLA children (default CPU; TPU to time the steps on a TPU VM)",
    )
    parser.add_argument("--out", type=Path, default=None, help=f"default bench/{RESULTS} (quick: .../quick)")
    args = parser.parse_args(argv)
    for name, (full, quick) in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.eager is None:
        args.eager = not args.quick
    if args.out is None:
        args.out = harness.BENCH / RESULTS / "quick" if args.quick else harness.BENCH / RESULTS
    return args


def run_host(args: argparse.Namespace, data, device_dir: Path) -> tuple[dict, Path]:
    """The pipeline off / on, the draws and the libraries' transforms; the device's batches saved."""
    warmup = 1 if args.quick else WARMUP_BATCHES
    print(f"host: ours-local w=0, augmentation off and on, {args.rounds} round(s) ...", flush=True)
    pipeline = host.pipeline_rates(data, args.rounds, args.min_seconds, warmup)
    print("host: our draws per image ...", flush=True)
    draws = host.draw_costs(args.min_seconds)
    crops = host.take_crops(data, max(args.crops, DEVICE_BATCHES * args.device_batch))
    print(f"host: the libraries' transforms on {args.crops} of our crops ...", flush=True)
    transforms = host.host_transform_costs(crops["image"][: args.crops], args.min_seconds)
    batches = host.save_device_batches(crops, args.device_batch, DEVICE_BATCHES, device_dir / "batches.pt")
    return {"pipeline": pipeline, "draws": draws, "transforms": transforms}, batches


def make_batches_only(data, args: argparse.Namespace, device_dir: Path) -> Path:
    crops = host.take_crops(data, DEVICE_BATCHES * args.device_batch)
    return host.save_device_batches(crops, args.device_batch, DEVICE_BATCHES, device_dir / "batches.pt")


def settings(args: argparse.Namespace) -> dict:
    return {
        "augment_on": {key: str(value) for key, value in vars(AUGMENT_ON).items()},
        "label_smoothing": LABEL_SMOOTHING,
        "mean": MEAN,
        "std": STD,
        "host": "ours-local (ShardStream, train_crop=random_resized, hflip, shuffle 1000, last_batch=drop), "
        "0 workers, 1 torch thread, batches of 128",
        "host_timing": "measure_row per form, off / on alternating per round, pooled: samples over seconds "
        "from each pass's first batch",
        "device_batch": args.device_batch,
        "device_batches": DEVICE_BATCHES,
        "device_timing": "per step: trace + torch_xla.sync() + wait_device_ops(); off / on alternating; "
        "medians reported",
        "optimizer": "AdamW(lr=1e-4, weight_decay=0.05), state primed (tpustream.training.optimizer)",
        **{name: getattr(args, name) for name in SIZES},
        "models": args.models,
        "eager": args.eager,
        "pjrt_device": args.pjrt_device,
    }


def run(args: argparse.Namespace, command: str) -> int:
    harness.start_run()  # one torch thread for the host side; the device children keep torch's default
    started = time.time()
    results: dict = {"command": command, "settings": settings(args), "environment": environment()}
    phases = results["phase_seconds"] = {}
    print(f"generating {args.num_images} ImageNet-like images ...", flush=True)
    photos = make_photos(args.num_images, SEED)
    with tempfile.TemporaryDirectory(prefix="tpustream-bench-augment-") as folder:
        device_dir = Path(folder)
        with harness.run_storage("tpustream-bench-augment-") as (workdir, bucket, _):
            data, results["data"] = prepare_data(photos, workdir, bucket)
            phases["data"] = time.time() - started
            if args.skip == "host":
                batches = make_batches_only(data, args, device_dir)
            else:
                results["host"], batches = run_host(args, data, device_dir)
            phases["host"] = time.time() - started - phases["data"]
        if args.skip != "device":
            backends = ["xla", "eager"] if args.eager else ["xla"]
            print(
                f"device: batch {args.device_batch}, {', '.join(args.models)} on {', '.join(backends)}",
                flush=True,
            )
            plan = steps.Plan(batches, args.steps, args.calls, device_dir, args.pjrt_device)
            results["device"] = steps.run_device(args.models, backends, plan)
            phases["device"] = time.time() - started - phases["data"] - phases["host"]
    results["seconds_total"] = time.time() - started
    print()
    if "host" in results:
        print(report.format_host(results["host"]), end="\n\n")
    if "device" in results:
        print(report.format_device(results["device"]), end="\n\n")
    path = harness.write_results(args.out, results)
    seconds = ", ".join(f"{phase} {value:.0f} s" for phase, value in phases.items())
    print(f"wrote {path} ({results['seconds_total']:.0f} s in all: {seconds})")
    return 0


def environment() -> dict:
    # Versions from the installed metadata: importing torch_xla here would start
    # nothing, but the XLA runtime is the children's alone.
    return {**harness.environment(), **{name: version(name) for name in ("timm", "torch_xla")}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return run(args, " ".join([".venv/bin/python", "-m", "bench.augment", *argv]))


if __name__ == "__main__":
    sys.exit(main())
