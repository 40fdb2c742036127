"""tpustream-export: a run's weights as ``model.safetensors`` plus what rebuilds the model without tpustream.

For model=timm the folder is what timm's own ``save_for_hf`` writes (the
weights and a ``config.json`` with the architecture and its arguments), so
``timm.create_model("local-dir:FOLDER", pretrained=True)`` loads it. For
torchvision and the built-in families, ``config.json`` names the library,
model, class count and options to build before ``load_state_dict``. Either
way ``tpustream.json`` beside them keeps the run's resolved config.

    tpustream-export RUN_FOLDER                  # best.pt -> RUN_FOLDER/export/
    tpustream-export gs://BUCKET/runs/r1 --checkpoint last --out /tmp/r1-model
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
from tpustream.errors import ConfigError, TpustreamError
from tpustream.models.pretrained import classifier_names
from tpustream.models.registry import create_model

EXPORT_FOLDER = "export"


def rebuild_arguments(model_cfg: dict, weights: dict[str, torch.Tensor], data_cfg: dict) -> dict:
    """num_classes, channels and image_size that build a model with exactly these weights' shapes.

    Checkpoints record the config, not the data's shapes: they are read back
    from the weights by building candidates on the meta device.
    """
    library, name, options = (
        model_cfg.get("library", "tpustream"),
        model_cfg["name"],
        model_cfg.get("options", {}),
    )
    sizes = [s for s in (data_cfg.get("image_size"), 32, 224) if s]
    wanted = {key: tuple(t.shape) for key, t in weights.items()}
    for channels in (data_cfg.get("channels") or 3, 1, 3):
        for image_size in sizes:
            try:
                with torch.device("meta"):
                    probe = create_model(
                        name,
                        num_classes=1,
                        image_size=image_size,
                        channels=channels,
                        library=library,
                        **options,
                    )
                    heads = [k for k in classifier_names(probe) if k in wanted and len(wanted[k]) == 2]
                    if not heads:
                        continue
                    num_classes = wanted[heads[0]][0]
                    model = create_model(
                        name,
                        num_classes=num_classes,
                        image_size=image_size,
                        channels=channels,
                        library=library,
                        **options,
                    )
            except (ConfigError, TypeError, ValueError, RuntimeError):
                continue
            if {key: tuple(t.shape) for key, t in model.state_dict().items()} == wanted:
                return {"num_classes": num_classes, "channels": channels, "image_size": image_size}
    raise ConfigError(
        f"cannot rebuild model {library}/{name} with options {options} from the checkpoint's weights"
    )


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


def export_checkpoint(url: str, out: str, weights: str = "auto") -> list[str]:
    """Write the checkpoint's model (weights: raw, ema or auto) to out (local or gs://); the names written."""
    from safetensors.torch import save_file

    from tpustream.checkpoint import load_checkpoint

    state = load_checkpoint(url)
    config = state.get("config") or {}
    model_cfg = config.get("model")
    if not model_cfg:
        raise ConfigError(f"{url}: the checkpoint holds no model config to rebuild the model from")
    weights = chosen_weights(state, url, weights)
    arguments = rebuild_arguments(model_cfg, weights, config.get("data", {}))
    library, name, options = (
        model_cfg.get("library", "tpustream"),
        model_cfg["name"],
        model_cfg.get("options", {}),
    )
    model = create_model(name, library=library, **arguments, **options)
    model.load_state_dict(weights)
    with tempfile.TemporaryDirectory(prefix="tpustream-export-") as folder:
        if library == "timm":
            from timm.models import save_for_hf

            model_args = {
                "num_classes": arguments["num_classes"],
                "in_chans": arguments["channels"],
                **options,
            }
            save_for_hf(model, folder, model_args=model_args, safe_serialization=True)
        else:
            save_file(
                {k: v.contiguous() for k, v in model.state_dict().items()}, f"{folder}/model.safetensors"
            )
            description = {
                "library": library,
                "name": name,
                "num_classes": arguments["num_classes"],
                **options,
            }
            if library == "tpustream":
                description.update(channels=arguments["channels"], image_size=arguments["image_size"])
            with open(f"{folder}/config.json", "w") as file:
                json.dump(description, file, indent=2)
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
    args = parser.parse_args(argv)
    run = storage.absolute(args.run)
    url = run if run.endswith(".pt") else storage.join(run, "checkpoints", f"{args.checkpoint}.pt")
    out = storage.absolute(args.out) if args.out else storage.join(run, EXPORT_FOLDER)
    try:
        names = export_checkpoint(url, out, args.weights)
    except TpustreamError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {url} to {out}: {', '.join(names)}")
    return 0
