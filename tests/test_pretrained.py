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
    with pytest.raises(ConfigError, match=r"model.pretrained: .*missing.safetensors: No such file"):
        run("model.name=resnet18", f"model.pretrained={tmp_path}/missing.safetensors")


@pytest.mark.slow
def test_fine_tuning_from_a_timm_file_trains(digits_root, tmp_path, timm_imagenet_resnet18):
    """The file is read once by the launcher and loaded on the host, before the model meets its
    device: the runtime is not this test's subject (accelerator=cpu_eager, measured 21 CPU-s
    against 57 on XLA, where the timm ViT of test_models trains)."""
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
        "accelerator=cpu_eager",
        "accelerator.in_process=true",
        f"output_dir={run}",
        f"hydra.run.dir={tmp_path}/h",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert "the head (fc.bias, fc.weight) holds another number of classes" in output
    assert read_metrics(run)[0]["val_samples"] == 359


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty, offline Hugging Face cache; put(repo_id, state) adds a model.safetensors as a download would.

    huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE into its constants
    when imported, and hf_hub_download looks them up there on every call.
    """
    import huggingface_hub.constants
    from safetensors.torch import save_file

    cache = tmp_path / "hf" / "hub"
    for name, value in {
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    def put(repo_id: str, state: dict[str, torch.Tensor]) -> None:
        # The hub's layout (huggingface_hub/file_download.py): refs/main holds
        # the commit of the branch, snapshots/<commit>/ the files.
        commit = "0123456789abcdef0123456789abcdef01234567"
        repo = cache / f"models--{repo_id.replace('/', '--')}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text(commit)
        (repo / "snapshots" / commit).mkdir(parents=True)
        save_file(state, str(repo / "snapshots" / commit / "model.safetensors"))

    return put


def test_timm_weights_are_loaded_by_timm_once_per_host_from_its_cache(
    compose_config, digits_root, timm_imagenet_resnet18, hub_cache, caplog
):
    from timm.models import get_pretrained_cfg

    _, state = timm_imagenet_resnet18
    hub_cache(get_pretrained_cfg("resnet18.a1_in1k").hf_hub_id, state)
    overrides = ("resume=null", "model=timm", "model.name=resnet18.a1_in1k", "model.pretrained=true")
    with caplog.at_level(logging.INFO, logger="tpustream.models.pretrained"):
        # data.channels=1: timm's own loading adapts the 3-channel stem (sums it over the channels).
        plan = prepare(
            compose_config(
                f"data.root={digits_root}",
                "data.channels=1",
                "data.mean=[0.5]",
                "data.std=[0.25]",
                *overrides,
            )
        )
    local, replaced = plan.pretrained
    assert replaced == ["fc.bias", "fc.weight"]
    assert (
        "model.pretrained=true (timm resnet18.a1_in1k: timm/resnet18.a1_in1k on the Hugging Face hub): "
        f"{len(state) - 2} tensors loaded; the head (fc.bias, fc.weight) holds another number of classes"
        in caplog.text
    )
    # What a replica does: build the model without weights and load the host's copy.
    model = create_model("resnet18.a1_in1k", num_classes=10, image_size=32, channels=1, library="timm")
    fresh_head = model.fc.weight.clone()
    load_pretrained(model, local, replaced)
    assert torch.allclose(model.conv1.weight, state["conv1.weight"].sum(dim=1, keepdim=True))
    assert torch.equal(model.layer4[1].bn2.running_var, state["layer4.1.bn2.running_var"])
    assert model.fc.weight.shape == (10, 512) and torch.equal(model.fc.weight, fresh_head)
    os.remove(local)


def test_timm_resizes_a_vits_position_embedding_and_patches_for_another_image_size(
    compose_config, digits_root, hub_cache
):
    import timm

    name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    torch.manual_seed(3)
    state = timm.create_model(name).state_dict()  # 224 px, 16 px patches, 1000 classes
    hub_cache(f"timm/{name}", state)
    options = ("+model.options.img_size=32", "+model.options.patch_size=4")
    overrides = ("resume=null", "model=timm", f"model.name={name}", "model.pretrained=true", *options)
    local, replaced = prepare(compose_config(f"data.root={digits_root}", *overrides)).pretrained
    assert replaced == ["head.bias", "head.weight"]
    model = create_model(
        name, num_classes=10, image_size=32, channels=3, library="timm", img_size=32, patch_size=4
    )
    load_pretrained(model, local, replaced)
    assert model.pos_embed.shape == (1, 65, 192) and state["pos_embed"].shape == (1, 197, 192)
    assert model.patch_embed.proj.weight.shape == (192, 3, 4, 4)
    assert torch.equal(model.pos_embed[0, 0], state["pos_embed"][0, 0])  # the class token's is kept
    assert torch.equal(model.blocks[3].attn.qkv.weight, state["blocks.3.attn.qkv.weight"])
    os.remove(local)


def test_library_weights_that_are_missing_or_absent_are_one_line_before_spawning(
    compose_config, digits_root, hub_cache
):
    def run(*overrides: str):
        return prepare(compose_config(f"data.root={digits_root}", "resume=null", *overrides))

    # Offline, and not in the cache: what to do, in one line.
    with pytest.raises(ConfigError) as caught:
        run("model=timm", "model.name=resnet10t.c3_in1k", "model.pretrained=true")
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "model=timm model.name=resnet10t.c3_in1k model.pretrained=true: timm could not load its weights "
        "(timm/resnet10t.c3_in1k on the Hugging Face hub): LocalEntryNotFoundError"
    )
    assert "HF_HUB_OFFLINE=1" in message and "model.pretrained=PATH" in message
    with pytest.raises(ConfigError, match=r"model.name=botnet50ts_256 .*timm has no pretrained weights"):
        run("model=timm", "model.name=botnet50ts_256", "model.pretrained=true")
    with pytest.raises(
        ConfigError, match=r"Invalid pretrained tag \(nope\) for resnet18; .*with weights: resnet18\."
    ):
        run("model=timm", "model.name=resnet18.nope", "model.pretrained=true")
    with pytest.raises(
        ConfigError, match=r"tpustream's built-in models have no pretrained weights; use model=timm"
    ):
        run("model=resnet18", "model.pretrained=true")
    with pytest.raises(
        ConfigError, match=r"model.pretrained=IMAGENET1K_V3: no such weights \(it has IMAGENET1K_V1"
    ):
        run("model=torchvision", "model.name=resnet18", "model.pretrained=IMAGENET1K_V3")
    with pytest.raises(ConfigError, match=r"model.pretrained is empty"):
        run("model=timm", "model.name=resnet18", "model.pretrained=''")
    plan = run("model=timm", "model.name=resnet18", "model.pretrained=false")  # false: none
    assert plan.pretrained is None and not plan.cfg.model.wants_pretrained()


@pytest.fixture
def torchvision_imagenet_resnet18(tmp_path, monkeypatch) -> dict[str, torch.Tensor]:
    """TORCH_HOME's hub cache holding ResNet18_Weights.IMAGENET1K_V1's file as torchvision writes it."""
    import torchvision
    from torchvision.models import ResNet18_Weights

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # torch.hub reads it on every call
    torch.manual_seed(2)
    state = torchvision.models.resnet18(num_classes=1000).state_dict()
    checkpoints = tmp_path / "torch" / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    # torch.hub checks the hash in the file's name only as it downloads: a
    # cached file is taken as it is, as this one is.
    torch.save(state, checkpoints / os.path.basename(ResNet18_Weights.IMAGENET1K_V1.url))
    return state


@pytest.mark.parametrize("value", ["true", "IMAGENET1K_V1"])
def test_torchvision_weights_come_from_the_torch_hub_cache(
    compose_config, digits_root, torchvision_imagenet_resnet18, value, caplog
):
    state = torchvision_imagenet_resnet18
    overrides = ("resume=null", "model=torchvision", "model.name=resnet18", f"model.pretrained={value}")
    with caplog.at_level(logging.INFO, logger="tpustream.models.pretrained"):
        plan = prepare(compose_config(f"data.root={digits_root}", *overrides))
    local, replaced = plan.pretrained
    assert replaced == ["fc.bias", "fc.weight"]
    assert f"model.pretrained={value} (ResNet18_Weights.IMAGENET1K_V1): " in caplog.text
    assert "the head (fc.bias, fc.weight) holds another number of classes" in caplog.text
    model = create_model("resnet18", num_classes=10, image_size=32, channels=3, library="torchvision")
    load_pretrained(model, local, replaced)
    assert torch.equal(model.conv1.weight, state["conv1.weight"])
    assert torch.equal(model.layer4[1].bn2.running_mean, state["layer4.1.bn2.running_mean"])
    assert model.fc.weight.shape == (10, 512)
    os.remove(local)


def test_torchvision_weights_that_cannot_be_downloaded_are_one_line(
    compose_config, digits_root, tmp_path, monkeypatch
):
    import urllib.error

    def no_network(url, *args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    overrides = ("resume=null", "model=torchvision", "model.name=resnet18", "model.pretrained=true")
    with pytest.raises(ConfigError) as caught:
        prepare(compose_config(f"data.root={digits_root}", *overrides))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        "model=torchvision model.name=resnet18 model.pretrained=true: torchvision could not load "
        "ResNet18_Weights.IMAGENET1K_V1 (https://download.pytorch.org/models/resnet18-f37072fd.pth): URLError"
    )
    assert "TORCH_HOME/hub/checkpoints" in message and "model.pretrained=PATH" in message


def test_squeezenets_own_weights_fine_tune_with_their_convolution_head_left_fresh(
    compose_config, digits_root, tmp_path, monkeypatch, caplog
):
    """SqueezeNet's head is a 1x1 convolution (classifier.1), which no rule for a Linear finds."""
    import torchvision
    from torchvision.models import SqueezeNet1_1_Weights

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    torch.manual_seed(4)
    state = torchvision.models.squeezenet1_1(num_classes=1000).state_dict()
    checkpoints = tmp_path / "torch" / "hub" / "checkpoints"
    checkpoints.mkdir(parents=True)
    torch.save(state, checkpoints / os.path.basename(SqueezeNet1_1_Weights.IMAGENET1K_V1.url))
    overrides = ("resume=null", "model=torchvision", "model.name=squeezenet1_1", "model.pretrained=true")
    with caplog.at_level(logging.INFO, logger="tpustream.models.pretrained"):
        local, replaced = prepare(compose_config(f"data.root={digits_root}", *overrides)).pretrained
    assert replaced == ["classifier.1.bias", "classifier.1.weight"]
    assert "the head (classifier.1.bias, classifier.1.weight) holds another number of classes" in caplog.text
    model = create_model("squeezenet1_1", num_classes=10, image_size=32, channels=3, library="torchvision")
    fresh_head = model.classifier[1].weight.clone()
    load_pretrained(model, local, replaced)
    assert torch.equal(model.features[12].expand3x3.weight, state["features.12.expand3x3.weight"])
    assert model.classifier[1].weight.shape == (10, 512, 1, 1)
    assert torch.equal(model.classifier[1].weight, fresh_head)
    os.remove(local)


