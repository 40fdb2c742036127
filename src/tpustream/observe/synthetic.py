"""A synthetic run (data.synthetic) in words: its rate, the yardstick for a real run of its config.

Its records say ``"synthetic": true``; it has no accuracy to report, so
train.py's last line, the replica's "finished" line, the launcher's word on a
folder holding one and tpustream-report all describe it by this one rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tpustream.observe.advice import measured


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
    rate = sum(r["global_rate"] for r in steady) / len(steady)
    step = sum(r["train_seconds"] for r in steady) / max(sum(r["replica_steps"] for r in steady), 1)
    first, last = steady[0]["epoch"], steady[-1]["epoch"]
    if len(records) == 1:
        epochs = f"epoch {first}, compilation included"
    else:
        epochs = f"steady epoch {first}" if first == last else f"steady epochs {first}-{last}"
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    mfu = f", MFU {100 * sum(mfus) / len(mfus):.1f}%" if mfus else ""
    return f"synthetic: {rate:.1f} samples/s ({epochs}), step {1000 * step:.1f} ms{mfu}"
