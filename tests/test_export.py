"""tpustream-export: a run's model leaves tpustream and loads with timm or torchvision alone."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tpustream import storage
from tpustream.checkpoint import encode_checkpoint
from tpustream.models import create_model
from tpustream.models.export import main as export_main


def write_run(folder: str, model_cfg: dict, weights: dict, data: dict | None = None) -> str:
    config = {"model": model_cfg, "data": data or {"image_size": None, "channels": None}}
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
    assert json.loads((tmp_path / "run" / "export" / "tpustream.json").read_text())["best_accuracy"] == 0.93


def test_torchvision_and_built_in_runs_export_weights_and_how_to_build_them(tmp_path):
    from safetensors.torch import load_file

    resnet = create_model("resnet18", num_classes=7, image_size=32, channels=3, library="torchvision")
    run = write_run(
        str(tmp_path / "tv"),
        {"library": "torchvision", "name": "resnet18", "options": {}},
        resnet.state_dict(),
    )
    assert export_main([run, "--out", str(tmp_path / "tv-out")]) == 0
    described = json.loads((tmp_path / "tv-out" / "config.json").read_text())
    assert described == {"library": "torchvision", "name": "resnet18", "num_classes": 7}
    import torchvision

    rebuilt = torchvision.models.get_model("resnet18", num_classes=described["num_classes"])
    rebuilt.load_state_dict(load_file(str(tmp_path / "tv-out" / "model.safetensors")))
    # A built-in family on 1-channel 24 px images: its shapes are read back from the weights.
    cnn = create_model("small_cnn", num_classes=5, image_size=24, channels=1, width=8)
    run = write_run(str(tmp_path / "cnn"), {"name": "small_cnn", "options": {"width": 8}}, cnn.state_dict())
    assert export_main([f"{run}/checkpoints/best.pt", "--out", str(tmp_path / "cnn-out")]) == 0
    described = json.loads((tmp_path / "cnn-out" / "config.json").read_text())
    assert (described["num_classes"], described["channels"], described["width"]) == (5, 1, 8)


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
        "data": {"image_size": None, "channels": None},
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
