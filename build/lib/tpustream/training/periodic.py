"""The one rule for periodic actions: logging, stop checks, mid-epoch saves, evaluation."""

from __future__ import annotations


def itstime(count: int, every: int, total: int | None = None) -> bool:
    """Whether an action done every `every` counts is due at `count` (and at `total`, the last).

    Never when `every` is 0 (the action is off). As big_vision's ``itstime``:
    one predicate instead of a modulo written a different way at each call
    site. The caller chooses what it counts: the step just trained counted
    from 0 (logging: the first step and every N-th after), steps done since
    the loop started (stop checks), the global step (saves), epochs done
    (evaluation, and after the last one).
    """
    return every > 0 and (count % every == 0 or count == total)
