"""LARS and LAMB, the layer-wise adaptive optimizers of large-batch recipes, written for XLA.

Every step is device work only: norms, trust ratios and bias corrections are
tensors, chosen between with ``torch.where``; nothing is read back to the host,
no branch depends on a tensor's value and every shape is static, so the step
traces to the same graph each time. The state is tensors only (``initial_state``
says which, for ``optim.prime_optimizer_state``), so a checkpoint resumes bit
for bit.

A group flagged ``exclude_from_adaptation`` (norm weights and biases) takes
plain steps, as the MLPerf ResNet-50 reference leaves them out of LARS
(``skip_list=['batch_normalization', 'bias', 'bn']``, mlcommons/training
image_classification/tensorflow2/common.py).

Norms are per parameter, over whole parameters (ddp) or GSPMD's sharded
tensors, which are global values (spmd_fsdp).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.optimizer import ParamsT

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
