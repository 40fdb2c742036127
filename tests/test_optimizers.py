"""LARS, LAMB, gradient clipping, the poly schedule and layer decay: the math on tiny tensors, the groups.

The references are the papers' formulas written out in float64, and for
optim.layer_decay timm's own param_groups_layer_decay; the XLA tests run the
optimizers on the XLA CPU device in a process of their own.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from tests.conftest import REPO, xla_cpu_env
from tpustream.config import OptimConfig, OptimizerName, Schedule, TrainConfig
from tpustream.errors import ConfigError
from tpustream.launch import prepare, resolve_config
from tpustream.training.optimizer import (
    LAMB,
    LARS,
    build_optimizer,
    clip_gradient_norm,
    prime_optimizer_state,
    set_learning_rate,
)
from tpustream.training.schedule import LRSchedule, make_schedule, xla_safe_scalar

LRS = (0.5, 0.3, 0.1)  # a changing learning rate: LARS keeps it inside the momentum buffer


def tensors() -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Weights (w: a matrix, z: all zeros, b: a bias) and three steps of gradients."""
    generator = torch.Generator().manual_seed(0)
    weights = {
        "w": torch.randn(3, 4, generator=generator),
        "z": torch.zeros(2, 2),
        "b": torch.randn(4, generator=generator),
    }
    grads = [{k: torch.randn(v.shape, generator=generator) for k, v in weights.items()} for _ in LRS]
    return weights, grads


def run_ours(cls, lrs=LRS, **options) -> dict[str, torch.Tensor]:
    """Weights after len(lrs) steps: w and z adapted with weight decay 0.01, b excluded."""
    weights, grads = tensors()
    params = {k: nn.Parameter(v.clone()) for k, v in weights.items()}
    groups = [
        {"params": [params["w"], params["z"]], "weight_decay": 0.01},
        {"params": [params["b"]], "weight_decay": 0.0, "exclude_from_adaptation": True},
    ]
    optimizer = cls(groups, lr=lrs[0], **options)
    for lr, step_grads in zip(lrs, grads, strict=True):
        for group in optimizer.param_groups:
            group["lr"] = lr
        for name, param in params.items():
            param.grad = step_grads[name].clone()
        optimizer.step()
    return {k: v.detach() for k, v in params.items()}


def lars_reference(nesterov: bool = False, lr_in_buffer: bool = True, lrs=LRS, eta=0.001, eps=1e-9):
    """The MLPerf reference's LARS (lr inside the buffer) or timm's form (lr after it), momentum 0.9."""
    weights, grads = tensors()
    w = {k: v.double() for k, v in weights.items()}
    buffers = {k: torch.zeros_like(v) for k, v in w.items()}
    for lr, step_grads in zip(lrs, grads, strict=True):
        for name in w:
            g = step_grads[name].double()
            decay = 0.0 if name == "b" else 0.01
            ratio = 1.0
            if name != "b" and w[name].norm() > 0 and g.norm() > 0:
                ratio = 0.001 * w[name].norm() / (g.norm() + decay * w[name].norm() + eps)
            direction = (g + decay * w[name]) * ratio * (lr if lr_in_buffer else 1.0)
            buffers[name] = 0.9 * buffers[name] + direction
            update = 0.9 * buffers[name] + direction if nesterov else buffers[name]
            w[name] = w[name] - update * (1.0 if lr_in_buffer else lr)
    return w


def lamb_reference(lrs=LRS, betas=(0.9, 0.999), eps=1e-6):
    """You et al. 2019, Algorithm 2 (phi the identity), bias-corrected as timm's Lamb."""
    weights, grads = tensors()
    w = {k: v.double() for k, v in weights.items()}
    m = {k: torch.zeros_like(v) for k, v in w.items()}
    v = {k: torch.zeros_like(v) for k, v in w.items()}
    for t, (lr, step_grads) in enumerate(zip(lrs, grads, strict=True), start=1):
        for name in w:
            g = step_grads[name].double()
            decay = 0.0 if name == "b" else 0.01
            m[name] = betas[0] * m[name] + (1 - betas[0]) * g
            v[name] = betas[1] * v[name] + (1 - betas[1]) * g * g
            update = (m[name] / (1 - betas[0] ** t)) / ((v[name] / (1 - betas[1] ** t)).sqrt() + eps)
            update = update + decay * w[name]
            ratio = 1.0
            if name != "b" and w[name].norm() > 0 and update.norm() > 0:
                ratio = w[name].norm() / update.norm()
            w[name] = w[name] - lr * ratio * update
    return w


