"""ImageNet-like JPEGs, 224 crops: stock PyTorch/WebDataset against tpustream's crops.

Reproduce (from the repository root; about 6 minutes on 2 idle cores):

    .venv/bin/python -m bench.pipeline --dataset imagenet          # 3072 images -> results/imagenet/
    .venv/bin/python -m bench.pipeline --dataset imagenet --quick  # 512 -> results/imagenet/quick/

Data (bench.pipeline.imagenet_data): --num-images JPEGs cut from scikit-learn's
two sample photographs to ImageNet's spread of sizes and bytes per pixel, with
its few grayscale, CMYK and PNG-named files; labels are index % 10. The same
bytes are written as an ImageFolder tree, as ShardWriter tar shards (256
samples a shard) in a local folder, and as the same shards in a bucket of the
GCS emulator.

Transforms ("stock", as the issue defines L): training PIL decode +
convert("RGB") + Compose([RandomResizedCrop(224), RandomHorizontalFlip(),
ToTensor()]); evaluation the same with Resize(256) + CenterCrop(224) instead
of the first two. tpustream draws the same crops
(tpustream.data.read.crops: RandomResizedCrop's parameters draw for draw, flips;
evaluation resizes the shorter side to 224 / 0.875 = 256 and takes the centre)
but decodes at libjpeg-turbo's DCT-domain 1/2, 1/4 or 1/8 scale where the
crop is shrunk at least that much anyway, and resamples in uint8 (see that
module for how); its batches are uint8 (B, 3, 224, 224), what the trainer
receives: it normalises them on the device, inside the compiled step, so
the host never converts them to float (what converting them on the host
would cost is printed). Batches hold 128 samples.

Configurations, each in training (train) and evaluation (eval) form unless
said otherwise (w = DataLoader num_workers, measured with 0 and 2):

    L_decode       the decode limit: decoding the in-memory bytes and nothing
                   else, one process, in batches of 128 (a list, no stacking).
                   Measured three times, with PIL (Image.open(BytesIO(b)).load()),
                   torchvision.io.decode_jpeg (decode_image for the PNGs) and
                   simplejpeg.decode_jpeg (TurboJPEG's API, which
                   tpustream.data.read.crops decodes with; PIL for what it refuses),
                   all libjpeg-turbo; the fastest is the limit (printed; all in
                   results.json). One row, no mode.
    L              the stock limit: PIL decode + stock transforms + torch.stack
                   from the bytes in memory, one process, no I/O.
    L_ours         our limit: tpustream.data.read.crops (CroppingDecoder(ImageDecoder(3,
                   224, 224, 10, image_key="jpg"), ...).for_epoch(0) on sample dicts
                   {"jpg": bytes, "cls": b"<label>", "__id__": index}) through the
                   decode_samples and batch_samples stages (uint8 batches);
                   one process, no tar, no I/O.
    A  (w)         torchvision ImageFolder over the files + stock transforms,
                   DataLoader(batch_size=128, shuffle=train).
    B  (w)         the reference ImageNet WebDataset chain on the local shards:
                   WebDataset(urls, shardshuffle=100).shuffle(1000).decode("pil")
                   .to_tuple("jpg", "cls").map_tuple(stock_transform, int).batched(128)
                   in DataLoader(batch_size=None); eval: shardshuffle=False and no
                   .shuffle.
    C  (w)         B reading the gs:// shards from the emulator. webdataset opens
                   gs:// with a `gsutil cat` subprocess and gsutil is not installed,
                   so an in-process opener in webdataset.gopen.gopen_schemes returns
                   tpustream.storage.open_read.
    ours-local (w) tpustream's ShardStream(train_crop="random_resized",
                   eval_crop_ratio=0.875, hflip, shuffle_buffer=1000 (train),
                   last_batch="drop") through make_loader, as the trainer builds it,
                   on the local shards. The split comes from
                   tpustream.data.resolve.split.load_split(folder, "train",
                   SplitOptions(num_classes=10, image_size=224, crop=True)), which
                   counts the shards and saves tpustream-index.json, once, before
                   any timing.
    ours-gcs (w)   the same on the gs:// shards (its index saved in the bucket).
    ours-nodct-local (w=0 only)
                   ours-local with DCT-domain downscaling off (the stream's
                   CroppingDecoder replaced by one with use_dct=False): what
                   that trick buys.

Timing: one untimed warm-up of the first 4 batches of a pass (a whole pass
here takes seconds to a minute), then full timed passes, repeated until at
least --min-seconds have been measured. The clock of a pass starts when its
first batch arrives and only samples after that batch count, so DataLoader
worker start-up (and filling the first shuffle buffer) is not charged to any
configuration. samples/s = counted samples / measured wall seconds.
torch.set_num_threads(1) is set for the whole run so the single-process
configurations get one core like each DataLoader worker. A 0-worker row uses
one core; a 2-worker row both cores of this machine (two workers and the
consuming process). "x L" is relative to L of the same mode (L_decode's to L
train), "x L_decode" to L_decode. The "other load" column is the CPU (in
cores) other programs used meanwhile: above ~0.1 the row was slowed by
someone else and should be rerun. The default --num-images is a multiple of
128 x 2 workers, so no configuration drops or pads a batch.

DCT share, what each choice buys and host normalising: bench.pipeline.imagenet_tricks.

Outputs: OUT/results.json and OUT/imagenet_pipeline.png (samples/s bars, training
and evaluation panels).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

import torch

from bench.pipeline import harness
from bench.pipeline.harness import BATCH_SIZE, SEED, WORKER_COUNTS
from bench.pipeline.imagenet_configs import (
    CONFIGS,
    DECODE_LIMITS,
    EVAL_CROP_RATIO,
    MEAN,
    MODES,
    SHUFFLE_BUFFER,
    STD,
)
from bench.pipeline.imagenet_data import (
    IMAGE_SIZE,
    BenchData,
    describe_data,
    make_photos,
    prepare_data,
)
from bench.pipeline.imagenet_tricks import (
    dct_shares,
    format_tricks,
    measure_tricks,
    normalize_seconds_per_image,
    trick_ratios,
)
from bench.pipeline.report import format_table, plot_bars, pyplot

DEFAULT_NUM_IMAGES = 3072
QUICK_NUM_IMAGES = 512
RESULTS = "results/imagenet"  # under bench/ (quick: results/imagenet/quick)
WARMUP_BATCHES = 4
TRICK_ROUNDS = 5  # quick: 3
RATIOS = (("x L", "x_L"), ("x L_decode", "x_L_decode"))


def run_configs(data: BenchData, min_seconds: float) -> tuple[list[dict], dict]:
    """Every row, L_decode first (the fastest decoder), then each mode's configurations."""
    candidates = {
        decoder: harness.measure_row(
            f"L_decode ({decoder})", functools.partial(build, data, 0, True), min_seconds, WARMUP_BATCHES
        )
        for decoder, build in DECODE_LIMITS.items()
    }
    fastest = max(DECODE_LIMITS, key=lambda decoder: candidates[decoder]["samples_per_s"])
    rows = [{"name": "L_decode", "mode": None, "workers": None, "decoder": fastest, **candidates[fastest]}]
    for mode in MODES:
        build_mode = functools.partial(build_config, data=data, train=mode == "train")
        rows += harness.measure_configs(CONFIGS, build_mode, min_seconds, WARMUP_BATCHES, mode)
    return rows, candidates


