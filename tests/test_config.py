"""Config composition: the groups exist, the schemas are enforced, typos fail at start."""

from __future__ import annotations

import itertools

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from tests.conftest import REPO
from tpustream.config import (
    PLATFORMS,
    Accelerator,
    LastBatch,
    OnError,
    OptimizerName,
    Precision,
    Schedule,
    Strategy,
    TrainConfig,
)
from tpustream.launch import resolve_config
from tpustream.launch.checks import DEFAULT_XLA_CACHE


def test_default_config_is_digits_small_cnn_sgd_cpu(compose_config):
    cfg = compose_config()
    assert (cfg.data.root, cfg.model.name, cfg.optim.name, cfg.accelerator.name) == (
        "data/digits",
        "small_cnn",
        OptimizerName.sgd,
        Accelerator.cpu,
    )
    assert cfg.data.train_shards.endswith("data/digits/train")


@pytest.mark.parametrize(
    "overrides",
    [
        ["data=cifar10", "model=resnet50", "batch_size=128", "epochs=18"],
        ["data=cifar100", "model=resnet18", "optim=adamw"],
        ["data=imagenet", "accelerator=tpu", "data.on_error=raise", "data.last_batch=drop"],
        ["data=cifar100", "model=wrn_seed", "precision=bf16", "strategy=spmd_fsdp", "micro_batches=4"],
    ],
)
def test_every_group_option_composes(compose_config, overrides):
    cfg = compose_config(*overrides)
    typed, plain = resolve_config(cfg)
    assert isinstance(typed, TrainConfig)
    assert plain["data"]["root"].endswith("data/" + overrides[0].split("=")[1])


def test_imagenet_resnet50_uses_the_pytorch_xla_reference_recipe(compose_config):
    """conf/optim/imagenet_sgd.yaml is data=imagenet's optim default; optim=... still wins."""
    typed, _ = resolve_config(compose_config("data=imagenet", "model=resnet50"))
    optim = typed.optim
    assert (optim.name, optim.lr, optim.reference_batch_size) == (OptimizerName.sgd, 0.5, 1024)
    assert (optim.momentum, optim.nesterov, optim.weight_decay) == (0.9, False, 1e-4)
    assert optim.label_smoothing == 0.0  # the reference's plain nn.CrossEntropyLoss()
    assert (optim.schedule, optim.warmup_epochs) == (Schedule.step, 0.9)
    assert (optim.decay_every_epochs, optim.decay_factor) == (20, 0.2)
    assert compose_config("data=imagenet", "optim=adamw").optim.name == "adamw"
    assert compose_config("data=cifar10").optim.lr == 0.1  # other datasets keep optim=sgd


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
        ("precision=fp16", "precision"),
        ("strategy=ddp2", "strategy"),
        ("accelerator.bf16=true", "bf16"),  # the old switch: precision=bf16 now
    ],
)
def test_typos_and_wrong_types_fail_at_composition(compose_config, override, message):
    with pytest.raises(ConfigCompositionException, match=message):
        compose_config(override)


# The groups whose files extend a schema (tpustream.config.register_configs).
SCHEMA_GROUPS = ("data", "model", "optim", "accelerator")


def offered_options(error: Exception) -> list[str]:
    """The options Hydra's error for an unknown one lists ('Available options in ...:' then a tab each)."""
    listed = str(error).split("Available options in", 1)[1].split("\n")[1:]
    return [line.strip() for line in itertools.takewhile(lambda line: line.startswith("\t"), listed)]


@pytest.mark.parametrize("group", SCHEMA_GROUPS)
def test_a_schema_is_neither_offered_nor_accepted_as_an_option(compose_config, group):
    """accelerator=foo lists conf/accelerator's files only; accelerator=accelerator_schema is refused
    (it would compose a run on the schema's bare defaults)."""
    with pytest.raises(MissingConfigException) as unknown:
        compose_config(f"{group}=foo")
    assert offered_options(unknown.value) == sorted(p.stem for p in (REPO / "conf" / group).glob("*.yaml"))
    with pytest.raises(MissingConfigException, match=f"Could not find '{group}/{group}_schema'"):
        compose_config(f"{group}={group}_schema")


def test_every_group_file_is_checked_against_its_schema(tmp_path):
    """Each file extends its schema, so a typo inside one fails at composition, naming the schema."""
    import shutil

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tpustream.config import register_configs

    for group in SCHEMA_GROUPS:
        for path in sorted((REPO / "conf" / group).glob("*.yaml")):
            defaults = OmegaConf.load(path).get("defaults", [])
            assert f"/{group}_schema@_here_" in defaults, f"{path} does not extend its schema"
    conf = tmp_path / "conf"
    shutil.copytree(REPO / "conf", conf)
    with open(conf / "accelerator" / "cpu.yaml", "a") as file:
        file.write("num_device: 2\n")  # num_devices
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with (
            initialize_config_dir(config_dir=str(conf), version_base="1.3"),
            pytest.raises(ConfigCompositionException, match="Key 'num_device' not in 'AcceleratorConfig'"),
        ):
            compose(config_name="config", overrides=["output_dir=/tmp/unused", "log_dir=null"])
    finally:
        GlobalHydra.instance().clear()


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