def assert_close_to(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for name, tensor in want.items():
        torch.testing.assert_close(got[name].double(), tensor, rtol=2e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("nesterov", [False, True])
def test_lars_follows_the_mlperf_formula_with_the_lr_inside_the_buffer(nesterov):
    ours = run_ours(LARS, momentum=0.9, eta=0.001, eps=1e-9, nesterov=nesterov)
    assert_close_to(ours, lars_reference(nesterov=nesterov))
    # The zero tensor takes the plain step (ratio 1): lr x its gradient, decay of 0 adding nothing.
    assert ours["z"].abs().sum() > 0


def test_lars_equals_timms_form_while_the_lr_is_constant_and_differs_when_it_changes():
    constant = (0.2, 0.2, 0.2)
    ours = run_ours(LARS, lrs=constant, momentum=0.9, eta=0.001, eps=1e-9)
    assert_close_to(ours, lars_reference(lr_in_buffer=False, lrs=constant))
    changing = run_ours(LARS, momentum=0.9, eta=0.001, eps=1e-9)
    timm_form = lars_reference(lr_in_buffer=False)
    assert not torch.allclose(changing["w"].double(), timm_form["w"], rtol=1e-4)


def test_lamb_follows_the_paper_with_bias_correction_and_exclusions():
    assert_close_to(run_ours(LAMB, betas=(0.9, 0.999), eps=1e-6), lamb_reference())


def test_clip_gradient_norm_is_torchs_rule_on_the_device():
    generator = torch.Generator().manual_seed(3)
    ours = [nn.Parameter(torch.randn(3, 3, generator=generator)) for _ in range(2)]
    theirs = copy.deepcopy(ours)
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn(a.shape, generator=generator) * 10
        b.grad = a.grad.clone()
    total = clip_gradient_norm(torch.optim.SGD(ours, lr=0.1), max_norm=1.0)
    assert isinstance(total, torch.Tensor)  # never a Python number: nothing read on the host
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm=1.0)
    torch.testing.assert_close(total, want)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    before = [p.grad.clone() for p in ours]
    clip_gradient_norm(torch.optim.SGD(ours, lr=0.1), max_norm=10.0)  # below the limit: unchanged
    assert all(torch.equal(p.grad, g) for p, g in zip(ours, before, strict=True))


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 4 * 4, 3))


def config(name: str, **optim) -> TrainConfig:
    cfg = TrainConfig()
    cfg.optim = OptimConfig(name=OptimizerName(name), lr=0.5 if name == "lars" else 1e-2, **optim)
    return cfg


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_norm_weights_and_biases_get_no_decay_and_no_adaptation(name):
    model = small_model()
    adapted, excluded = build_optimizer(config(name), model).param_groups
    assert adapted["weight_decay"] == 5e-4 and not adapted["exclude_from_adaptation"]
    assert excluded["weight_decay"] == 0 and excluded["exclude_from_adaptation"]
    assert [p.ndim for p in adapted["params"]] == [4, 2] and len(excluded["params"]) == 4


def make_trained(cfg: TrainConfig, primed: bool, state: tuple[dict, dict] | None = None):
    """A model and its optimizer, from `state` = (weights, optimizer state) if given."""
    model = small_model()
    if state is not None:
        model.load_state_dict(state[0])
    optimizer = build_optimizer(cfg, model)
    if primed:
        prime_optimizer_state(optimizer)
    if state is not None:
        optimizer.load_state_dict(state[1])
    return model, optimizer


def train(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int, steps: int = 3) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 3, 6, 6, generator=generator)
        y = torch.randint(0, 3, (5,), generator=generator)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()


