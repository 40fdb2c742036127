"""The named mesh (runtime.mesh), the tensor-parallel rules (training.sharding_rules) and
rematerialisation (models.remat), in process: shapes, specs and blocks need no XLA device.

What the mesh does on devices is tests/test_spmd.py's (train.py on 4 virtual
XLA CPU devices) and test_mesh_on_devices below (one probe process).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from tests.conftest import xla_cpu_env
from tpustream.config import MeshConfig, Strategy
from tpustream.errors import ConfigError
from tpustream.models import create_model
from tpustream.models.remat import check_remat, model_blocks, rematerialize
from tpustream.runtime.mesh import MeshShape, mesh_shape
from tpustream.runtime.spmd import fsdp_partition_spec
from tpustream.training.sharding_rules import BUILTIN_RULES, announce, parameter_specs, rules_of, tensor_split


@pytest.mark.parametrize(
    "layout, strategy, devices, want",
    [
        # The presets: today's spmd (data parallel) and spmd_fsdp (FSDPv2 over every device).
        (MeshConfig(), Strategy.spmd, 4, MeshShape(1, 4, 1, 1)),
        (MeshConfig(), Strategy.spmd_fsdp, 4, MeshShape(1, 1, 4, 1)),
        # The strategy's axis takes what the others leave.
        (MeshConfig(fsdp=2, tensor=2), Strategy.spmd, 4, MeshShape(1, 1, 2, 2)),
        (MeshConfig(tensor=2), Strategy.spmd, 8, MeshShape(1, 4, 1, 2)),
        (MeshConfig(tensor=2), Strategy.spmd_fsdp, 8, MeshShape(1, 1, 4, 2)),
        (MeshConfig(data=2), Strategy.spmd_fsdp, 8, MeshShape(1, 2, 4, 1)),
        # -1 takes it instead, and every null is then 1.
        (MeshConfig(tensor=-1, fsdp=2), Strategy.spmd, 8, MeshShape(1, 1, 2, 4)),
        # Slices split the devices first.
        (MeshConfig(slices=2), Strategy.spmd_fsdp, 8, MeshShape(2, 1, 4, 1)),
        (MeshConfig(slices=2, tensor=2), Strategy.spmd, 16, MeshShape(2, 4, 1, 2)),
    ],
)
def test_mesh_shape_resolves_nulls_and_the_rest(layout, strategy, devices, want):
    shape = mesh_shape(layout, strategy, devices)
    assert shape == want
    assert shape.devices == devices
    assert shape.batch_shards == devices // want.tensor


@pytest.mark.parametrize(
    "layout, devices, message",
    [
        (MeshConfig(fsdp=3), 4, r"mesh.data=null x mesh.fsdp=3 x mesh.tensor=1 does not divide a slice's 4"),
        (MeshConfig(data=2, fsdp=1), 4, r"is 2 devices, but a slice has 4 .* set one axis to -1"),
        (MeshConfig(slices=3), 4, r"mesh.slices=3 does not divide the 4 devices"),
    ],
)
def test_a_mesh_the_devices_do_not_fill_is_one_line_naming_the_keys(layout, devices, message):
    with pytest.raises(ConfigError, match=message):
        mesh_shape(layout, Strategy.spmd, devices)


def test_mesh_describes_itself_without_a_single_slice():
    assert MeshShape(1, 1, 2, 2).describe() == "data=1 x fsdp=2 x tensor=2"
    assert MeshShape(2, 1, 4, 1).describe() == "slices=2 x data=1 x fsdp=4 x tensor=1"


def tiny_vit(heads: int = 2, dim: int = 32, mlp_ratio: float = 4.0) -> nn.Module:
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224",
        img_size=32,
        patch_size=4,
        embed_dim=dim,
        depth=2,
        num_heads=heads,
        mlp_ratio=mlp_ratio,
        num_classes=10,
    )


def test_builtin_rules_split_a_timm_vit_as_megatron_does():
    model = tiny_vit()
    specs = parameter_specs(model, 2, BUILTIN_RULES)
    for block in range(2):
        prefix = f"blocks.{block}."
        assert specs[prefix + "attn.qkv.weight"] == ("tensor", "fsdp")  # by output features
        assert specs[prefix + "attn.qkv.bias"] == ("tensor",)
        assert specs[prefix + "attn.proj.weight"] == ("fsdp", "tensor")  # by input features
        assert specs[prefix + "mlp.fc1.weight"] == ("tensor", "fsdp")
        assert specs[prefix + "mlp.fc2.weight"] == ("fsdp", "tensor")
        # Norms and the output projections' biases: as FSDPv2 splits them.
        assert specs[prefix + "norm1.weight"] == ("fsdp",)
        assert specs[prefix + "attn.proj.bias"] == ("fsdp",)
    assert specs["patch_embed.proj.weight"] == fsdp_partition_spec(model.patch_embed.proj.weight.shape)
    assert len(tensor_split(specs)) == 2 * 6
    # Without a tensor axis the rules do not apply: spmd_fsdp's split of every parameter, as before.
    plain = parameter_specs(model, 1, BUILTIN_RULES)
    assert plain == {name: fsdp_partition_spec(p.shape) for name, p in model.named_parameters()}


def test_builtin_rules_split_torchvisions_vit():
    with torch.device("meta"):
        model = create_model("vit_b_16", num_classes=10, image_size=224, channels=3, library="torchvision")
    specs = parameter_specs(model, 4, BUILTIN_RULES)
    layer = "encoder.layers.encoder_layer_0."
    assert specs[layer + "self_attention.in_proj_weight"] == ("tensor", "fsdp")
    assert specs[layer + "self_attention.out_proj.weight"] == ("fsdp", "tensor")
    assert specs[layer + "mlp.0.weight"] == ("tensor", "fsdp")
    assert specs[layer + "mlp.3.weight"] == ("fsdp", "tensor")
    assert len(tensor_split(specs)) == 12 * 6


def test_a_tensor_axis_that_does_not_divide_the_heads_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"mesh.tensor=2 does not divide the 3 heads of blocks.0.attn"):
        parameter_specs(tiny_vit(heads=3, dim=48), 2, BUILTIN_RULES)
    with pytest.raises(
        ConfigError, match=r"mesh.tensor=2 does not divide dimension 0 of blocks.0.mlp.fc1.weight \(81\)"
    ):
        parameter_specs(tiny_vit(heads=2, dim=32, mlp_ratio=81 / 32), 2, BUILTIN_RULES)


def test_configured_rules_replace_the_builtin_ones_first_match_wins():
    model = tiny_vit()
    rules = rules_of([["*.fc1.weight", [None, "tensor"]], ["*.fc1.weight", ["tensor", None]]])
    specs = parameter_specs(model, 2, rules)
    assert specs["blocks.0.mlp.fc1.weight"] == (None, "tensor")
    assert specs["blocks.0.attn.qkv.weight"] == fsdp_partition_spec(model.blocks[0].attn.qkv.weight.shape)
    assert rules_of([["*", [["data", "fsdp"]]]]) == (("*", (("data", "fsdp"),)),)
    with pytest.raises(
        ConfigError, match=r"the spec \['tensor'\] has 1 entries, but blocks.0.attn.qkv.weight"
    ):
        parameter_specs(model, 2, rules_of([["*.qkv.weight", ["tensor"]]]))


def test_a_model_no_rule_matches_is_said_once(caplog):
    model = create_model("small_cnn", num_classes=10, image_size=32, channels=3)
    specs = parameter_specs(model, 2, BUILTIN_RULES)
    with caplog.at_level(logging.WARNING, logger="tpustream.training.sharding_rules"):
        announce(specs, 2, "small_cnn")
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "no mesh.rules pattern matches a parameter of small_cnn" in caplog.records[0].getMessage()


# ---------------------------------------------------------------- rematerialisation


def test_remat_blocks_are_a_models_repeated_blocks():
    vit = tiny_vit()
    assert model_blocks(vit) == list(vit.blocks)
    with torch.device("meta"):
        resnet = create_model("resnet18", num_classes=10, image_size=224, channels=3, library="torchvision")
        tv_vit = create_model("vit_b_16", num_classes=10, image_size=224, channels=3, library="torchvision")
    assert [type(b).__name__ for b in model_blocks(resnet)] == ["BasicBlock"] * 8
    assert model_blocks(tv_vit) == list(tv_vit.encoder.layers)
    with pytest.raises(ConfigError, match=r"model.remat=true: small_cnn has no blocks to recompute"):
        check_remat(create_model("small_cnn", num_classes=10, image_size=32, channels=3), "small_cnn")


def train_steps(model: nn.Module, steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    """SGD steps on fixed batches; (losses, the state after them)."""
    generator = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        images = torch.randn(8, 3, 32, 32, generator=generator)
        labels = torch.randint(0, 10, (8,), generator=generator)
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name, library", [("resnet18", "torchvision"), ("vit", "timm")])
def test_remat_on_the_native_runtime_trains_the_same_model(name, library):
    """Same losses and weights; BatchNorm's running statistics updated once a step, not again by
    the recomputation; state_dict keys unchanged; dropout recomputed with the forward's draws."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        if library == "timm":
            import timm

            return timm.create_model(
                "vit_tiny_patch16_224", img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2,
                num_classes=10, drop_rate=0.1, proj_drop_rate=0.1, drop_path_rate=0.1,
            )  # fmt: skip
        return create_model(name, num_classes=10, image_size=32, channels=3, library=library)

    plain = build()
    torch.manual_seed(5)  # the dropout draws
    plain_losses, plain_state = train_steps(plain)
    model = build()
    assert rematerialize(model, name, xla=False) == len(model_blocks(model))
    torch.manual_seed(5)
    losses, state = train_steps(model)
    assert losses == pytest.approx(plain_losses, abs=1e-6)
    assert state.keys() == plain_state.keys()
    for key, value in plain_state.items():
        assert torch.allclose(state[key], value, atol=1e-6), key  # running_mean/var, num_batches_tracked
    if library == "torchvision":
        assert int(state["layer1.0.bn1.num_batches_tracked"]) == 3