def build_config(config: harness.Config, workers: int, data: BenchData, train: bool) -> harness.Epoch:
    return config.build(data, workers, train)


def find_row(rows: list[dict], name: str, mode: str | None = None, workers: int | None = None) -> dict:
    return next(r for r in rows if r["name"] == name and r["mode"] == mode and r["workers"] == workers)


def add_ratios(rows: list[dict]) -> None:
    decode = find_row(rows, "L_decode")["samples_per_s"]
    for r in rows:
        r["x_L"] = r["samples_per_s"] / find_row(rows, "L", r["mode"] or "train")["samples_per_s"]
        r["x_L_decode"] = r["samples_per_s"] / decode


def goal_ratios(rows: list[dict]) -> list[dict]:
    """The ratios issue 11 sets goals for (training, 0 workers = one core), and their eval / 2-worker kin."""

    def ratio(text: str, top: dict, bottom: dict, goal: float | None) -> dict:
        value = top["samples_per_s"] / bottom["samples_per_s"]
        return {"ratio": text, "value": value, "goal": goal, "met": None if goal is None else value >= goal}

    out = []
    for mode in MODES:
        goal = (lambda g: g) if mode == "train" else (lambda g: None)  # the goals are for training crops
        local0 = find_row(rows, "ours-local", mode, 0)
        out += [
            ratio(f"ours-local {mode} w=0 / L {mode}", local0, find_row(rows, "L", mode), goal(2.0)),
            ratio(f"ours-local {mode} w=0 / L_decode", local0, find_row(rows, "L_decode"), goal(0.8)),
            ratio(f"ours-local {mode} w=0 / L_ours {mode}", local0, find_row(rows, "L_ours", mode), None),
        ]
        for workers in WORKER_COUNTS:
            out.append(
                ratio(
                    f"ours-gcs {mode} w={workers} / ours-local {mode} w={workers}",
                    find_row(rows, "ours-gcs", mode, workers),
                    find_row(rows, "ours-local", mode, workers),
                    goal(0.9),
                )
            )
        out.append(
            ratio(
                f"ours-local {mode} w=0 / ours-nodct-local {mode} w=0 (what DCT scaling buys)",
                local0,
                find_row(rows, "ours-nodct-local", mode, 0),
                None,
            )
        )
        out.append(
            ratio(
                f"ours-local {mode} w=2 / B {mode} w=2",
                find_row(rows, "ours-local", mode, 2),
                find_row(rows, "B", mode, 2),
                None,
            )
        )
    return out