@pytest.mark.parametrize("name", ["lars", "lamb"])
def test_primed_state_steps_as_lazy_state_and_resumes_bitwise(name):
    cfg = config(name, clip_grad_norm=0.5, eps=1e-6)
    lazy, primed = make_trained(cfg, primed=False), make_trained(cfg, primed=True)
    train(*lazy, seed=1)
    train(*primed, seed=1)
    for a, b in zip(lazy[0].parameters(), primed[0].parameters(), strict=True):
        assert torch.equal(a, b)
    states = list(primed[1].state_dict()["state"].values())
    assert all(isinstance(v, torch.Tensor) for state in states for v in state.values())  # tensors only
    expected = {"momentum_buffer"} if name == "lars" else {"step", "exp_avg", "exp_avg_sq"}
    assert all(set(state) == expected for state in states) and len(states) == 6

    # A checkpoint after 3 steps, loaded by a fresh model and optimizer: the
    # next 2 steps are those of the run that went on, bit for bit.
    saved = copy.deepcopy((primed[0].state_dict(), primed[1].state_dict()))
    train(*primed, seed=2, steps=2)
    resumed, reloaded = make_trained(cfg, primed=True, state=saved)
    train(resumed, reloaded, seed=2, steps=2)
    for a, b in zip(primed[0].parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    if name == "lamb":  # the step count stays a 1-element float32 tensor beside its parameter
        step = next(iter(reloaded.state.values()))["step"]
        assert (step.shape, step.dtype, step.item()) == ((1,), torch.float32, 5.0)


def test_clip_grad_norm_clips_inside_step_and_zero_adds_no_hook():
    assert not build_optimizer(config("lars"), small_model())._optimizer_step_pre_hooks
    cfg = config("lars", clip_grad_norm=0.01)
    cfg.optim.name, cfg.optim.momentum, cfg.optim.weight_decay = OptimizerName.sgd, 0.0, 0.0
    model, reference = small_model(), small_model()
    optimizer = build_optimizer(cfg, model)
    x, y = torch.randn(5, 3, 6, 6), torch.randint(0, 3, (5,))
    for net in (model, reference):
        nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    with torch.no_grad():
        for param in reference.parameters():
            param -= cfg.optim.lr * param.grad
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_poly_schedule_decays_by_the_power_and_stops_at_the_floor():
    schedule = LRSchedule(peak=1.0, warmup_steps=2, total_steps=12, kind=Schedule.poly, min_ratio=0.02)
    values = [schedule(s) for s in range(12)]
    assert values[:3] == [0.5, xla_safe_scalar(1.0), xla_safe_scalar(1.0)]  # warmup, then progress 0
    assert values[7] == pytest.approx((1 - 5 / 10) ** 2)
    assert values[10] == pytest.approx(0.2**2) and values[11] == pytest.approx(0.02)  # 0.1 ** 2: floored
    assert all(a >= b for a, b in zip(values[1:], values[2:], strict=False))
    cfg = config("lars", schedule=Schedule.poly, poly_power=3.0, warmup_epochs=0.5, min_lr_ratio=0.0)
    cfg.epochs = 2
    made = make_schedule(cfg, steps_per_epoch=10, devices=1)
    assert made(5 + 10) == pytest.approx(0.5 * (1 - 10 / 15) ** 3)
    assert made(10**6) not in (0.0, 1.0)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("lars_eta", 0.0, "optim.lars_eta must be a positive number"),
        ("poly_power", -1.0, "optim.poly_power must be a positive number"),
        ("clip_grad_norm", -0.5, "optim.clip_grad_norm must be >= 0"),
        ("betas", [0.9, 1.0], "optim.betas must be two numbers in [0, 1)"),
        ("betas", [0.9], "optim.betas must be two numbers in [0, 1)"),
        ("eps", -1e-8, "optim.eps must be >= 0"),
        ("layer_decay", 1.5, "optim.layer_decay must be in (0, 1] (0 or 1 = off), got 1.5"),
        ("layer_decay", -0.1, "optim.layer_decay must be in (0, 1]"),
        ("layer_decay", float("nan"), "optim.layer_decay must be in (0, 1]"),
    ],
)
def test_optim_fields_are_range_checked(field, value, message):
    optim = OptimConfig()
    setattr(optim, field, value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        optim.check()


def test_adam_family_needs_a_positive_eps_and_lars_may_have_none():
    with pytest.raises(ConfigError, match="optim.eps must be > 0 for optim.name=lamb"):
        OptimConfig(name=OptimizerName.lamb, eps=0.0).check()
    OptimConfig(name=OptimizerName.lars, eps=0.0).check()


def test_lars_and_lamb_recipes_compose(compose_config):
    lars, _ = resolve_config(compose_config("optim=lars"))
    o = lars.optim
    assert (o.name, o.lr, o.schedule, o.poly_power, o.warmup_epochs) == ("lars", 10.0, "poly", 2.0, 5)
    assert (o.lars_eta, o.eps, o.weight_decay, o.nesterov) == (0.001, 0.0, 2e-4, False)
    assert (o.label_smoothing, o.min_lr_ratio) == (0.1, 1e-5)
    lamb, _ = resolve_config(compose_config("optim=lamb"))
    o = lamb.optim
    assert (o.name, o.lr, list(o.betas), o.eps, o.clip_grad_norm) == ("lamb", 5e-3, [0.9, 0.999], 1e-6, 1.0)
    adamw = build_optimizer(config("adamw"), small_model())  # still torch's defaults
    assert (adamw.defaults["betas"], adamw.defaults["eps"]) == ((0.9, 0.999), 1e-8)


XLA_SCRIPT = """
import sys
import numpy as np, torch, torch_xla, torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs, torch_xla.runtime as xr
from tpustream.training.optimizer import LAMB, LARS, clip_gradient_norm
from tpustream.training.optimizer import prime_optimizer_state

spmd = sys.argv[1] == "spmd"
if spmd:
    xr.use_spmd()
    mesh = xs.Mesh(np.arange(4), (4,), ("fsdp",))


def place(tensor, split=True):  # spmd: dim 0 over the 4 devices, as spmd_fsdp splits parameters
    if spmd and tensor.device.type == "xla":
        xs.mark_sharding(tensor, mesh, ("fsdp" if split else None,) + (None,) * (tensor.dim() - 1))
    return tensor


def clip_before_step(optimizer, args, kwargs):
    clip_gradient_norm(optimizer, 0.5)


torch.manual_seed(0)
weights = [torch.randn(8, 3), torch.randn(8), torch.randn(4, 6)]
grads = [[torch.randn(w.shape) for w in weights] for _ in range(5)]
for cls in (LARS, LAMB):
    finals = []
    for device in ("cpu", torch_xla.device()):
        params = [torch.nn.Parameter(place(w.clone().to(device))) for w in weights]
        groups = [{"params": params[::2], "weight_decay": 1e-2},
                  {"params": params[1:2], "weight_decay": 0.0, "exclude_from_adaptation": True}]
        optimizer = cls(groups, lr=0.1)
        optimizer.register_step_pre_hook(clip_before_step)
        prime_optimizer_state(optimizer)
        for param, state in optimizer.state.items():  # as training.spmd.shard_optimizer_state
            for value in state.values():
                place(value, split=value.shape == param.shape)
        met.clear_all()
        for step in range(5):
            for param, grad in zip(params, grads[step]):
                param.grad = place(grad.to(device))
            optimizer.param_groups[0]["lr"] = optimizer.param_groups[1]["lr"] = 0.0123 * (step + 1)
            optimizer.step()
            if device != "cpu":
                torch_xla.sync()
        if device != "cpu":
            reads = met.counter_value("aten::_local_scalar_dense")
            print(cls.__name__, met.metric_data("CompileTime")[0], reads)
        finals.append([p.detach().cpu() for p in params])
    for on_cpu, on_xla in zip(*finals):  # reads on the host: after counting
        torch.testing.assert_close(on_xla, on_cpu, rtol=1e-5, atol=1e-6)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["one-device", "spmd"])
def test_steps_on_xla_compile_once_read_nothing_on_the_host_and_match_eager(mode):
    """Five steps with five learning rates: one graph, no .item() (aten::_local_scalar_dense),
    the eager CPU result; spmd: parameters split over 4 devices, whose norms GSPMD makes global."""
    stdout = run_on_xla(XLA_SCRIPT, mode, devices=4 if mode == "spmd" else 1)
    assert stdout.split("\n")[:2] == ["LARS 1 None", "LAMB 1 None"]


def run_on_xla(script: str, *args: str, devices: int = 1) -> str:
    """The script's output, run on the XLA CPU device in a process of its own."""
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(REPO),
        env=xla_cpu_env(devices),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


# -- optim.layer_decay ------------------------------------------------------------


def tiny_vit() -> nn.Module:
    """timm's ViT-Tiny with 2 blocks on 32-pixel images: layers embeddings, block 0, block 1, head."""
    from tpustream.models import create_model

    torch.manual_seed(0)
    options = {"img_size": 32, "patch_size": 4, "depth": 2}
    return create_model(
        "vit_tiny_patch16_224", num_classes=10, image_size=32, channels=3, library="timm", **options
    )


def effective_decay(group: dict) -> float:
    """A group's weight decay, also where AdamW's is applied by decay_from_step_values."""
    return group.get("hooked_weight_decay", group["weight_decay"])


@pytest.mark.parametrize("name", ["sgd", "adamw", "lars", "lamb"])
def test_layer_decay_groups_and_scales_are_timms(name):
    from timm.optim import param_groups_layer_decay

    model = tiny_vit()
    groups = build_optimizer(config(name, layer_decay=0.75, weight_decay=0.05), model).param_groups
    # timm's optimizer factory also passes model.no_weight_decay() (pos_embed, cls_token);
    # those stay decayed here, as they are without layer decay.
    theirs = param_groups_layer_decay(model, weight_decay=0.05, layer_decay=0.75)
    assert [(g["lr_scale"], effective_decay(g), [id(p) for p in g["params"]]) for g in groups] == [
        (g["lr_scale"], g["weight_decay"], [id(p) for p in g["params"]]) for g in theirs
    ]
    names = {id(p): name for name, p in model.named_parameters()}
    scale_of = {names[id(p)]: group["lr_scale"] for group in groups for p in group["params"]}
    assert scale_of["head.weight"] == scale_of["head.bias"] == 1.0
    assert scale_of["patch_embed.proj.weight"] == scale_of["pos_embed"] == 0.75**3
    # timm's group_matcher puts the final norm with the last block.
    assert scale_of["blocks.1.mlp.fc2.weight"] == scale_of["norm.weight"] == 0.75
    if name in ("lars", "lamb"):
        assert all(g["exclude_from_adaptation"] == (effective_decay(g) == 0) for g in groups)


class FakeFsdpV2(nn.Module):
    """SpmdFullyShardedDataParallel's naming: the wrapped module is its _orig_module."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._orig_module = module


def test_layer_groups_are_the_same_under_spmd_fsdp_wrappers():
    model = tiny_vit()

    def layout(module: nn.Module) -> list:
        groups = build_optimizer(config("lamb", layer_decay=0.75), module).param_groups
        return [(g["lr_scale"], g["exclude_from_adaptation"], [id(p) for p in g["params"]]) for g in groups]

    plain = layout(model)
    model.blocks[0] = FakeFsdpV2(model.blocks[0])  # a nested unit, as fsdp_wrap_min_params makes
    assert layout(FakeFsdpV2(model)) == plain


@pytest.mark.parametrize("name", ["sgd", "adamw", "lars", "lamb"])
def test_each_group_gets_the_schedules_lr_times_its_scale(name):
    cfg = config(name, layer_decay=0.5, warmup_epochs=0.2)
    cfg.epochs = 1
    schedule = make_schedule(cfg, steps_per_epoch=10, devices=1)  # 2 warmup steps, then 8 of cosine
    optimizer = build_optimizer(cfg, tiny_vit())
    assert sorted({g["lr_scale"] for g in optimizer.param_groups}) == [0.125, 0.25, 0.5, 1.0]
    for step, factor in ((1, 1.0), (6, 0.5)):  # the warmup's end; halfway through the cosine
        set_learning_rate(optimizer, schedule(step))
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(cfg.optim.lr * factor * group["lr_scale"], rel=1e-12)


def train_vit(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int, steps: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        set_learning_rate(optimizer, 0.01 * (step + 1))
        optimizer.zero_grad()
        images, labels = (
            torch.randn(2, 3, 32, 32, generator=generator),
            torch.randint(0, 10, (2,), generator=generator),
        )
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()


def test_adamw_with_layer_decay_steps_as_torchs_adamw_over_timms_groups():
    """The weight decay moved into a pre-hook (decay_from_step_values) changes no bit."""
    from timm.optim import param_groups_layer_decay

    ours, reference = tiny_vit(), tiny_vit()
    optimizer = build_optimizer(config("adamw", layer_decay=0.75, weight_decay=0.05), ours)
    groups = param_groups_layer_decay(reference, weight_decay=0.05, layer_decay=0.75)
    train_vit(ours, optimizer, seed=1, steps=3)
    train_vit(reference, torch.optim.AdamW(groups, lr=0.01), seed=1, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), reference.parameters(), strict=True))


def make_vit(cfg: TrainConfig, state: tuple[dict, dict] | None = None):
    model = tiny_vit()
    if state is not None:
        model.load_state_dict(state[0])
    optimizer = build_optimizer(cfg, model)
    prime_optimizer_state(optimizer)
    if state is not None:
        optimizer.load_state_dict(copy.deepcopy(state[1]))
    return model, optimizer


def test_layer_decay_state_resumes_bitwise_and_other_groups_start_fresh(caplog):
    cfg = config("adamw", layer_decay=0.75)
    model, optimizer = make_vit(cfg)
    train_vit(model, optimizer, seed=1, steps=2)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    train_vit(model, optimizer, seed=2, steps=1)
    resumed = make_vit(cfg, saved)
    train_vit(*resumed, seed=2, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed[0].parameters(), strict=True))

    # resume=force under another layer_decay: the same groups, this run's scales.
    other = make_vit(config("adamw", layer_decay=0.5), saved)[1]
    assert sorted({g["lr_scale"] for g in other.param_groups}) == [0.125, 0.25, 0.5, 1.0]
    assert any(state["exp_avg"].abs().sum() > 0 for state in other.state.values())
    # Without layer decay: two groups, not the checkpoint's eight; fresh state and a warning.
    plain = make_vit(config("adamw"), saved)[1]
    assert len(plain.param_groups) == 2 and "starts fresh" in caplog.text
    assert all(state["exp_avg"].abs().sum() == 0 for state in plain.state.values())


def test_layer_decay_is_off_at_0_and_1_and_needs_layer_groups():
    assert (
        not OptimConfig(layer_decay=0.0).layer_decay_on()
        and not OptimConfig(layer_decay=1.0).layer_decay_on()
    )
    OptimConfig(layer_decay=1.0).check()
    with pytest.raises(ConfigError, match="optim.layer_decay needs a model with layer groups"):
        build_optimizer(config("sgd", layer_decay=0.75), small_model())


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([], r"optim.layer_decay needs a model with layer groups .*, and model=small_cnn has none"),
        (["model=torchvision"], "and model=torchvision resnet18 has none"),
    ],
)
def test_layer_decay_refusals_come_before_spawning(compose_config, digits_root, overrides, message):
    with pytest.raises(ConfigError, match=message):
        prepare(
            compose_config(f"data.root={digits_root}", "resume=null", "optim.layer_decay=0.75", *overrides)
        )


def test_a_timm_vit_with_layer_decay_prepares_under_spmd_fsdp(compose_config, digits_root):
    vit = ("model.name=vit_tiny_patch16_224", "+model.options.img_size=32", "+model.options.patch_size=4")
    overrides = ("strategy=spmd_fsdp", "accelerator.num_devices=2", "optim.layer_decay=0.75")
    plan = prepare(compose_config(f"data.root={digits_root}", "resume=null", "model=timm", *vit, *overrides))
    assert plan.cfg.optim.layer_decay == 0.75


def test_layer_decay_default_keeps_older_run_folders_comparable():
    from tpustream.checkpoint import config_differences, schema_defaults

    before = {"optim": {"lr": 0.1}}  # a run made before optim.layer_decay existed
    assert (
        config_differences(before, {"optim": {"lr": 0.1, "layer_decay": 0.0}}, defaults=schema_defaults())
        == []
    )
    now = {"optim": {"lr": 0.1, "layer_decay": 0.75}}
    assert config_differences(before, now, defaults=schema_defaults()) == [
        "optim.layer_decay: (unset) -> 0.75"
    ]
    changed = {"optim": {"lr": 0.1, "layer_decay": 0.65}}
    assert config_differences(now, changed, defaults=schema_defaults()) == ["optim.layer_decay: 0.75 -> 0.65"]


XLA_LAYER_DECAY_SCRIPT = """
import sys
import torch, torch_xla, torch_xla.debug.metrics as met
from tests.test_optimizers import config, tiny_vit
from tpustream.training.optimizer import build_optimizer, prime_optimizer_state, set_learning_rate
from tpustream.training.schedule import make_schedule

for name in sys.argv[1:]:
    model = tiny_vit().to(torch_xla.device())
    cfg = config(name, layer_decay=0.75, warmup_epochs=0.4, clip_grad_norm=1.0)
    cfg.optim.lr, cfg.epochs = 1e-3, 1
    optimizer = build_optimizer(cfg, model)
    prime_optimizer_state(optimizer)
    schedule = make_schedule(cfg, steps_per_epoch=5, devices=1)  # 2 warmup steps, then cosine
    images, labels = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    met.clear_all()
    for step in range(5):
        set_learning_rate(optimizer, schedule(step))
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images.to("xla")), labels.to("xla")).backward()
        optimizer.step()
        torch_xla.sync()
    print(name, met.metric_data("CompileTime")[0], met.counter_value("aten::_local_scalar_dense"))
