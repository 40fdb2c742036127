"""A synthetic run (data.synthetic) in words: its rate, the yardstick for a real run of its config.

Its records say ``"synthetic": true``; it has no accuracy to report, so
train.py's last line, the replica's "finished" line, the launcher's word on a
folder holding one and tpustream-report all describe it by this one rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tpustream.config.keys import facts_of, flatten
from tpustream.observe.advice import mean_of, measured


def is_synthetic(records: Iterable[Mapping[str, Any]]) -> bool:
    """Whether metrics.jsonl records (or a checkpoint's history) are a synthetic run's."""
    return any(record.get("synthetic") for record in records)


def describe_synthetic(records: Sequence[Mapping[str, Any]]) -> str:
    """'synthetic: 1234.5 samples/s (steady epochs 1-2), step 12.3 ms, MFU 31.5%' of the steady epochs.

    Steady: every epoch but epoch 0 (it compiles) when there are others, as
    tpustream-report's samples/s. The step is the training loop's wall time
    per step (a replica's), the rate's other face.
    """
    steady = measured(records)
    if not steady:
        return "synthetic: no epoch finished"
    rate = mean_of(steady, "global_rate")
    step = sum(r["train_seconds"] for r in steady) / max(sum(r["replica_steps"] for r in steady), 1)
    first, last = steady[0]["epoch"], steady[-1]["epoch"]
    if len(records) == 1:
        epochs = f"epoch {first}, compilation included"
    else:
        epochs = f"steady epoch {first}" if first == last else f"steady epochs {first}-{last}"
    mean_mfu = mean_of(steady, "mfu")
    mfu = "" if mean_mfu is None else f", MFU {100 * mean_mfu:.1f}%"
    return f"synthetic: {rate:.1f} samples/s ({epochs}), step {1000 * step:.1f} ms{mfu}"


def steady_rate(records: Sequence[Mapping[str, Any]]) -> float | None:
    """Mean global samples/s of the steady epochs (None without an epoch)."""
    return mean_of(measured(records), "global_rate")


def the_step(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config's keys that make the training step a synthetic run measures (flattened).

    Model, optimizer, precision, strategy, batch, accelerator, augmentation and
    EMA do; where the data comes from and how it is read (its shapes are the
    data's), where the run writes, how long it runs and what it logs do not
    (each key's ``step`` fact, config.keys).
    """
    return {name: value for name, value in flatten(config).items() if facts_of(name).step}


def synthetic_twin_rate(
    config: Mapping[str, Any], others: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]]
) -> float | None:
    """The steady rate of a synthetic run, among (config, records) `others`, of the same step as config."""
    step = the_step(config)
    for other_config, records in others:
        if is_synthetic(records) and the_step(other_config) == step:
            return steady_rate(records)
    return None
