"""model.remat: recompute each block's activations in the backward pass instead of keeping them.

GPipe's re-materialisation (and timm's set_grad_checkpointing, torchprime's
activation checkpointing): a block's forward keeps only its input; the
backward pass runs the block again to get what its gradients need. Memory
for activations drops from every layer's to every block's input plus one
block's insides, for one more forward pass of compute.

A model's blocks are the modules of each innermost Sequential or ModuleList
made of two or more modules of one class: a ViT's blocks (timm's and
torchvision's), a ResNet's residual blocks, a ConvNeXt stage's blocks; the
same blocks timm's set_grad_checkpointing checkpoints in its ViTs and
ResNets. A block's class is swapped for a subclass whose forward recomputes,
so the model's state_dict keys (and checkpoints) do not change.

On XLA the recomputation must survive the compiler: the forward's and the
recomputed activations are the same expressions of the same inputs, which
XLA's common-subexpression elimination would merge back. torch_xla's
checkpoint puts an optimisation barrier on the block's inputs, weights,
buffers and incoming gradient before the recomputation, which XLA cannot see
through. (torch.utils.checkpoint, which timm's set_grad_checkpointing calls,
does not run on an XLA device with torch 2.9: its RNG handling asks for
torch.xla.) On the native runtime torch.utils.checkpoint, non-reentrant.

BatchNorm inside a recomputed block would update its running statistics
twice a step; the recomputation normalises by the batch's statistics without
updating them, so the running statistics are those of the model without remat.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from tpustream.errors import ConfigError

# Remat subclasses by (block class, on XLA), made once each.
_SUBCLASSES: dict[tuple[type, bool], type] = {}


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules of each innermost Sequential or ModuleList of 2+ modules of one class, in order."""
    blocks = []
    for container in model.modules():
        if not _repeats(container) or not any(p.requires_grad for p in container.parameters()):
            continue
        children = list(container.children())
        if any(_repeats(inner) for child in children for inner in child.modules()):
            continue  # not innermost: its children hold repeated blocks of their own
        blocks.extend(children)
    return blocks


def _repeats(module: nn.Module) -> bool:
    """A Sequential or ModuleList of two or more modules of one class."""
    if not isinstance(module, nn.Sequential | nn.ModuleList):
        return False
    children = list(module.children())
    return len(children) >= 2 and len({type(child) for child in children}) == 1


def check_remat(model: nn.Module, name: str) -> list[nn.Module]:
    """The blocks model.remat would recompute; refuses a model that has none."""
    blocks = model_blocks(model)
    if not blocks:
        raise ConfigError(
            f"model.remat=true: {name} has no blocks to recompute (a Sequential or ModuleList of two or "
            "more modules of one class); set model.remat=false"
        )
    return blocks


def rematerialize(model: nn.Module, name: str, xla: bool) -> int:
    """Make every block of model recompute in the backward pass; returns how many blocks."""
    blocks = check_remat(model, name)
    for block in blocks:
        block.__class__ = _remat_class(type(block), xla)
    return len(blocks)


def _remat_class(cls: type, xla: bool) -> type:
    key = (cls, xla)
    if key not in _SUBCLASSES:
        checkpoint = _xla_checkpoint if xla else _native_checkpoint
        _SUBCLASSES[key] = type(
            f"Remat{cls.__name__}", (cls,), {"forward": _recomputing_forward(cls.forward, checkpoint)}
        )
    return _SUBCLASSES[key]


def _recomputing_forward(forward: Any, checkpoint: Any) -> Any:
    def recomputing(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to keep or recompute
            return forward(self, *args, **kwargs)
        calls = 0

        def run(block: nn.Module, *inputs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return forward(block, *inputs, **kwargs)
            with _batch_statistics_only(block):  # the recomputation: statistics updated once
                return forward(block, *inputs, **kwargs)

        # A method of the block: torch_xla's checkpoint then puts the block's
        # weights and buffers behind its optimisation barrier too.
        return checkpoint(types.MethodType(run, self), *args)

    return recomputing


def _xla_checkpoint(function: Any, *args: Any) -> Any:
    import torch_xla.utils.checkpoint

    return torch_xla.utils.checkpoint.checkpoint(function, *args)


def _native_checkpoint(function: Any, *args: Any) -> Any:
    import torch.utils.checkpoint

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


@contextlib.contextmanager
def _batch_statistics_only(block: nn.Module) -> Iterator[None]:
    """BatchNorm in training mode normalising by the batch without updating its running statistics.

    A momentum of 0 keeps the running statistics as they are, and the running
    count is set aside; the kernel runs as in the forward pass, so a
    non-reentrant checkpoint sees the tensors it saved there.
    """
    norms = [
        m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]
    kept = [(norm.momentum, norm.num_batches_tracked) for norm in norms]
    for norm in norms:
        norm.momentum = 0.0
        norm.num_batches_tracked = None
    try:
        yield
    finally:
        for norm, (momentum, count) in zip(norms, kept, strict=True):
            norm.momentum = momentum
            norm.num_batches_tracked = count
