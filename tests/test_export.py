"""tpustream-export: a run's model leaves tpustream and loads with timm or torchvision alone."""

from __future__ import annotations

import glob
import io
import json
import math
import os
import tarfile

import pytest
import torch
from PIL import Image

from tpustream import storage
from tpustream.checkpoint import encode_checkpoint
from tpustream.models import create_model
from tpustream.models.export import main as export_main

# A run's data section as far as the export reads it (a real run's holds every data.* field).
DATA = {"image_size": 32, "channels": None, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}


def write_run(folder: str, model_cfg: dict, weights: dict, data: dict | None = None) -> str:
    config = {"model": model_cfg, "data": data or DATA}
    state = {"model": weights, "config": config, "epoch": 4, "best_accuracy": 0.93}
    storage.write_bytes(f"{folder}/checkpoints/best.pt", encode_checkpoint(state))
    return folder


def test_a_timm_run_exports_to_what_timm_loads_by_itself(tmp_path):
    import timm

    options = {"img_size": 32, "patch_size": 4}
    torch.manual_seed(3)
    model = create_model(
        "vit_tiny_patch16_224", num_classes=10, image_size=32, channels=3, library="timm", **options
    )
    run = write_run(
        str(tmp_path / "run"),
        {"library": "timm", "name": "vit_tiny_patch16_224", "options": options},
        model.state_dict(),
    )
    assert export_main([run]) == 0
    assert sorted(os.listdir(f"{run}/export")) == ["config.json", "model.safetensors", "tpustream.json"]
    loaded = timm.create_model(f"local-dir:{run}/export", pretrained=True)  # timm alone
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    # The run's preprocessing, not the library's for its own weights (augreg_in21k_ft_in1k's).
    saved = json.loads((tmp_path / "run" / "export" / "config.json").read_text())["pretrained_cfg"]
    assert not {"tag", "license", "origin_url", "paper_ids", "hf_hub_id", "test_input_size"} & saved.keys()
    assert (saved["input_size"], saved["mean"], saved["crop_pct"]) == ([3, 32, 32], DATA["mean"], 1.0)
    assert json.loads((tmp_path / "run" / "export" / "tpustream.json").read_text())["best_accuracy"] == 0.93


def test_torchvision_and_built_in_runs_export_weights_and_how_to_build_them(tmp_path, capsys):
    from safetensors.torch import load_file

    resnet = create_model("resnet18", num_classes=7, image_size=32, channels=3, library="torchvision")
    run = write_run(
        str(tmp_path / "tv"),
        {"library": "torchvision", "name": "resnet18", "options": {}},
        resnet.state_dict(),
    )
    assert export_main([run, "--out", str(tmp_path / "tv-out")]) == 0
    described = json.loads((tmp_path / "tv-out" / "config.json").read_text())
    preprocessing = {
        "input_size": [3, 32, 32],
        "interpolation": "bilinear",
        "crop_pct": 1.0,  # data.train_crop=pad_crop: images taken as stored
        "crop_mode": "center",
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25],
    }
    assert described == {
        "library": "torchvision",
        "name": "resnet18",
        "num_classes": 7,
        "preprocessing": preprocessing,
    }
    import torchvision

    rebuilt = torchvision.models.get_model("resnet18", num_classes=described["num_classes"])
    rebuilt.load_state_dict(load_file(str(tmp_path / "tv-out" / "model.safetensors")))
    # A built-in family on 1-channel 24 px images: its shapes are read back from the weights.
    # Cropped at evaluation (random_resized), data.image_size unset and no shards to read it from.
    cnn = create_model("small_cnn", num_classes=5, image_size=24, channels=1, width=8)
    data = {
        "image_size": None,
        "mean": [0.4],
        "std": [0.2],
        "train_crop": "random_resized",
        "eval_crop_ratio": 0.9,
    }
    run = write_run(
        str(tmp_path / "cnn"), {"name": "small_cnn", "options": {"width": 8}}, cnn.state_dict(), data
    )
    assert export_main([run, "--out", str(tmp_path / "cnn-out")]) == 2
    assert "give it with --image-size" in capsys.readouterr().err
    best = f"{run}/checkpoints/best.pt"
    assert export_main([best, "--out", str(tmp_path / "cnn-out"), "--image-size", "24"]) == 0
    described = json.loads((tmp_path / "cnn-out" / "config.json").read_text())
    assert (described["num_classes"], described["channels"], described["width"]) == (5, 1, 8)
    assert described["preprocessing"] == {
        **preprocessing,
        "input_size": [1, 24, 24],
        "crop_pct": 0.9,
        "mean": [0.4],
        "std": [0.2],
    }


