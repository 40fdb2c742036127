"""The optimizer: LARS and LAMB written for XLA, parameter groups, clipping, primed state, each step's lr.

``build_optimizer`` makes the run's optimizer from optim.* (torch's SGD and
AdamW, or LARS and LAMB below), with weight-decay and layer-decay groups;
``set_learning_rate`` applies the step's lr (training.schedule draws it).

LARS and LAMB, the layer-wise adaptive optimizers of large-batch recipes: every
step is device work only: norms, trust ratios and bias corrections are
tensors, chosen between with ``torch.where``; nothing is read back to the host,
no branch depends on a tensor's value and every shape is static, so the step
traces to the same graph each time. The state is tensors only (``initial_state``
says which, for ``prime_optimizer_state``), so a checkpoint resumes bit
for bit.

A group flagged ``exclude_from_adaptation`` (norm weights and biases) takes
plain steps, as the MLPerf ResNet-50 reference leaves them out of LARS
(``skip_list=['batch_normalization', 'bias', 'bn']``, mlcommons/training
image_classification/tensorflow2/common.py).

Norms are per parameter, over whole parameters (ddp) or GSPMD's sharded
tensors, which are global values (spmd_fsdp).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.optim.optimizer import ParamsT

from tpustream.config import OptimizerName, TrainConfig
from tpustream.errors import ConfigError
from tpustream.training.schedule import xla_safe_scalar

log = logging.getLogger(__name__)

# Makes a zero state tensor: (shape, dtype, device) -> tensor.
Zeros = Callable[[torch.Size, torch.dtype, torch.device], torch.Tensor]


def device_zeros(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def squared_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's sum of squares, in float32, as one 1-D tensor."""
    return torch.stack([t.detach().float().square().sum() for t in tensors])


def trust_ratio(
    numerator: torch.Tensor, denominator: torch.Tensor, w_norm: torch.Tensor, g_norm: torch.Tensor
) -> torch.Tensor:
    """numerator / denominator where |w| and |g| are positive, else 1 (a zero tensor gets the plain step)."""
    return torch.where(torch.logical_and(w_norm > 0, g_norm > 0), numerator / denominator, 1.0)


def step_values(values: list[float], device: torch.device) -> torch.Tensor:
    """Numbers that change every step (learning rates) as one float32 vector of data on `device`.

    torch_xla feeds a Python scalar, or a 0-dim tensor copied from the host,
    through a cache keyed by its value, and equal values become one input of
    the graph: per-group learning rates (optim.layer_decay) that meet each
    other or a constant (eta, 1 - beta2) in float32 at some steps and not at
    others made other graphs, one compilation each (measured on the XLA CPU
    device: 2 and 3 compilations in 5 steps of a ViT). A vector copied from
    the host is plain data and its elements are views: one graph whatever
    the values.
    """
    return torch.tensor(values, dtype=torch.float32).to(device)


def bias_correction(beta: float, count: torch.Tensor) -> torch.Tensor:
    """1 - beta ** count on the device, as -expm1(count x log beta).

    The direct form in float32 starts from beta rounded to float32, and 1 -
    0.999 ** count then loses 1e-5 of its value (measured: LAMB's first steps
    6e-6 away from the float64 formula); log beta is taken in float64 here.
    """
    log_beta = math.log(beta) if beta > 0 else -math.inf
    return -torch.expm1(count * log_beta)