def library_weights_for(library: str, name: str, options: dict, num_classes: int) -> dict[str, torch.Tensor]:
    """The state dict of `name` for num_classes, built by its library itself (no tpustream code)."""
    if library == "timm":
        import timm

        return timm.create_model(name, num_classes=num_classes, **options).state_dict()
    import torchvision

    return torchvision.models.get_model(name, num_classes=num_classes, **options).state_dict()


@pytest.mark.parametrize(
    ("library", "name", "options", "head"),
    [
        ("torchvision", "squeezenet1_1", {}, ["classifier.1.bias", "classifier.1.weight"]),
        ("torchvision", "mobilenet_v3_small", {}, ["classifier.3.bias", "classifier.3.weight"]),
        ("timm", "test_convnext", {}, ["head.fc.bias", "head.fc.weight"]),
        (
            "timm",
            "deit_tiny_distilled_patch16_224",
            {"depth": 1, "img_size": 32, "patch_size": 8},
            ["head.bias", "head.weight", "head_dist.bias", "head_dist.weight"],
        ),
    ],
)
def test_a_file_of_another_class_count_leaves_fresh_every_tensor_the_class_count_shapes(
    compose_config, digits_root, tmp_path, library, name, options, head, caplog
):
    from safetensors.torch import save_file

    torch.manual_seed(5)
    state = library_weights_for(library, name, options, num_classes=1000)
    path = str(tmp_path / f"{name}.safetensors")
    save_file(state, path)
    overrides = [f"model={library}", f"model.name={name}", f"model.pretrained={path}"]
    overrides += [f"+model.options.{key}={value}" for key, value in options.items()]
    with caplog.at_level(logging.INFO, logger="tpustream.models.pretrained"):
        local, replaced = prepare(
            compose_config(f"data.root={digits_root}", "resume=null", *overrides)
        ).pretrained
    assert replaced == head
    assert f"the head ({', '.join(head)}) holds another number of classes" in caplog.text
    model = create_model(name, num_classes=10, image_size=32, channels=3, library=library, **options)
    fresh = {key: tensor.clone() for key, tensor in model.state_dict().items() if key in head}
    load_pretrained(model, local, replaced)
    loaded = model.state_dict()
    assert all(torch.equal(loaded[key], tensor) for key, tensor in fresh.items())
    assert all(torch.equal(loaded[key], state[key]) for key in loaded if key not in head)
    os.remove(local)