# Heads that are not a 2-D Linear weight read by its name, each in a small build (no weights downloaded).
UNUSUAL_HEADS = [
    ("torchvision", "squeezenet1_1", {}),  # a 1x1 convolution (classifier.1) before the pooling
    ("torchvision", "mobilenet_v3_small", {}),  # a Sequential classifier: Linear, Hardswish, Dropout, Linear
    ("timm", "test_convnext", {}),  # head.fc after head.norm
    # head and head_dist, both of the class count; 32 px, one block
    ("timm", "deit_tiny_distilled_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 1}),
]


@pytest.mark.parametrize("library, name, options", UNUSUAL_HEADS, ids=[case[1] for case in UNUSUAL_HEADS])
def test_classifiers_with_any_head_export_and_load_with_their_library_alone(
    tmp_path, capsys, library, name, options
):
    """The class count comes from data.num_classes where the run set it, else from the weights' shapes;
    a count that does not fit the weights is one line naming the tensor (squeezenet1_1: 'cannot rebuild
    model torchvision/squeezenet1_1 with options {}' and nothing more, before)."""
    from safetensors.torch import load_file

    torch.manual_seed(5)
    model = create_model(name, num_classes=10, image_size=32, channels=3, library=library, **options)
    model_cfg = {"library": library, "name": name, "options": options}
    for recorded in (None, 10):  # the shards' count (not in the config), then data.num_classes=10
        run = write_run(
            str(tmp_path / f"run-{recorded}"),
            model_cfg,
            model.state_dict(),
            {**DATA, "num_classes": recorded},
        )
        out = tmp_path / f"export-{recorded}"
        assert export_main([run, "--out", str(out)]) == 0, capsys.readouterr().err
        if library == "timm":
            import timm

            loaded = timm.create_model(f"local-dir:{out}", pretrained=True)
        else:
            import torchvision

            described = json.loads((out / "config.json").read_text())
            assert (described["name"], described["num_classes"]) == (name, 10)
            loaded = torchvision.models.get_model(name, num_classes=described["num_classes"])
            loaded.load_state_dict(load_file(str(out / "model.safetensors")))
        for key, tensor in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], tensor), key
    run = write_run(str(tmp_path / "wrong"), model_cfg, model.state_dict(), {**DATA, "num_classes": 4})
    assert export_main([run]) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1
    assert f"cannot rebuild model {library}/{name}" in error
    assert "with 4 classes (data.num_classes) on 3 channel(s)" in error and "saved" in error


@pytest.mark.slow
def test_a_torchvision_classifier_of_every_family_built_on_the_meta_device_exports():
    """Shapes only (meta device): one classifier of each torchvision module (resnet, vgg, squeezenet,
    googlenet, inception, vision_transformer, ...) has its class count read back from its weights.

    One a family: its members share their head (every classifier took 46 s of the suite). The
    regnets are left out: their constructors read tensor values, which the meta device has not,
    so the checks before spawning refuse them too.
    """
    import torchvision

    from tpustream.models.export import rebuild_arguments
    from tpustream.models.from_torchvision import classifier_names

    families: dict[str, str] = {}
    for name in sorted(classifier_names()):
        families.setdefault(torchvision.models.get_model_builder(name).__module__, name)
    assert len(families) >= 15  # alexnet, convnext, densenet, ... vit: torchvision's 20 or so
    for name in families.values():
        if name.startswith("regnet_"):
            continue
        with torch.device("meta"):
            weights = create_model(name, num_classes=7, image_size=224, channels=3, library="torchvision")
        model_cfg = {"library": "torchvision", "name": name, "options": {}}
        rebuilt = rebuild_arguments(model_cfg, weights.state_dict(), {"image_size": 224})
        assert (rebuilt["num_classes"], rebuilt["channels"]) == (7, 3), name