"""


@pytest.mark.slow
def test_a_vit_with_layer_decay_compiles_its_step_once_on_xla():
    """Eight groups, five learning rates each: with the lrs as Python scalars, their float32
    values met (1 - lr x decay near 1; lr = 1e-3 = 1 - beta2) at some steps only, and AdamW
    compiled 3 graphs, LAMB 2 (LARS shares LAMB's path, SGD compiled 1)."""
    assert run_on_xla(XLA_LAYER_DECAY_SCRIPT, "adamw", "lamb").split("\n")[:2] == [
        "adamw 1 None",
        "lamb 1 None",
    ]


def test_adamw_steps_as_torchs_and_resumes_a_checkpoint_written_before_its_decay_was_hooked():
    """AdamW's decay is always a pre-hook (the end of a cosine made 1 - lr x wd a float32 1.0,
    a constant: one compilation more); torch's own AdamW state dict still loads and steps alike."""
    ours, reference = tiny_vit(), tiny_vit()
    optimizer = build_optimizer(config("adamw", weight_decay=0.05), ours)
    plain = torch.optim.AdamW(
        [
            {"params": [p for p in reference.parameters() if p.ndim > 1], "weight_decay": 0.05},
            {"params": [p for p in reference.parameters() if p.ndim <= 1], "weight_decay": 0.0},
        ],
        lr=0.01,
    )
    train_vit(ours, optimizer, seed=1, steps=2)
    train_vit(reference, plain, seed=1, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), reference.parameters(), strict=True))
    # A checkpoint of torch's plain AdamW (as last.pt held before): this run's hooked decay stays.
    optimizer.load_state_dict(copy.deepcopy(plain.state_dict()))
    assert [(g["weight_decay"], g["hooked_weight_decay"]) for g in optimizer.param_groups] == [
        (0, 0.05),
        (0, 0),
    ]
    train_vit(ours, optimizer, seed=2, steps=1)
    train_vit(reference, plain, seed=2, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), reference.parameters(), strict=True))
