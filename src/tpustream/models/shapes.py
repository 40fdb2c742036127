"""How a model's tensors and a set of weights differ, in the words of a one-line error."""

from __future__ import annotations

from collections.abc import Mapping, Set

Shapes = Mapping[str, tuple[int, ...]]


def describe_state_difference(
    model: Shapes, weights: Shapes, weights_as: str, model_as: str, ignore: Set[str] = frozenset()
) -> str | None:
    """Tensors that differ in shape, the model's missing from the weights, the weights' not in the model.

    Each with its count and first name, "; "-joined; None where they match.
    weights_as, model_as: how each side's shape is named ("saved", "rebuilt").
    ignore: the model's tensors that may differ or be missing (a head left fresh).
    """
    missing = sorted(set(model) - set(weights) - set(ignore))
    unexpected = sorted(set(weights) - set(model))
    shared = set(model) & set(weights)
    differ = sorted(key for key in shared if model[key] != weights[key] and key not in ignore)
    parts = []
    if differ:
        first = differ[0]
        parts.append(
            f"{len(differ)} tensor(s) differ in shape (first {first}: {weights[first]} {weights_as}, "
            f"{model[first]} {model_as})"
        )
    if missing:
        parts.append(f"{len(missing)} missing from the weights (first {missing[0]})")
    if unexpected:
        parts.append(f"{len(unexpected)} not in the model (first {unexpected[0]})")
    return "; ".join(parts) or None