def test_export_errors_are_one_line(tmp_path, capsys):
    assert export_main([str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit):
        export_main([str(tmp_path), "--checkpoint", "middle"])


def test_the_weight_average_exports_when_best_followed_it_or_when_asked(tmp_path, capsys):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    raw = create_model("small_cnn", num_classes=5, image_size=24, channels=1, width=8).state_dict()
    average = {name: tensor + 1 if tensor.is_floating_point() else tensor for name, tensor in raw.items()}
    config = {
        "model": {"name": "small_cnn", "options": {"width": 8}},
        "data": {**DATA, "image_size": 24, "mean": [0.5], "std": [0.25]},
        "ema": {"decay": 0.99, "select_best": "ema"},
    }
    url = str(tmp_path / "best.pt")
    storage.write_bytes(url, encode_checkpoint({"model": raw, "ema": average, "config": config}))
    for weights, want in (("auto", average), ("raw", raw), ("ema", average)):
        out = tmp_path / weights
        assert export_main([url, "--out", str(out), "--weights", weights]) == 0
        got = load_file(str(out / "model.safetensors"))
        assert all(torch.equal(got[name], tensor) for name, tensor in want.items())
        chosen = json.loads((out / "tpustream.json").read_text())["weights"]
        assert chosen == ("raw" if weights == "raw" else "ema")
    storage.write_bytes(url, encode_checkpoint({"model": raw, "ema": None, "config": config}))
    assert export_main([url, "--out", str(tmp_path / "none"), "--weights", "ema"]) == 2
    assert "holds no weight average" in capsys.readouterr().err


def validation_images(root: str) -> list[tuple[Image.Image, int]]:
    """The digits test split as a user has it: PIL images and labels, read from the tars without tpustream."""
    samples = []
    for path in sorted(glob.glob(f"{root}/test/*.tar")):
        with tarfile.open(path) as tar:
            members = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        for name in sorted(n for n in members if n.endswith(".png")):
            image = Image.open(io.BytesIO(members[name])).convert("RGB")
            samples.append((image, int(members[name.removesuffix(".png") + ".cls"])))
    return samples


def correct_predictions(model: torch.nn.Module, transform, samples: list[tuple[Image.Image, int]]) -> int:
    images = torch.stack([transform(image) for image, _ in samples])
    labels = torch.tensor([label for _, label in samples])
    with torch.no_grad():
        return int((model.eval()(images).argmax(1) == labels).sum())


def train_and_export(digits_root: str, folder, *overrides: str) -> tuple[str, int]:
    """One epoch of digits (data.image_size unset: 32 px from the shards); (export folder, val_correct)."""
    from tests.conftest import run_train
    from tpustream.checkpoint import checkpoint_url, load_checkpoint, read_metrics

    run = str(folder / "run")
    result = run_train(
        f"data.root={digits_root}",
        *overrides,
        "epochs=1",
        "batch_size=32",
        "data.num_workers=0",
        "accelerator=cpu_eager",
        "accelerator.in_process=true",
        f"output_dir={run}",
        f"hydra.run.dir={folder}/h",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert export_main([run, "--out", str(folder / "export")]) == 0
    best = load_checkpoint(checkpoint_url(run, "best.pt"))
    return str(folder / "export"), read_metrics(run)[best["epoch"]]["val_correct"]


@pytest.mark.slow
def test_a_timm_export_scores_what_its_run_scored_with_timms_own_transform(digits_root, tmp_path):
    """timm alone rebuilds model and transform and gets the run's count exactly.

    Exact: the run's evaluation takes the 32 px images as stored and
    normalises them, which timm's transform reproduces (its resize and crop
    leave 32 px images as they are); the arithmetic differs only by rounding
    (one multiply-add, other batches), and no prediction is that close to a tie.
    Measured: 333/359 both; the export before the fix (ImageNet-style 160 px,
    bicubic, crop 0.95, mean/std 0.5, tag r160_in1k) scored 36.
    """
    import timm

    folder, reported = train_and_export(
        digits_root, tmp_path, "model=timm", "model.name=test_convnext", "optim=adamw", "optim.lr=3e-3"
    )
    model = timm.create_model(f"local-dir:{folder}", pretrained=True)
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(model))
    assert correct_predictions(model, transform, validation_images(digits_root)) == reported


@pytest.mark.slow
def test_a_built_in_export_scores_what_its_run_scored_with_its_config(digits_root, tmp_path):
    """config.json's preprocessing, built with torchvision as the export module's docstring shows.

    Exact for the reason the timm test gives.
    """
    import torchvision.transforms as T
    from safetensors.torch import load_file

    folder, reported = train_and_export(digits_root, tmp_path, "model=small_cnn")
    with open(f"{folder}/config.json") as file:
        config = json.load(file)
    p = config.pop("preprocessing")
    _, h, w = p["input_size"]
    transform = T.Compose(
        [
            T.Resize(math.floor(min(h, w) / p["crop_pct"]), T.InterpolationMode(p["interpolation"])),
            T.CenterCrop((h, w)),
            T.ToTensor(),
            T.Normalize(p["mean"], p["std"]),
        ]
    )
    model = create_model(config.pop("name"), library=config.pop("library"), **config)
    model.load_state_dict(load_file(f"{folder}/model.safetensors"))
    assert correct_predictions(model, transform, validation_images(digits_root)) == reported