@pytest.mark.parametrize(
    ("library", "name", "options", "head"),
    [
        ("torchvision", "squeezenet1_1", {}, ["classifier.1.bias", "classifier.1.weight"]),
        (
            "torchvision",
            "googlenet",
            {"aux_logits": True},
            ["aux1.fc2.bias", "aux1.fc2.weight", "aux2.fc2.bias", "aux2.fc2.weight", "fc.bias", "fc.weight"],
        ),
        (
            "timm",
            "inception_v3",
            {"aux_logits": True},
            ["AuxLogits.fc.bias", "AuxLogits.fc.weight", "fc.bias", "fc.weight"],
        ),
    ],
)
def test_the_head_is_every_tensor_whose_shape_follows_the_class_count(library, name, options, head):
    import functools

    from tpustream.models.pretrained import classifier_names

    build = functools.partial(create_model, name, image_size=299, channels=3, library=library, **options)
    with torch.device("meta"):
        model = build(num_classes=10)
    assert sorted(classifier_names(model, build)) == head


def test_a_model_without_a_builder_has_its_head_named_by_rule():
    """Without what builds it, the model cannot be built for other class counts: timm's
    pretrained_cfg names the head, else the last Linear."""
    import timm

    from tpustream.models.pretrained import classifier_names

    with torch.device("meta"):
        convnext = timm.create_model("test_convnext", num_classes=10)
        plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 10))
    assert classifier_names(convnext) == {"head.fc.bias", "head.fc.weight"}
    assert classifier_names(plain) == {"2.bias", "2.weight"}


