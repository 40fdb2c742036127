"""Batches that stay on the device (data.synthetic): put there once, then handed to every step as they are.

A source whose ``resident`` attribute is true (data.read.synthetic_batch's) holds
one batch; copying it again each step would measure the copy, which is the
input's cost, not the step's. Each runtime's device loader gives it its own
way of putting a batch on the device (``place``: what its loader does to
every batch) and keeps what that loader does per step (``mark_step``: XLA's
graph cut at every batch boundary), so the trainer cannot tell the
difference. The wait for each batch is timed as for any loader (about 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from tpustream.observe.timing import InputWait, timed


def is_resident(loader: Iterable) -> bool:
    """Whether loader's batches are on the device already (it is given a place to put them first)."""
    return bool(getattr(loader, "resident", False))


def resident_batches(
    source,
    place: Callable[[dict], dict],
    wait: InputWait | None,
    mark_step: Callable[[], None] | None = None,
) -> Iterator:
    """source's batches, placed once with place; mark_step at each batch boundary and after the last."""
    source.place(place)
    for batch in timed(source, wait):
        if mark_step is not None:
            # As MpDeviceLoader does before handing out each batch: the previous
            # step's graph is cut and dispatched, so every step is one graph.
            mark_step()
        yield batch
    if mark_step is not None:
        mark_step()