MESH_PROBE = r"""
import json
from unittest import mock
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr
from tpustream.errors import ConfigError
from tpustream.runtime.mesh import MeshShape, build_mesh

# Two slices of a v4-8, as torch_xla's test_hybrid_mesh stands them in: 4 chips each,
# listed out of order, with their coordinates and slice_index.
coords = [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]]
names = [2, 1, 0, 3, 4, 7, 6, 5]
attributes = [
    {"name": f"TPU:{n}", "coords": coords[i % 4], "core_on_chip": 0, "slice_index": i // 4}
    for i, n in enumerate(names)
]
out = {}
with mock.patch.object(xr, "global_runtime_device_attributes", return_value=attributes), \
        mock.patch.object(xr, "global_runtime_device_count", return_value=8), \
        mock.patch.object(xm, "xla_device_hw", return_value="TPU"):
    for key, shape in {"fsdp": MeshShape(2, 1, 4, 1), "tensor": MeshShape(2, 1, 2, 2)}.items():
        mesh = build_mesh(shape)
        out[key] = {"shape": list(mesh.mesh_shape), "axes": list(mesh.axis_names),
                    "devices": mesh.get_logical_mesh().tolist()}
    one_slice = [dict(a, slice_index=0) for a in attributes]
    with mock.patch.object(xr, "global_runtime_device_attributes", return_value=one_slice):
        try:
            build_mesh(MeshShape(2, 1, 4, 1))
        except ConfigError as error:
            out["one_slice"] = str(error)
print(json.dumps(out))
"""