def test_weights_of_another_architecture_are_refused_naming_a_tensor_outside_the_head(
    compose_config, digits_root, tmp_path
):
    """SqueezeNet 1.0's weights for 1.1: the head of another class count is not what tells them apart."""
    torch.manual_seed(6)
    path = str(tmp_path / "squeezenet1_0.pt")
    torch.save(library_weights_for("torchvision", "squeezenet1_0", {}, num_classes=1000), path)
    overrides = ("resume=null", "model=torchvision", "model.name=squeezenet1_1", f"model.pretrained={path}")
    with pytest.raises(ConfigError) as caught:
        prepare(compose_config(f"data.root={digits_root}", *overrides))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(
        f"model.pretrained={path} holds weights of another architecture: 10 tensor(s) differ in shape "
        "(first features.0.bias: (96,) in the file, (64,) here)"
    )


def test_weights_without_a_head_leave_the_whole_head_fresh(compose_config, digits_root, tmp_path, caplog):
    """A backbone's weights (timm's num_classes=0 has no fc): every replica loads them, the head fresh."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(7)
    state = timm.create_model("resnet18", num_classes=0).state_dict()
    path = str(tmp_path / "resnet18-backbone.safetensors")
    save_file(state, path)
    overrides = ("resume=null", "model=timm", "model.name=resnet18", f"model.pretrained={path}")
    with caplog.at_level(logging.INFO, logger="tpustream.models.pretrained"):
        local, replaced = prepare(compose_config(f"data.root={digits_root}", *overrides)).pretrained
    assert replaced == ["fc.bias", "fc.weight"]
    assert "the head (fc.bias, fc.weight) is not in the weights and starts freshly initialised" in caplog.text
    model = create_model("resnet18", num_classes=10, image_size=32, channels=3, library="timm")
    fresh_head = model.fc.weight.clone()
    load_pretrained(model, local, replaced)
    assert torch.equal(model.layer4[1].conv2.weight, state["layer4.1.conv2.weight"])
    assert torch.equal(model.fc.weight, fresh_head)
    os.remove(local)
