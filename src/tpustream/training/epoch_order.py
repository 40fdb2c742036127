"""An epoch's training order as a checkpoint records it (its data plan), and how two differ, in words.

A checkpoint's data plan is its training loader's state at the trained
position (tpustream.data.ShardLoader.state_dict): beside the position, the
keys below, which the order depends on. Checkpoints written before hold
these keys alone.

A position inside an epoch (step s) means "the samples of the order's first
s steps are trained". Whether it holds for a resumed run depends on whether
the two data plans give every step the same samples (``same_order``); where
they do not, the messages say what changed (``describe_change``) rather than
printing the plans.
"""

from __future__ import annotations

# What an epoch's order depends on without canonical streams (data.streams=0, or a run
# begun before them): every reader's share of the epoch follows replicas x batch x workers.
PER_READER_ORDER_KEYS = ("world_size", "batch_size", "num_workers", "steps_per_epoch", "seed")
# What an epoch's order depends on under a canonical partition (data.read.layout).
CANONICAL_ORDER_KEYS = ("global_batch", "streams", "stream_buffer", "steps_per_epoch", "seed")
# Where one side has no partition: the per-reader order, and whether there is one.
ORDER_KEYS = (*PER_READER_ORDER_KEYS, "streams")
# A data plan's values in words (describe_change).
PLAN_WORDS = {
    "world_size": "{} replica(s)",
    "batch_size": "a replica batch of {}",
    "num_workers": "{} worker(s)",
    "global_batch": "a global batch of {}",
    "streams": "{} canonical stream(s)",
    "stream_buffer": "stream buffers of {}",
    "steps_per_epoch": "{} steps an epoch",
    "seed": "seed {}",
}


def same_order(saved: dict[str, int] | None, current: dict[str, int]) -> bool:
    """Whether two data plans give every global step of an epoch the same samples."""
    if saved is None:
        return False
    keys = CANONICAL_ORDER_KEYS if saved.get("streams") and current.get("streams") else ORDER_KEYS
    return all(saved.get(key) == current.get(key) for key in keys)


def describe_shape(plan: dict[str, int] | None) -> str:
    """A data plan's shape in words: replicas x batch, workers."""
    if not plan:
        return "an unknown plan"
    return (
        f"{plan.get('world_size')} replica(s) x batch {plan.get('batch_size')}, "
        f"{plan.get('num_workers')} worker(s)"
    )


def describe_value(key: str, value: object) -> str:
    """One data plan value in words: '4 worker(s)', 'no canonical streams'."""
    if key == "streams" and not value:
        return "no canonical streams"
    return PLAN_WORDS[key].format(value)


def describe_change(saved: dict[str, int] | None, current: dict[str, int]) -> str:
    """What changed between two data plans' orders, in words: '2 worker(s) -> 4 worker(s)'.

    Under canonical streams on both sides only what the order depends on is
    named (the shape may change freely there); otherwise the shape too.
    """
    if not saved:
        return f"an unknown plan -> {describe_shape(current)}"
    if saved.get("streams") and current.get("streams"):
        keys: tuple[str, ...] = CANONICAL_ORDER_KEYS
    elif saved.get("streams") or current.get("streams"):
        keys = ("streams", *PER_READER_ORDER_KEYS)
    else:
        keys = PER_READER_ORDER_KEYS
    changes = [
        f"{describe_value(key, saved.get(key))} -> {describe_value(key, current.get(key))}"
        for key in keys
        if saved.get(key) != current.get(key)
    ]
    return ", ".join(changes) or "the same order"
