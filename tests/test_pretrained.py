"""model.pretrained: weights from a file made by timm itself, checked before spawning, the head replaced."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tpustream.errors import ConfigError
from tpustream.launch import prepare
from tpustream.models import create_model
from tpustream.models.pretrained import load_pretrained


@pytest.fixture(scope="module")
def timm_imagenet_resnet18(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A timm-layout safetensors file with a 1000-class head, written by timm and safetensors themselves."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(1)
    state = timm.create_model("resnet18", num_classes=1000).state_dict()
    path = str(tmp_path_factory.mktemp("weights") / "resnet18.safetensors")
    save_file(state, path)
    return path, state


def test_fine_tuning_replaces_the_head_and_loads_the_rest(
    compose_config, digits_root, timm_imagenet_resnet18, caplog
):
    path, state = timm_imagenet_resnet18
    overrides = ("resume=null", "model=timm", "model.name=resnet18", f"model.pretrained={path}")
    with caplog.at_level(logging.INFO, logger="tpustream.models.pretrained"):
        plan = prepare(compose_config(f"data.root={digits_root}", *overrides))
    local, replaced = plan.pretrained
    assert replaced == ["fc.bias", "fc.weight"]
    assert "the head (fc.bias, fc.weight) holds another number of classes" in caplog.text
    model = create_model("resnet18", num_classes=10, image_size=32, channels=3, library="timm")
    fresh_head = model.fc.weight.clone()
    load_pretrained(model, local, replaced)
    assert torch.equal(model.conv1.weight, state["conv1.weight"])
    assert torch.equal(model.layer4[1].bn2.running_var, state["layer4.1.bn2.running_var"])
    assert model.fc.weight.shape == (10, 512) and torch.equal(model.fc.weight, fresh_head)
    os.remove(local)  # launch() removes it once its replicas are done


def test_weights_of_another_architecture_are_one_line_naming_the_tensors(
    compose_config, digits_root, timm_imagenet_resnet18, tmp_path
):
    path, state = timm_imagenet_resnet18
    wrapped = str(tmp_path / "wrapped.pt")  # a torch train checkpoint, keys as DDP saves them
    torch.save({"state_dict": {f"module.{k}": v for k, v in state.items()}, "epoch": 3}, wrapped)

    def run(*overrides: str):
        return prepare(compose_config(f"data.root={digits_root}", "resume=null", "model=timm", *overrides))

    local, replaced = run("model.name=resnet18", f"model.pretrained={wrapped}").pretrained
    os.remove(local)
    assert replaced == ["fc.bias", "fc.weight"]
    with pytest.raises(
        ConfigError, match=r"holds weights of another architecture: .* not in the model \(first"
    ):
        run("model.name=resnet10t", f"model.pretrained={path}")
    with pytest.raises(ConfigError, match=r"model.pretrained=[Tt]rue: give the weights' file"):
        run("model.name=resnet18", "model.pretrained=true")
    with pytest.raises(ConfigError, match=r"model.pretrained: .*missing.safetensors: No such file"):
        run("model.name=resnet18", f"model.pretrained={tmp_path}/missing.safetensors")


@pytest.mark.slow
def test_fine_tuning_from_a_timm_file_trains_on_xla(digits_root, tmp_path, timm_imagenet_resnet18):
    from tests.conftest import run_train
    from tpustream.checkpoint import read_metrics

    path, _ = timm_imagenet_resnet18
    run = str(tmp_path / "run")
    result = run_train(
        f"data.root={digits_root}",
        f"data.train_shards='{digits_root}/train/train-000000.tar'",
        "model=timm",
        "model.name=resnet18",
        f"model.pretrained={path}",
        "optim=adamw",
        "epochs=1",
        "batch_size=32",
        "data.num_workers=0",
        "accelerator.in_process=true",
        f"output_dir={run}",
        f"hydra.run.dir={tmp_path}/h",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "the head (fc.bias, fc.weight) holds another number of classes" in output
    assert read_metrics(run)[0]["val_samples"] == 359
