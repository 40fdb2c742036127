"""tpustream-export: a run's weights as ``model.safetensors`` plus what rebuilds the model without tpustream.

For model=timm the folder is what timm's own ``save_for_hf`` writes (the
weights and a ``config.json`` with the architecture and its arguments), so
``timm.create_model("local-dir:FOLDER", pretrained=True)`` loads it. For
torchvision and the built-in families, ``config.json`` names the library,
model, class count and options to build before ``load_state_dict``. Either
way ``tpustream.json`` beside them keeps the run's resolved config.

    tpustream-export RUN_FOLDER                  # best.pt -> RUN_FOLDER/export/
    tpustream-export gs://BUCKET/runs/r1 --checkpoint last --out /tmp/r1-model

The preprocessing is the run's evaluation transform, in timm's data-config
fields: ``input_size`` [C, H, W], ``interpolation``, ``crop_pct``,
``crop_mode`` ("center"), ``mean`` and ``std`` (data.mean / data.std, on the
0..1 scale). H x W is data.image_size, else what the run read from its
validation shards (read again here), else ``--image-size``. It is
``pretrained_cfg`` in a timm export, with none of the fields timm keeps for
its own weights of the name (tag, hub id, license, test size), which timm
reads back by itself::

    model = timm.create_model("local-dir:FOLDER", pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))

and ``preprocessing`` in the others' ``config.json``, from which torchvision
builds the same transform (``p = config["preprocessing"]``, ``c, h, w =
p["input_size"]``)::

    transform = T.Compose([
        T.Resize(math.floor(min(h, w) / p["crop_pct"]), T.InterpolationMode(p["interpolation"])),
        T.CenterCrop((h, w)), T.ToTensor(), T.Normalize(p["mean"], p["std"])])

Either takes PIL images converted as the run decoded them: ``.convert("RGB")``
for 3 channels, ``.convert("L")`` for 1. What the run did, by data.train_crop:

- pad_crop: every image was decoded at its stored size, H x W, and only
  normalised (crop_pct 1.0): images of that size pass the resize and crop
  unchanged, so the transform is the run's exactly. The run refused images of
  other sizes; the transform resizes them (bilinear) instead.
- random_resized: the shorter side resized to floor(H / data.eval_crop_ratio),
  then the centre H x H (crop_pct = data.eval_crop_ratio, as timm computes it).
  The run resampled with torch's antialiased bilinear filter on uint8 pixels,
  JPEGs decoded at 1/2, 1/4 or 1/8 scale when the resize shrinks them that much
  anyway; PIL's bilinear on the full decode is the closest timm and torchvision
  express. On the digits PNGs it differs by at most 2 of 255 in 3.5% of the
  pixels when enlarging 32 px to 36 (at most 1 when shrinking); the one run
  measured scored the same either way (291/359).

data.stages (the user's own stages) also ran on validation samples: no config
expresses them, and they are not in the transform.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence

import torch

from tpustream import storage
from tpustream.config import DataConfig, TrainCrop
from tpustream.errors import ConfigError, TpustreamError
from tpustream.models.registry import create_model, describe_exception
from tpustream.models.shapes import describe_state_difference

EXPORT_FOLDER = "export"
# What the run's evaluation resized with (crops.decode_crop), in timm's and torchvision's names.
EVAL_INTERPOLATION = "bilinear"
# The fields of timm's pretrained_cfg that describe the architecture. The
# others (tag, hf_hub_id, license, paper_ids, test_input_size, mean, ...)
# describe the library's own weights and their preprocessing, not the run's.
TIMM_ARCHITECTURE_FIELDS = (
    "architecture",
    "num_classes",
    "input_size",  # the library's; save_for_hf compares it with the export's to drop pool_size
    "pool_size",
    "first_conv",
    "classifier",
    "fixed_input_size",
    "min_input_size",
)


def parse_image_size(text: str) -> tuple[int, int]:
    """--image-size: SIDE or HEIGHTxWIDTH, in pixels."""
    try:
        sides = tuple(int(part) for part in text.lower().split("x"))
    except ValueError:
        sides = ()
    if len(sides) not in (1, 2) or min(sides) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not SIDE or HEIGHTxWIDTH in pixels, e.g. 32 or 32x48")
    return (sides[0], sides[-1])


def is_random_resized(data: dict) -> bool:
    """Whether the run cropped (data.train_crop=random_resized) rather than took images as stored."""
    return TrainCrop(data.get("train_crop", TrainCrop.pad_crop)) == TrainCrop.random_resized


def evaluated_image_size(config: dict) -> tuple[int, int]:
    """(height, width) of the images the run evaluated: data.image_size, else its validation split's.

    The checkpoint's config holds data.image_size only where the run set it;
    otherwise the run took the size from its shards, which are read here as
    it read them (recorded counts only, nothing counted or written).
    """
    from tpustream.data.resolve.options import SplitOptions
    from tpustream.data.resolve.split import load_split

    data = config.get("data") or {}
    if data.get("image_size"):
        return (data["image_size"], data["image_size"])
    where = data.get("val_shards")
    if not where:
        raise ConfigError("the checkpoint's config names no validation shards to read the image size from")
    options = SplitOptions(
        image_key=data.get("image_key"),
        num_classes=data.get("num_classes"),
        channels=data.get("channels"),
        crop=is_random_resized(data),
        allow_counting=False,
        output_dir=config.get("output_dir"),
        progress=False,
    )
    manifest = load_split(where, "validation", options)
    if manifest.image_size is None:
        raise ConfigError(f"the validation shards {where} hold images of several sizes")
    return manifest.image_size


def evaluation_preprocessing(config: dict, channels: int, image_size: tuple[int, int]) -> dict:
    """The run's evaluation transform as timm's data-config fields (the module docstring says how exact)."""
    data = config.get("data") or {}
    if not data.get("mean") or not data.get("std"):
        raise ConfigError("the checkpoint's config holds no data.mean and data.std to normalise with")
    # pad_crop takes images as stored: a crop ratio of 1 resizes and crops those of its size to themselves.
    crop_ratio = data.get("eval_crop_ratio", DataConfig.eval_crop_ratio) if is_random_resized(data) else 1.0
    return {
        "input_size": [channels, *image_size],
        "interpolation": EVAL_INTERPOLATION,
        "crop_pct": float(crop_ratio),
        "crop_mode": "center",
        "mean": [float(value) for value in data["mean"]],
        "std": [float(value) for value in data["std"]],
    }


def save_timm_export(model: torch.nn.Module, folder: str, model_args: dict, preprocessing: dict) -> None:
    """timm's save_for_hf folder whose pretrained_cfg holds the run's preprocessing and no weight source."""
    from timm.models import save_for_hf

    # save_for_hf starts from the model's pretrained_cfg: the library's
    # default for the name (e.g. resnet18's "a1_in1k" tag, ImageNet mean and
    # bicubic at 224), whatever the run started from. Only the architecture's
    # fields stay; the preprocessing is the run's, through data_config.
    library_cfg = model.pretrained_cfg
    model.pretrained_cfg = {k: library_cfg[k] for k in TIMM_ARCHITECTURE_FIELDS if k in library_cfg}
    save_for_hf(model, folder, model_args=model_args, safe_serialization=True, data_config=preprocessing)


def rebuild_arguments(model_cfg: dict, weights: dict[str, torch.Tensor], data_cfg: dict) -> dict:
    """num_classes, channels and image_size that build the config's model with exactly these weights' shapes.

    data.num_classes and data.channels are the run's where its config sets
    them. A run that took them from its shards' manifest (data.* left unset,
    the usual case) recorded neither, and they are read back from the weights
    (count_classes). image_size is the side the run evaluated (data_cfg's).
    Either way the model is built on the meta device and every tensor's shape
    is compared, so a class count that does not fit is named, not loaded.
    """
    library, name, options = (
        model_cfg.get("library", "tpustream"),
        model_cfg["name"],
        model_cfg.get("options") or {},
    )
    where = f"model {library}/{name} with options {options}"
    image_size = data_cfg["image_size"]
    wanted = {key: tuple(t.shape) for key, t in weights.items()}

    def shapes_built(num_classes: int, channels: int) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):
            try:
                model = create_model(
                    name,
                    num_classes=num_classes,
                    image_size=image_size,
                    channels=channels,
                    library=library,
                    **options,
                )
            except ConfigError:
                raise
            except Exception as exc:  # the constructor refused: its own words
                raise ConfigError(describe_exception(exc)) from None
        return {key: tuple(t.shape) for key, t in model.state_dict().items()}

    # Unset in the config: 3 channels first, as most runs have (the 1-channel
    # candidate would read a 3-channel stem as a class count; the full
    # comparison below refuses that).
    candidates = [data_cfg["channels"]] if data_cfg.get("channels") else [3, 1]
    reasons = []
    for channels in candidates:
        try:
            num_classes = data_cfg.get("num_classes") or count_classes(shapes_built(1, channels), wanted)
            built = shapes_built(num_classes, channels)
            difference = describe_state_difference(built, wanted, "saved", "rebuilt")
        except ConfigError as exc:
            reasons.append(f"on {channels} channel(s): {exc}")
            continue
        if difference is None:
            return {"num_classes": num_classes, "channels": channels, "image_size": image_size}
        given = "data.num_classes" if data_cfg.get("num_classes") else "read from the weights"
        reasons.append(f"with {num_classes} classes ({given}) on {channels} channel(s), {difference}")
    raise ConfigError(f"cannot rebuild {where} from the checkpoint's weights: {reasons[0]}")


def count_classes(one_class: dict[str, tuple[int, ...]], wanted: dict[str, tuple[int, ...]]) -> int:
    """The class count of weights `wanted`, from the shapes of the same model built for one class.

    The tensors whose shapes differ are the head, whatever its kind (a Linear,
    a Sequential ending in one, SqueezeNet's 1x1 convolution, a ViT's head and
    distillation head): a dimension that is 1 there and N in the weights says
    N classes. Reading the head by its name or layer type missed the kinds
    that are not a 2-D Linear weight.
    """
    counts = {
        saved
        for key, built in one_class.items()
        if key in wanted and len(wanted[key]) == len(built)
        for built_side, saved in zip(built, wanted[key], strict=True)
        if built_side == 1 and saved != 1
    }
    if len(counts) > 1:
        raise ConfigError(f"the weights' shapes give several class counts ({sorted(counts)}), not one")
    return counts.pop() if counts else 1


def chosen_weights(state: dict, url: str, weights: str) -> dict[str, torch.Tensor]:
    """The checkpoint's raw weights or their average (ema); auto: the ones its run's best.pt followed."""
    config = state.get("config") or {}
    if weights == "auto":
        weights = (config.get("ema") or {}).get("select_best", "raw")
    if weights == "raw":
        return state["model"]
    if state.get("ema") is None:
        raise ConfigError(f"{url} holds no weight average (its run had no ema.decay): export --weights raw")
    return state["ema"]


def export_checkpoint(
    url: str, out: str, weights: str = "auto", image_size: tuple[int, int] | None = None
) -> list[str]:
    """Write the checkpoint's model (weights: raw, ema or auto) to out (local or gs://); the names written.

    image_size: (height, width) of the run's images, when neither its config
    nor its validation shards (read from here) say it.
    """
    from tpustream.checkpoint import load_checkpoint

    state = load_checkpoint(url)
    config = state.get("config") or {}
    model_cfg = config.get("model")
    if not model_cfg:
        raise ConfigError(f"{url}: the checkpoint holds no model config to rebuild the model from")
    if image_size is None:
        try:
            image_size = evaluated_image_size(config)
        except TpustreamError as exc:
            raise ConfigError(
                f"{url}: cannot tell the size of the images the run evaluated ({exc}); "
                "give it with --image-size"
            ) from None
    weights = chosen_weights(state, url, weights)
    data_cfg = {**config.get("data", {}), "image_size": max(image_size)}  # the side models are built for
    arguments = rebuild_arguments(model_cfg, weights, data_cfg)
    library = model_cfg.get("library", "tpustream")
    model = create_model(model_cfg["name"], library=library, **arguments, **model_cfg.get("options", {}))
    model.load_state_dict(weights)
    preprocessing = evaluation_preprocessing(config, arguments["channels"], image_size)
    with tempfile.TemporaryDirectory(prefix="tpustream-export-") as folder:
        write_model_files(folder, model, model_cfg, arguments, preprocessing)
        run = {
            "checkpoint": url,
            "weights": "ema" if weights is state.get("ema") else "raw",
            "epoch": state.get("epoch"),
            "best_accuracy": state.get("best_accuracy"),
        }
        with open(f"{folder}/tpustream.json", "w") as file:
            json.dump({**run, "config": config}, file, indent=2, default=str)
        names = sorted(os.listdir(folder))
        for file_name in names:
            with open(os.path.join(folder, file_name), "rb") as file:
                storage.write_bytes(storage.join(out, file_name), file.read())
    return names


def write_model_files(
    folder: str, model: torch.nn.Module, model_cfg: dict, arguments: dict, preprocessing: dict
) -> None:
    """model.safetensors and config.json: timm's own format, or ours for torchvision and built-ins."""
    from safetensors.torch import save_file

    library, name, options = (
        model_cfg.get("library", "tpustream"),
        model_cfg["name"],
        model_cfg.get("options", {}),
    )
    if library == "timm":
        model_args = {"num_classes": arguments["num_classes"], "in_chans": arguments["channels"], **options}
        save_timm_export(model, folder, model_args, preprocessing)
        return
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{folder}/model.safetensors")
    description = {"library": library, "name": name, "num_classes": arguments["num_classes"], **options}
    if library == "tpustream":
        description.update(channels=arguments["channels"], image_size=arguments["image_size"])
    description["preprocessing"] = preprocessing
    with open(f"{folder}/config.json", "w") as file:
        json.dump(description, file, indent=2)


def refuse_synthetic_run(run: str, url: str) -> None:
    """A synthetic run's folder (data.synthetic) has no checkpoint: say why, not that one is missing."""
    from tpustream.checkpoint import read_metrics
    from tpustream.observe.synthetic_rate import is_synthetic

    if not run.endswith(".pt") and not storage.exists(url) and is_synthetic(read_metrics(run)):
        raise ConfigError(
            f"{run} is a synthetic run (data.synthetic): it trained on one generated batch, not on data, "
            "and wrote no checkpoint to export"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tpustream-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run folder (local or gs://), or a checkpoint file")
    parser.add_argument(
        "--checkpoint", choices=("best", "last"), default="best", help="in a run folder (default best)"
    )
    parser.add_argument("--out", help="where to write (default: RUN/export)")
    parser.add_argument(
        "--weights",
        choices=("auto", "raw", "ema"),
        default="auto",
        help="the trained weights or their average (ema.decay); auto: what ema.select_best chose",
    )
    parser.add_argument(
        "--image-size",
        type=parse_image_size,
        help="SIDE or HEIGHTxWIDTH of the run's images, where its config and shards cannot say",
    )
    args = parser.parse_args(argv)
    run = storage.absolute(args.run)
    url = run if run.endswith(".pt") else storage.join(run, "checkpoints", f"{args.checkpoint}.pt")
    out = storage.absolute(args.out) if args.out else storage.join(run, EXPORT_FOLDER)
    try:
        refuse_synthetic_run(run, url)
        names = export_checkpoint(url, out, args.weights, args.image_size)
    except TpustreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {url} to {out}: {', '.join(names)}")
    return 0
