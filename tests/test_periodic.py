"""The one rule for periodic actions, as the trainer's call sites count."""

from __future__ import annotations

from tpustream.training.periodic import itstime


def test_every_nth_count_and_the_last_and_never_when_off():
    # Logging counts the step just trained from 0: the first, then every 20th.
    assert [s for s in range(45) if itstime(s, 20)] == [0, 20, 40]
    # Evaluation counts epochs done: every 3rd and after the last of 7.
    assert [e for e in range(1, 8) if itstime(e, 3, total=7)] == [3, 6, 7]
    assert not any(itstime(n, 0, total=5) for n in range(6))  # 0 = off, even at the last
    assert not any(itstime(n, -5) for n in range(1, 11))  # a negative period never fires
