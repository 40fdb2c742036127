"""The optimizer: parameter groups, clipping, primed state, each step's lr (training.schedule draws it)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from tpustream.config import OptimizerName, TrainConfig
from tpustream.errors import ConfigError
from tpustream.training.optimizers import (
    LAMB,
    LARS,
    LayerwiseOptimizer,
    clip_gradient_norm,
    step_values,
)
from tpustream.training.schedule import xla_safe_scalar

log = logging.getLogger(__name__)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """This step's lr in every group: lr x the group's lr_scale (optim.layer_decay; 1 without).

    As timm's schedulers apply it. The train step still compiles once with
    one lr per layer (measured on the XLA CPU device, every optimizer): LARS,
    LAMB and AdamW's weight decay take them as step_values (optimizers.step_values
    says why Python floats would not do); torch's SGD uses each as a negative
    float32 scalar, -lr, apart from the other scalars and from each other
    (layer scales differ by far more than float32's precision); AdamW's update
    uses lr / bias correction as a float64 scalar.
    """
    for group in optimizer.param_groups:
        group["lr"] = xla_safe_scalar(lr * group.get("lr_scale", 1.0))


# SpmdFullyShardedDataParallel (strategy=spmd_fsdp) holds the model's own
# parameters under this attribute, once per FSDP unit: their names gain it
# (training.spmd's WRAPPER_PREFIX; imported from there would be a cycle).
FSDPV2_MODULE = "_orig_module"


def layer_matcher(model: nn.Module) -> Callable[..., Any] | None:
    """timm's group_matcher of the model (under spmd_fsdp's wrappers), or None if it has none."""
    while not hasattr(model, "group_matcher") and hasattr(model, FSDPV2_MODULE):
        model = getattr(model, FSDPV2_MODULE)
    return getattr(model, "group_matcher", None)


def layer_decay_groups(model: nn.Module, weight_decay: float, layer_decay: float) -> list[dict[str, Any]]:
    """timm's param_groups_layer_decay (BEiT's layer-wise lr decay) with our weight-decay rule.

    Layers come from the model's group_matcher as timm numbers them (the
    embeddings 0, blocks in order, unmatched parameters such as the head
    last); layer i of n trains at lr x layer_decay ** (n - 1 - i), its
    group's lr_scale. One group per layer and decay, in timm's order. The
    difference from timm's optimizer factory: its no_weight_decay_list
    (model.no_weight_decay(): a ViT's pos_embed and cls_token) is not
    applied, so that only norm weights and biases go undecayed, as without
    layer decay.
    """
    # timm.models.group_parameters takes a module and names its parameters
    # itself; this is its body, given the names without spmd_fsdp's wrappers.
    from timm.models._manipulate import group_with_matcher

    matcher = layer_matcher(model)
    if matcher is None:
        raise ConfigError(
            f"optim.layer_decay needs a model with layer groups (timm's group_matcher); "
            f"{type(model).__name__} has none: use model=timm, or optim.layer_decay=0"
        )
    named = [(name.replace(f"{FSDPV2_MODULE}.", ""), param) for name, param in model.named_parameters()]
    layer_of = group_with_matcher(named, matcher(coarse=False), reverse=True)
    layer_max = max(layer_of.values())
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    for name, param in named:
        layer = layer_of.get(name, layer_max)
        decayed = param.ndim > 1
        if (layer, decayed) not in groups:
            groups[layer, decayed] = {
                "params": [],
                "weight_decay": weight_decay if decayed else 0.0,
                "lr_scale": layer_decay ** (layer_max - layer),
            }
        groups[layer, decayed]["params"].append(param)
    return list(groups.values())


def parameter_groups(cfg: TrainConfig, model: nn.Module) -> tuple[list[dict[str, Any]], list[bool]]:
    """The optimizer's groups, and which of them hold norm weights and biases (no decay).

    Two groups, weights and the rest, or with optim.layer_decay two per layer.
    Norm weights and biases are the 1-D parameters (sharded ones keep their
    shape: FSDP2's DTensors and FSDPv2's tensors are global values).
    """
    o = cfg.optim
    if o.layer_decay_on():
        groups = layer_decay_groups(model, o.weight_decay, o.layer_decay)
        return groups, [all(p.ndim <= 1 for p in group["params"]) for group in groups]
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": o.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return groups, [False, True]


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    """cfg.optim's optimizer over parameter_groups: weights, and norm weights and biases (per layer).

    Norm weights and biases get no weight decay, and under lars and lamb no
    layer-wise adaptation either (the MLPerf ResNet-50 reference's skip
    list). With optim.clip_grad_norm, gradients are clipped at the start
    of every step() call: after the replicas' gradients are averaged
    (xm.optimizer_step, the gloo all-reduce and FSDP2's reduce-scatter all come
    first) and before the update.
    """
    o = cfg.optim
    groups, norms_and_biases = parameter_groups(cfg, model)
    if o.name == OptimizerName.sgd:
        optimizer = torch.optim.SGD(
            groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov and o.momentum > 0
        )
    elif o.name == OptimizerName.adamw:
        optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
        decay_from_step_values(optimizer)
    else:
        for group, excluded in zip(groups, norms_and_biases, strict=True):
            group["exclude_from_adaptation"] = excluded
        if o.name == OptimizerName.lars:
            optimizer = LARS(
                groups,
                lr=o.lr,
                momentum=o.momentum,
                eta=o.lars_eta,
                eps=o.eps,
                nesterov=o.nesterov and o.momentum > 0,
            )
        else:
            optimizer = LAMB(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps)
    if o.clip_grad_norm > 0:

        def clip_before_step(opt: torch.optim.Optimizer, args, kwargs) -> None:
            clip_gradient_norm(opt, o.clip_grad_norm)

        optimizer.register_step_pre_hook(clip_before_step)
    keep_groups_on_load(optimizer)
    return optimizer


def decay_from_step_values(optimizer: torch.optim.AdamW) -> None:
    """AdamW's decoupled weight decay, w x (1 - lr x weight_decay), with the factors as step_values.

    torch multiplies by the factor as a Python scalar; with one lr per layer
    the factors, all near 1, round together in float32 at some steps and not
    at others as the lr moves, and each pattern compiled a graph of its own
    (measured: 3 compilations in 5 steps of a ViT). With one lr too: at the
    end of a cosine decay 1 - lr x weight_decay rounds to 1.0 in float32,
    which torch_xla bakes into the graph as a constant (measured: a timm ViT
    compiled once more at its second-to-last step). Here torch's groups decay
    by 0 and a step pre-hook multiplies by the same float32 factors as data.
    The lr itself reaches torch's update as a float64 scalar, and float64
    products of distinct layer scales stay distinct.
    """
    for group in optimizer.param_groups:
        group["hooked_weight_decay"], group["weight_decay"] = group["weight_decay"], 0.0

    def decay_before_step(opt: torch.optim.Optimizer, args, kwargs) -> None:
        decaying = [group for group in opt.param_groups if group["hooked_weight_decay"]]
        device = next((p.device for group in decaying for p in group["params"]), None)
        if device is None:
            return
        factors = step_values([1 - g["lr"] * g["hooked_weight_decay"] for g in decaying], device)
        with torch.no_grad():  # pre-hooks run outside step()'s no_grad
            for group, factor in zip(decaying, factors.unbind(), strict=True):
                for param in group["params"]:
                    if param.grad is not None:  # torch's AdamW leaves a parameter without one alone
                        param.mul_(factor)

    optimizer.register_step_pre_hook(decay_before_step)


def keep_groups_on_load(optimizer: torch.optim.Optimizer) -> None:
    """Loaded state keeps this run's group settings (lr_scale, hooked decay); other groups start fresh.

    torch's load_state_dict replaces each group's settings with the saved ones
    and fails on groups of other sizes: a run resumed (resume=force, or
    another run's checkpoint) under another optim.layer_decay would keep the
    checkpoint's scales, or stop on torch's ValueError in every replica.
    Groups of other sizes: a warning, and the state starts fresh, as for a
    checkpoint of another strategy.
    """
    scales = [group.get("lr_scale") for group in optimizer.param_groups]
    hooked = [group.get("hooked_weight_decay") for group in optimizer.param_groups]

    def fresh_if_other_groups(opt: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any] | None:
        saved = [len(group["params"]) for group in state["param_groups"]]
        mine = [len(group["params"]) for group in opt.param_groups]
        if saved == mine:
            return None
        log.warning(
            "the checkpoint's optimizer has parameter groups of %s parameters, this run's %s (another "
            "optim.layer_decay?): its state starts fresh (model weights and training position are restored)",
            saved,
            mine,
        )
        return opt.state_dict()

    def restore_scales(opt: torch.optim.Optimizer) -> None:
        # And AdamW's hooked decay: a checkpoint from before it was hooked has
        # weight_decay set and no hooked_weight_decay.
        for group, scale, decay in zip(opt.param_groups, scales, hooked, strict=True):
            group.pop("lr_scale", None)
            if scale is not None:
                group["lr_scale"] = scale
            if decay is not None:
                group["hooked_weight_decay"], group["weight_decay"] = decay, 0.0

    optimizer.register_load_state_dict_pre_hook(fresh_if_other_groups)
    optimizer.register_load_state_dict_post_hook(restore_scales)


def _is_dtensor(tensor: torch.Tensor) -> bool:
    return type(tensor).__name__ == "DTensor"  # without importing torch.distributed.tensor


def prime_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer state that torch creates lazily at the first step.

    Lazy creation makes the first step a different graph from every later
    one, i.e. one more compilation of the largest graph (minutes for a
    ResNet-50 on TPU). Zero state gives the same update as lazy state: SGD's
    buffer becomes 0 * momentum + grad = grad, Adam's moments start at 0.
    Zeros are made on the host: zeros made on the device would be constants
    in the first graph, not data, and change its hash all the same. LARS and
    LAMB name their state themselves (``initial_state``).
    """

    def host_zeros(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype).to(device)

    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state[param]
            if state or _is_dtensor(param):
                # FSDP2's sharded parameters (native runtime: no graph to keep
                # whole) get their state as torch makes it, sharded like them.
                continue

            def zeros(p=param):
                return host_zeros(p.shape, p.dtype, p.device)

            if isinstance(optimizer, LayerwiseOptimizer):
                state.update(optimizer.initial_state(param, group, host_zeros))
            elif isinstance(optimizer, torch.optim.SGD) and group["momentum"] > 0:
                state["momentum_buffer"] = zeros()
            elif isinstance(optimizer, torch.optim.AdamW):
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = zeros()
                state["exp_avg_sq"] = zeros()
