"""Config composition: the groups exist, the schemas are enforced, typos fail at start."""

from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from tests.conftest import REPO
from tpustream.config import Device, LastBatch, OnError, OptimizerName, TrainConfig
from tpustream.launch import resolve_config


def test_default_config_is_digits_small_cnn_sgd_cpu(compose_config):
    cfg = compose_config()
    assert (cfg.data.name, cfg.model.name, cfg.optim.name, cfg.accelerator.device) == (
        "digits",
        "small_cnn",
        OptimizerName.sgd,
        Device.CPU,
    )
    assert cfg.data.train_shards.endswith("data/digits/train")


@pytest.mark.parametrize(
    "overrides",
    [
        ["data=cifar10", "model=resnet50", "batch_size=128", "epochs=18"],
        ["data=cifar100", "model=resnet18", "optim=adamw"],
        ["data=imagenet", "accelerator=tpu", "data.on_error=raise", "data.last_batch=drop"],
    ],
)
def test_every_group_option_composes(compose_config, overrides):
    cfg = compose_config(*overrides)
    typed, plain = resolve_config(cfg)
    assert isinstance(typed, TrainConfig)
    assert plain["data"]["name"] == overrides[0].split("=")[1]


def test_enum_overrides_become_enums(compose_config):
    typed, plain = resolve_config(compose_config("data.on_error=raise", "data.last_batch=drop"))
    assert typed.data.on_error == OnError["raise"] and typed.data.last_batch == LastBatch.drop
    assert plain["data"]["on_error"] == "raise"  # plain data for checkpoints


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.lrr=0.1", "lrr"),
        ("epochs=ten", "epochs"),
        ("data.on_error=ignore", "on_error"),
        ("batchsize=3", "batchsize"),
        ("model=resnet101", "resnet101"),
    ],
)
def test_typos_and_wrong_types_fail_at_composition(compose_config, override, message):
    with pytest.raises(ConfigCompositionException, match=message):
        compose_config(override)


def test_paths_are_resolved_to_absolute_before_spawning(compose_config, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    typed, _ = resolve_config(compose_config("data.root=rel/digits", "output_dir=out", "resume=null"))
    assert typed.data.train_shards == f"{tmp_path}/rel/digits/train"
    assert typed.output_dir == f"{tmp_path}/out"
    typed, _ = resolve_config(compose_config("data.root=gs://bkt/digits", "output_dir=gs://bkt/run"))
    assert typed.data.val_shards == "gs://bkt/digits/test" and typed.output_dir == "gs://bkt/run"


def test_every_yaml_in_conf_documents_itself():
    for path in sorted((REPO / "conf").rglob("*.yaml")):
        assert path.read_text().startswith("#"), f"{path} should open with a comment saying what it is"
        OmegaConf.load(path)