def test_multislice_mesh_puts_slices_outermost_over_each_slices_devices():
    """torch_xla's HybridMesh under the device attributes two v4-8 slices report (as its own
    test_hybrid_mesh stands them in): slice 0's devices, then slice 1's, each slice's in its
    physical order; no real multislice run is possible here."""
    result = subprocess.run(
        [sys.executable, "-c", MESH_PROBE], capture_output=True, text=True, env=xla_cpu_env(), timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["fsdp"]["axes"] == ["slices", "data", "fsdp", "tensor"]
    assert out["fsdp"]["shape"] == [2, 1, 4, 1]
    flat = [d for plane in out["fsdp"]["devices"] for row in plane for column in row for d in column]
    slice_of = {n: i // 4 for i, n in enumerate([2, 1, 0, 3, 4, 7, 6, 5])}
    assert [slice_of[d] for d in flat] == [0] * 4 + [1] * 4
    # torch_xla's own expectation for a (2, 2) mesh of these devices: [[2, 1], [0, 3], [4, 7], [6, 5]].
    tensor = out["tensor"]["devices"]
    assert [row for plane in tensor for block in plane for row in block] == [[2, 1], [0, 3], [4, 7], [6, 5]]
    assert "mesh.slices=2, but the TPU runtime sees 1 slice(s)" in out["one_slice"]


REMAT_PROBE = r"""
import glob, json, sys
import torch, torch_xla, timm
from tpustream.models.remat import rematerialize

def step(remat):
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=4, embed_dim=32, depth=3,
                              num_heads=2, num_classes=10)
    if remat:
        rematerialize(model, "vit", xla=True)
    model = model.to(torch_xla.device())
    torch.manual_seed(1)
    images, labels = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    loss = torch.nn.functional.cross_entropy(model(images.to("xla")), labels.to("xla"))
    loss.backward()
    torch_xla.sync()
    return loss.item(), [p.grad.cpu() for p in model.parameters()]

plain_loss, plain_grads = step(False)
loss, grads = step(True)
print(json.dumps({"losses": [plain_loss, loss],
                  "grad_difference": max((a - b).abs().max().item() for a, b in zip(plain_grads, grads))}))
"""


def test_remat_on_xla_recomputes_in_the_compiled_program(tmp_path):
    """torch_xla's checkpoint survives XLA's optimisations: the compiled step of a remat ViT holds
    each block's matmuls again (its optimisation barrier keeps CSE from merging them back), and
    the loss and gradients are the plain step's."""
    dump = tmp_path / "hlo"
    env = {**xla_cpu_env(), "XLA_FLAGS": f"{xla_cpu_env()['XLA_FLAGS']} --xla_dump_to={dump}"}
    result = subprocess.run(
        [sys.executable, "-c", REMAT_PROBE], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["losses"][0] == pytest.approx(out["losses"][1], abs=1e-6)
    assert out["grad_difference"] < 1e-5
    # The two training steps' programs, in the order compiled (the largest two: the others
    # copy weights and data).
    compiled = sorted(dump.glob("module_*.SyncTensorsGraph.*.cpu_after_optimizations.txt"))
    steps = sorted(compiled, key=lambda path: path.stat().st_size)[-2:]
    plain, remat = sorted(steps, key=lambda path: path.name)
    dots = [path.read_text().count(" dot(") for path in (plain, remat)]
    # 6 matmuls a block (qkv, q.k, attention.v, proj, fc1, fc2): the recomputation runs all but
    # fc2 again (the backward needs its input, not its output), in each of the 3 blocks.
    assert dots[1] - dots[0] == 3 * 5, dots