class LayerwiseOptimizer(torch.optim.Optimizer):
    """What LARS and LAMB share: groups, and state made by ``initial_state``."""

    def __init__(self, params: ParamsT, defaults: dict):
        super().__init__(params, {**defaults, "exclude_from_adaptation": False})

    def initial_state(self, param: torch.Tensor, group: dict, zeros: Zeros) -> dict[str, torch.Tensor]:
        """The state a parameter starts with, its tensors made by ``zeros``."""
        raise NotImplementedError

    def learning_rates(self) -> list[torch.Tensor]:
        """Each group's lr for this step, as data on the device (step_values)."""
        device = next((p.device for group in self.param_groups for p in group["params"]), None)
        return list(step_values([group["lr"] for group in self.param_groups], device).unbind())

    def update_group(self, group: dict, lr: torch.Tensor, params: list[torch.Tensor]) -> None:
        """One group's update: its parameters that have a gradient, at this step's lr (a device scalar)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, lr in zip(self.param_groups, self.learning_rates(), strict=True):
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                self.update_group(group, lr, params)
        return loss

    def state_of(self, param: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
        state = self.state[param]
        if not state:  # not primed: zeros made here are constants of this step's graph
            state.update(self.initial_state(param, group, device_zeros))
        return state


class LARS(LayerwiseOptimizer):
    """LARS: SGD with momentum whose step for each tensor is scaled by a trust ratio.

    You, Gitman and Ginsburg 2017, "Large Batch Training of Convolutional
    Networks" (arXiv:1708.03888), Algorithm 1, in the form of the MLPerf
    ResNet-50 reference (mlcommons/training image_classification/tensorflow2/
    lars_optimizer.py), for each tensor w with gradient g:

        ratio = eta |w| / (|g| + wd |w| + eps)   (1 where |w| or |g| is 0)
        v     = momentum v + lr ratio (g + wd w)
        w     = w - v                            (Nesterov: w - (momentum v + lr ratio (g + wd w)))

    The learning rate is inside the buffer, as in the reference's Keras
    momentum; timm's Lars (torch SGD's form, lr applied after the buffer)
    makes the same steps while lr is constant. Excluded groups: ratio 1.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        eta: float = 0.001,
        eps: float = 0.0,
        nesterov: bool = False,
    ):
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta, eps=eps, nesterov=nesterov
        )
        super().__init__(params, defaults)

    def initial_state(self, param, group, zeros):
        return (
            {"momentum_buffer": zeros(param.shape, param.dtype, param.device)}
            if group["momentum"] > 0
            else {}
        )

    def update_group(self, group: dict, lr: torch.Tensor, params: list[torch.Tensor]) -> None:
        momentum, decay = group["momentum"], group["weight_decay"]
        if group["exclude_from_adaptation"]:
            rates = [lr] * len(params)
        else:
            squares = squared_norms([*params, *(p.grad for p in params)])
            w_norms, g_norms = squares.sqrt().split(len(params))
            denominators = g_norms + decay * w_norms + group["eps"]
            ratios = trust_ratio(group["eta"] * w_norms, denominators, w_norms, g_norms)
            rates = list((lr * ratios).unbind())
        for param, rate in zip(params, rates, strict=True):
            direction = param.grad if decay == 0 else param.grad.add(param, alpha=decay)
            step = direction.mul(rate)
            if momentum > 0:
                buffer = self.state_of(param, group)["momentum_buffer"]
                buffer.mul_(momentum).add_(step)
                step = step.add(buffer, alpha=momentum) if group["nesterov"] else buffer
            param.sub_(step)


class LAMB(LayerwiseOptimizer):
    """LAMB: Adam's step plus weight decay, scaled per tensor by |w| / |step|.

    You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT
    in 76 Minutes" (arXiv:1904.00962), Algorithm 2 with phi the identity, for
    each tensor w with gradient g at step t:

        m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
        u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd w
        w = w - lr ratio u,      ratio = |w| / |u|   (1 where |w| or |u| is 0)

    as timm's Lamb computes it (without its built-in gradient clipping: that
    is optim.clip_grad_norm here). Excluded groups: ratio 1. The step count t
    is a float32 tensor on the parameter's device, so the bias corrections are
    computed there; ``capturable`` tells torch's load_state_dict to put it
    back on the device (it keeps other optimizers' ``step`` on the host). It
    has one element, not none: torch_xla makes a 0-dim 0 or 1 copied from the
    host a constant of the graph, so the primed first step (and a resume after
    step 1) compiled graphs of their own (measured on the XLA CPU device).
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, capturable=True)
        super().__init__(params, defaults)

    def initial_state(self, param, group, zeros):
        return {
            "step": zeros(torch.Size([1]), torch.float32, param.device),
            "exp_avg": zeros(param.shape, param.dtype, param.device),
            "exp_avg_sq": zeros(param.shape, param.dtype, param.device),
        }

    def update_group(self, group: dict, lr: torch.Tensor, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        updates = []
        for param in params:
            state = self.state_of(param, group)
            count = state["step"].add_(1).squeeze(0)
            state["exp_avg"].lerp_(param.grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
            first = state["exp_avg"] / bias_correction(beta1, count)
            second = (state["exp_avg_sq"] / bias_correction(beta2, count)).sqrt_().add_(group["eps"])
            update = first.div_(second)
            if group["weight_decay"] != 0:
                update.add_(param, alpha=group["weight_decay"])
            updates.append(update)
        if group["exclude_from_adaptation"]:
            rates = [lr] * len(params)
        else:
            squares = squared_norms([*params, *updates])
            w_norms, u_norms = squares.sqrt().split(len(params))
            rates = list((lr * trust_ratio(w_norms, u_norms, w_norms, u_norms)).unbind())
        for param, update, rate in zip(params, updates, rates, strict=True):
            param.sub_(update.mul_(rate))


def clip_gradient_norm(optimizer: torch.optim.Optimizer, max_norm: float):
    """Scale every gradient by min(1, max_norm / (total norm + 1e-6)), on the device.

    torch.nn.utils.clip_grad_norm_'s rule over the optimizer's parameters; the
    total norm is a tensor, never read on the host. Returns it.
    """
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    total = squared_norms(grads).sum().sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.mul_(scale.to(grad.dtype))
    return total


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """This step's lr in every group: lr x the group's lr_scale (optim.layer_decay; 1 without).

    As timm's schedulers apply it. The train step still compiles once with
    one lr per layer (measured on the XLA CPU device, every optimizer): LARS,
    LAMB and AdamW's weight decay take them as step_values (step_values
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
