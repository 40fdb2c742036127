"""checkpoint.background: one save in flight on its own thread, its errors raised in the caller's thread."""

from __future__ import annotations

import threading
import time

import pytest

from tpustream.checkpoint.background import BackgroundWriter


def blocked_job(release: threading.Event, started: threading.Event, result=(), error=None):
    def job():
        started.set()
        assert release.wait(10), "never released"
        if error is not None:
            raise error
        return list(result)

    return job


def test_a_save_runs_behind_the_caller_and_the_next_one_waits_for_it():
    writer = BackgroundWriter()
    release, started = threading.Event(), threading.Event()
    assert writer.submit("last.pt", blocked_job(release, started, ["kept/a.pt"])) < 0.1
    assert started.wait(5) and writer.in_flight == "last.pt"  # the caller went on while it runs

    second_release, second_started = threading.Event(), threading.Event()
    waited: list[float] = []
    caller = threading.Thread(
        target=lambda: waited.append(writer.submit("best.pt", blocked_job(second_release, second_started)))
    )
    caller.start()
    time.sleep(0.2)
    assert not second_started.is_set(), "two saves in flight"
    release.set()
    caller.join(5)
    assert second_started.wait(5) and waited[0] >= 0.2  # the wait is what the caller counts as stall
    assert writer.take_kept() == ["kept/a.pt"] and writer.take_kept() == []
    assert writer.saves == 1 and writer.take_write_seconds() >= 0.2 and writer.take_write_seconds() == 0.0
    second_release.set()
    writer.wait_until_finished()
    assert writer.saves == 2


def test_an_error_in_the_background_is_raised_in_the_callers_thread_once():
    writer = BackgroundWriter()
    release, started = threading.Event(), threading.Event()
    writer.submit("last.pt", blocked_job(release, started, error=OSError("disk on fire")))
    release.set()
    with pytest.raises(OSError, match="disk on fire"):
        writer.wait_until_finished()
    assert writer.wait_until_finished() < 0.1 and writer.in_flight is None


def test_an_error_also_stops_the_next_save_before_it_starts():
    writer = BackgroundWriter()
    release, started = threading.Event(), threading.Event()
    writer.submit("last.pt", blocked_job(release, started, error=ValueError("bad state")))
    release.set()
    next_started = threading.Event()
    with pytest.raises(ValueError, match="bad state"):
        writer.submit("last.pt", blocked_job(threading.Event(), next_started))
    assert not next_started.is_set()
