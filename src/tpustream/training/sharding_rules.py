"""How each parameter is split over the mesh: tensor-parallel rules by name, FSDPv2's split for the rest.

A rule is (parameter-name pattern, partition spec), as torchprime and MaxText
write them; the first rule whose glob matches the plain model's parameter
name (no wrapper prefixes) gives its spec, one entry per dimension: a mesh
axis, a tuple of them, or None. Parameters no rule matches are split as
FSDPv2 splits them: their largest dimension over ``fsdp``. Gradients and
optimizer state follow their parameter.

The built-in rules are Megatron's split of a transformer block: the
attention's qkv projection and the MLP's first layer by output features
(each device computes its heads and its part of the hidden layer), the
attention's output projection and the MLP's second layer by input features
(each device's partial sums are added by one all-reduce), their weights'
other dimension over fsdp. GSPMD inserts the collectives from the specs.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch.nn as nn

from tpustream.errors import ConfigError
from tpustream.runtime.spmd import fsdp_partition_spec

log = logging.getLogger(__name__)

Spec = tuple[Any, ...]
Rule = tuple[str, Spec]

BY_OUTPUT: Spec = ("tensor", "fsdp")  # a Linear weight is [out, in]
BY_INPUT: Spec = ("fsdp", "tensor")
OUTPUT_BIAS: Spec = ("tensor",)

BUILTIN_RULES: tuple[Rule, ...] = (
    # timm's ViT family (VisionTransformer, DeiT, EVA and the models sharing its Block):
    # Attention's fused qkv or separate q/k/v projections (EVA's q_bias and v_bias too)
    # and proj, Mlp's fc1 (SwiGLU's fc1_g and fc1_x, and the norm over its hidden layer) and fc2.
    ("*.attn.qkv.weight", BY_OUTPUT),
    ("*.attn.qkv.bias", OUTPUT_BIAS),
    ("*.attn.[qkv]_proj.weight", BY_OUTPUT),
    ("*.attn.[qkv]_proj.bias", OUTPUT_BIAS),
    ("*.attn.[qkv]_bias", OUTPUT_BIAS),
    ("*.attn.proj.weight", BY_INPUT),
    ("*.mlp.fc1*.weight", BY_OUTPUT),
    ("*.mlp.fc1*.bias", OUTPUT_BIAS),
    ("*.mlp.norm.*", OUTPUT_BIAS),
    ("*.mlp.fc2.weight", BY_INPUT),
    # torchvision's VisionTransformer: nn.MultiheadAttention, and MLPBlock's Linears at 0 and 3.
    ("*.self_attention.in_proj_weight", BY_OUTPUT),
    ("*.self_attention.in_proj_bias", OUTPUT_BIAS),
    ("*.self_attention.out_proj.weight", BY_INPUT),
    ("*.mlp.0.weight", BY_OUTPUT),
    ("*.mlp.0.bias", OUTPUT_BIAS),
    ("*.mlp.3.weight", BY_INPUT),
)


def rules_of(configured: Sequence[Any] | None) -> tuple[Rule, ...]:
    """mesh.rules as (pattern, spec) pairs; null = the built-in rules."""
    if configured is None:
        return BUILTIN_RULES
    return tuple((str(pattern), _spec(entries)) for pattern, entries in configured)


def _spec(entries: Sequence[Any]) -> Spec:
    return tuple(tuple(entry) if isinstance(entry, list | tuple) else entry for entry in entries)


def _axes(spec: Spec) -> list[tuple[int, str]]:
    """(dimension, axis name) for every axis a spec names."""
    named = []
    for dim, entry in enumerate(spec):
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None:
                named.append((dim, name))
    return named


def parameter_specs(model: nn.Module, tensor: int, rules: Sequence[Rule]) -> dict[str, Spec]:
    """Every parameter's partition spec, by its name in model; refuses what the mesh cannot split.

    The rules apply on a tensor axis of 2 or more; without one, FSDPv2's split
    is every parameter's.

    Checked here, before anything is placed or compiled: a rule's spec has one
    entry per dimension of what it matches, and mesh.tensor divides every
    dimension split over it and the heads of every attention module a rule
    splits. tensor: the mesh's tensor axis size.
    """
    specs: dict[str, Spec] = {}
    heads = _heads_by_parameter(model)
    for name, param in model.named_parameters():
        # Without a tensor axis every parameter is split as FSDPv2 splits it (spmd_fsdp as it was).
        matches = (spec for pattern, spec in rules if tensor > 1 and fnmatch.fnmatchcase(name, pattern))
        spec = next(matches, None)
        if spec is None:
            specs[name] = fsdp_partition_spec(param.shape)
            continue
        if len(spec) != param.dim():
            raise ConfigError(
                f"mesh.rules: the spec {list(spec)} has {len(spec)} entries, but {name} has "
                f"{param.dim()} dimension(s) {list(param.shape)}"
            )
        for dim, axis in _axes(spec):
            if axis == "tensor" and param.shape[dim] % tensor:
                raise ConfigError(
                    f"mesh.tensor={tensor} does not divide dimension {dim} of {name} ({param.shape[dim]})"
                )
            if axis == "tensor" and name in heads and heads[name][1] % tensor:
                module, count = heads[name]
                raise ConfigError(f"mesh.tensor={tensor} does not divide the {count} heads of {module}")
        specs[name] = spec
    return specs


def _heads_by_parameter(model: nn.Module) -> dict[str, tuple[str, int]]:
    """(attention module, its head count) for each parameter of a module that has num_heads."""
    heads = {}
    for module_name, module in model.named_modules():
        count = getattr(module, "num_heads", None)
        if isinstance(count, int):
            for name, _ in module.named_parameters():
                heads[f"{module_name}.{name}" if module_name else name] = (module_name, count)
    return heads


def tensor_split(specs: Mapping[Any, Spec]) -> list[Any]:
    """The parameters (the keys of specs: names or the parameters) split over the tensor axis."""
    return [key for key, spec in specs.items() if any(axis == "tensor" for _, axis in _axes(spec))]


def announce(specs: Mapping[Any, Spec], tensor: int, model_name: str) -> None:
    """Say once what the tensor axis does for this model."""
    if tensor == 1:
        return
    split = tensor_split(specs)
    if not split:
        log.warning(
            "mesh.tensor=%d: no mesh.rules pattern matches a parameter of %s, so the tensor axis holds "
            "whole copies (it splits nothing; its devices repeat each other's work)",
            tensor,
            model_name,
        )
        return
    log.info("mesh.tensor=%d splits %d parameter(s) of %s by mesh.rules", tensor, len(split), model_name)