def format_ratios(ratios: list[dict]) -> str:
    width = max(len(r["ratio"]) for r in ratios)
    lines = []
    for r in ratios:
        line = f"  {r['ratio']:<{width}}  {r['value']:5.2f}"
        if r["goal"] is not None:
            line += f"   goal >= {r['goal']:.1f}: {'met' if r['met'] else 'NOT met'}"
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Training and evaluation panels of samples/s, with lines at L_decode and the mode's L."""
    plt = pyplot()
    panels = [[r for r in rows if r["mode"] == mode] for mode in MODES]
    fig, axes = plt.subplots(
        2, 1, figsize=(9.5, 0.36 * sum(map(len, panels)) + 2.4), height_ratios=[len(p) for p in panels]
    )
    decode = find_row(rows, "L_decode")
    for ax, mode, panel in zip(axes, MODES, panels, strict=True):
        handles = plot_bars(ax, panel, RATIOS, [decode, find_row(rows, "L", mode)], WORKER_COUNTS)
        ax.set_xlim(0, 1.45 * max(r["samples_per_s"] for r in [*panel, decode]))
        ax.set_title(f"{mode} transforms", fontsize=9)
        ax.legend(handles=handles, loc="upper right", fontsize=7)
    axes[-1].set_xlabel("samples/s (higher is better)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace, command: str) -> int:
    """Every configuration in both modes and the side measurements; results.json and the chart."""
    harness.start_run()
    started = time.time()
    print(f"generating {args.num_images} ImageNet-like images ...", flush=True)
    photos = make_photos(args.num_images, SEED)  # forked before the emulator and its client start
    generated = time.time() - started
    with harness.run_storage("tpustream-bench-imagenet-") as (workdir, bucket, emulator_url):
        print(f"writing files, local shards and gs://{bucket} on {emulator_url}; indexing both", flush=True)
        data, info = prepare_data(photos, workdir, bucket)
        info["generate_seconds"] = generated
        dct = dct_shares(data)
        print(f"{describe_data(info)}\ntorch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")
        harness.print_method(f"warm-up of {WARMUP_BATCHES} batches")
        if args.profile:  # training form
            for name in args.profile:
                harness.profile(name, harness.find_config(CONFIGS, name).build(data, 0, True))
            return 0
        rows, candidates = run_configs(data, args.min_seconds)
        print(f"  tricks: {TRICK_ROUNDS if not args.quick else 3} interleaved rounds ...", flush=True)
        tricks = measure_tricks(data, 3 if args.quick else TRICK_ROUNDS)

    add_ratios(rows)
    decoder = rows[0]["decoder"]
    settings = harness.settings(
        {
            "image_size": IMAGE_SIZE,
            "eval_crop_ratio": EVAL_CROP_RATIO,
            "shuffle_buffer": SHUFFLE_BUFFER,
            "shardshuffle": harness.SHARD_SHUFFLE,
        },
        f"warm-up of {WARMUP_BATCHES} batches, then passes timed from their first batch",
        args.min_seconds,
        MEAN,
        STD,
        {"L_decode": f"fastest of {list(DECODE_LIMITS)}: {decoder}"},
    )
    summary = report(rows, candidates, dct, tricks)
    results = {
        "command": command,
        "seconds_total": time.time() - started,
        "data": info,
        "settings": settings,
        "environment": harness.environment(),
        "decode_candidates": candidates,
        "configs": rows,
        **summary,
    }
    path = harness.write_results(args.out, results)
    chart = args.out / "imagenet_pipeline.png"
    title = (
        f"{args.num_images} ImageNet-like JPEGs ({info['avg_bytes'] / 1000:.0f} KB, "
        f"{info['avg_width']:.0f}x{info['avg_height']:.0f} avg) to 224x224, batch {BATCH_SIZE}, "
        f"1 torch thread, {os.cpu_count()} CPUs"
    )
    plot(rows, chart, title)
    print(f"\nwrote {path} and {chart} ({time.time() - started:.0f} s in all)")
    return 0


def report(rows: list[dict], candidates: dict, dct: dict, tricks: list[dict]) -> dict:
    """Print the table, the decode limit, DCT shares, host normalising, the ratios and the tricks.

    Returns results.json's entries from "ratios" on.
    """
    ratios = goal_ratios(rows)
    normalize_cost = normalize_seconds_per_image()
    local0 = find_row(rows, "ours-local", "train", 0)["samples_per_s"]
    with_normalize = 1.0 / (1.0 / local0 + normalize_cost)
    print(f"\n{format_table(rows, RATIOS)}\n")
    print(
        "L_decode: "
        + ", ".join(f"{name} {c['samples_per_s']:.0f} samples/s" for name, c in candidates.items())
        + f" -> {rows[0]['decoder']} is the decode limit"
    )
    for mode, share in dct.items():
        print(
            f"DCT-domain scaling applies to {100 * share['share_scaled']:.1f}% of the {mode} crops "
            f"(images per scale: {share['images_per_factor']})"
        )
    print(
        f"ours delivers uint8 batches (the trainer normalises on the device); normalising them on the host "
        f"would cost {1000 * normalize_cost:.2f} ms an image: ours-local train w=0 would then be "
        f"~{with_normalize:.0f} samples/s "
        f"({with_normalize / find_row(rows, 'L', 'train')['samples_per_s']:.2f}x L)"
    )
    print(
        "\nratios (a 0-worker row is one core; a 2-worker row uses both cores: two workers, consumer)\n"
        + format_ratios(ratios)
    )
    print("\nwhat each choice buys (one core, training crops, in memory; medians of interleaved rounds)")
    print(format_tricks(tricks))
    return {
        "ratios": ratios,
        "dct_scaling": dct,
        "tricks": tricks,
        "trick_ratios": dict(trick_ratios(tricks)),
        "normalize_ms_per_image": 1000 * normalize_cost,
        "ours_local_train_w0_if_normalised_on_host": with_normalize,
    }
