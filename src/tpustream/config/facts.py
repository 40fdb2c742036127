"""How a config key is declared: ``setting(default, "what it does", ...facts)`` beside its field.

The facts are what other rooms need to know about a key without a list of
their own: whether a continued run folder may change it (and whether the
checkpoint's fingerprint holds it), whether the training step a synthetic
run measures depends on it, whether it is a path made absolute at start.
A section's facts hold for its keys unless a key says otherwise
(config.keys resolves them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

_NO_DEFAULT = object()
# Field metadata key holding a field's KeyFacts.
FACTS = "tpustream"


class OnResume(str, Enum):
    """What a run folder continued with resume=auto may do with a key."""

    # Must equal the checkpoint's: it changes what is trained.
    keep = "keep"
    # May differ, and the checkpoint's fingerprint still holds it: where and how the
    # run is laid out and fed (accelerator, strategy, workers), not what it trains.
    change = "change"
    # May differ with the replica count under canonical streams, the global batch kept
    # (batch_size; launch.plan's RunPlan.partition checks it).
    reshape = "reshape"
    # May differ and is not in the fingerprint: how long, where it writes, what it watches.
    ignore = "ignore"


@dataclass(frozen=True)
class KeyFacts:
    """One key's documentation and facts; None in a field's own facts means "as its section"."""

    doc: str = ""
    resume: OnResume | None = None
    # The training step a synthetic run (data.synthetic) measures depends on it.
    step: bool | None = None
    # A local path or URL, made absolute at start (the spawned processes may not share the cwd's meaning).
    path: bool | None = None
    # Differs between any two runs by nature (their own folders): never a difference worth listing.
    per_run: bool | None = None
    # A mapping whose keys are not the schema's (the model builder's keyword options).
    free_form: bool | None = None


ROOT_FACTS = KeyFacts(resume=OnResume.keep, step=True, path=False, per_run=False, free_form=False)


def setting(
    default: Any = _NO_DEFAULT,
    doc: str = "",
    *,
    factory: Any = None,
    resume: OnResume | None = None,
    step: bool | None = None,
    path: bool | None = None,
    per_run: bool | None = None,
    free_form: bool | None = None,
) -> Any:
    """A schema field with its documentation and facts: a dataclasses.field, which OmegaConf reads as any."""
    facts = KeyFacts(doc, resume, step, path, per_run, free_form)
    metadata = {FACTS: facts}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    if default is _NO_DEFAULT:
        raise TypeError("setting() needs a default or a factory")
    return dataclasses.field(default=default, metadata=metadata)