def test_an_accelerators_name_decides_its_device_runtime_and_collectives(compose_config):
    """One option file per accelerator, and nothing in it restates what the name decides."""
    options = {path.stem for path in (REPO / "conf" / "accelerator").glob("*.yaml")}
    assert options == {member.value for member in Accelerator}
    for member in Accelerator:
        typed, plain = resolve_config(compose_config(f"accelerator={member.value}"))
        platform = PLATFORMS[member]
        acc = typed.accelerator
        assert (acc.device, acc.runtime, acc.collectives) == platform
        assert plain["accelerator"]["name"] == member.value
        assert not {"device", "runtime", "collectives"} & set(plain["accelerator"])


def test_the_defaults_list_comments_name_every_option_of_their_group():
    """conf/config.yaml's `- group: default   # group/: a, b, ...` lines list every file of the group."""
    import re

    listed = {}
    for line in (REPO / "conf" / "config.yaml").read_text().splitlines():
        if match := re.match(r"\s*- (\w+): \w+\s+# \1/: (.*)", line):
            listed[match[1]] = set(re.findall(r"(?:^|[,;] )(\w+)", match[2]))
    assert set(listed) == {"model", "optim", "data", "accelerator"}
    for group, named in listed.items():
        options = {path.stem for path in (REPO / "conf" / group).glob("*.yaml")}
        assert options <= named, f"conf/config.yaml's {group} comment lacks {sorted(options - named)}"


def test_precision_and_strategy_are_typed(compose_config):
    typed, plain = resolve_config(compose_config("precision=bf16", "strategy=fsdp"))
    assert typed.precision == Precision.bf16 and typed.strategy == Strategy.fsdp
    assert (plain["precision"], plain["strategy"]) == ("bf16", "fsdp")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ([], None),  # auto on CPU: torch_xla 2.9's CPU client cannot load cache entries
        (["accelerator=tpu"], DEFAULT_XLA_CACHE),
        (["accelerator=tpu", "xla_cache_dir=null"], None),
        (["xla_cache_dir=cache"], "{cwd}/cache"),
    ],
)
def test_xla_cache_dir_auto_is_on_for_tpu_only(compose_config, monkeypatch, tmp_path, overrides, expected):
    import os

    monkeypatch.chdir(tmp_path)
    typed, _ = resolve_config(compose_config(*overrides))
    if expected is None:
        assert typed.xla_cache_dir is None
    else:
        assert typed.xla_cache_dir == os.path.expanduser(expected).format(cwd=tmp_path)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")))
def test_every_experiment_composes_passes_the_checks_and_builds(compose_config, experiment):
    """conf/experiment/*.yaml as +experiment=NAME: a whole config, its model built on the meta device."""
    from tpustream.launch.checks import check_config
    from tpustream.models.registry import check_model_builds

    typed, _ = resolve_config(compose_config(f"+experiment={experiment}", "accelerator=tpu"))
    check_config(typed)
    size = typed.data.image_size
    check_model_builds(
        typed.model.name,
        dict(typed.model.options),
        num_classes=1000,
        input_size=(size, size),
        channels=3,
        library=typed.model.library,
    )


def test_the_experiments_carry_their_sources_numbers(compose_config):
    mlperf, _ = resolve_config(compose_config("+experiment=mlperf_resnet50_lars"))
    assert (mlperf.model.name, mlperf.optim.name, mlperf.optim.lr) == ("resnet50", "lars", 10.0)
    assert (mlperf.epochs, mlperf.eval_every, mlperf.precision) == (42, 4, "bf16")
    assert (mlperf.batch_size, mlperf.optim.label_smoothing) == (64, 0.1)
    assert mlperf.data.root.endswith("data/imagenet")
    deit, _ = resolve_config(compose_config("+experiment=deit_small", "optim.lr=1e-4"))
    assert (deit.model.library, deit.model.name) == ("timm", "deit_small_patch16_224")
    assert (deit.optim.name, deit.optim.lr, deit.optim.reference_batch_size) == ("adamw", 1e-4, 512)
    assert (deit.optim.weight_decay, deit.optim.label_smoothing, deit.optim.warmup_epochs) == (0.05, 0.1, 5)
    assert (deit.ema.decay, deit.model.options["drop_path_rate"], deit.epochs) == (0.99996, 0.1, 300)
    assert (deit.augment.mixup_alpha, deit.augment.cutmix_alpha, deit.augment.erase_prob) == (0.8, 1.0, 0.25)
