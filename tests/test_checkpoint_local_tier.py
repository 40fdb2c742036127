"""checkpoint.local_tier: which of this host's copy of last.pt and the run folder's a restart continues."""

from __future__ import annotations

import logging

import pytest
import torch

from tpustream.checkpoint import LAST, checkpoint_url, find_resume, write_host_state
from tpustream.checkpoint.local_tier import delete_local_copies, local_checkpoint_url, newer_local


def write(url: str, step: int, fingerprint: str = "run-a") -> None:
    state = {
        "model": {"w": torch.full((2,), float(step))},
        "global_step": step,
        "position": {"epoch": step // 10, "step": step % 10},
        "config_fingerprint": fingerprint,
    }
    assert write_host_state(url, state) == []


@pytest.fixture
def run(tmp_path):
    """(output_dir, local_dir, the local copy's path)."""
    output_dir, local_dir = str(tmp_path / "bucket" / "run"), str(tmp_path / "ssd")
    return output_dir, local_dir, local_checkpoint_url(local_dir, output_dir)


def test_a_restart_on_the_same_host_continues_from_the_newer_copy(run, caplog):
    output_dir, local_dir, local = run
    write(checkpoint_url(output_dir, LAST), 20)
    write(local, 25)  # written, its upload cut short
    with caplog.at_level(logging.WARNING):
        chosen = newer_local(find_resume("auto", output_dir), local_dir, output_dir, one_host=True)
    assert chosen.url == local and chosen.own and chosen.state["global_step"] == 25
    assert "continuing from" in caplog.text and "(its upload did not finish)" in caplog.text
    # The upload finished afterwards (or went further): the remote copy wins.
    write(checkpoint_url(output_dir, LAST), 30)
    assert (
        newer_local(find_resume("auto", output_dir), local_dir, output_dir, one_host=True).state[
            "global_step"
        ]
        == 30
    )


def test_a_local_copy_whose_first_upload_never_finished_is_still_the_runs(run):
    output_dir, local_dir, local = run
    write(local, 5)
    chosen = newer_local(find_resume("auto", output_dir), local_dir, output_dir, one_host=True)
    assert chosen is not None and chosen.url == local


@pytest.mark.parametrize("case", ["damaged", "another run", "several hosts"])
def test_the_remote_copy_decides_when_the_local_one_cannot(run, case, caplog):
    output_dir, local_dir, local = run
    write(checkpoint_url(output_dir, LAST), 20)
    write(local, 25, fingerprint="run-b" if case == "another run" else "run-a")
    if case == "damaged":
        with open(local, "r+b") as file:
            file.seek(-40, 2)
            file.write(b"\0" * 20)
    with caplog.at_level(logging.WARNING):
        chosen = newer_local(
            find_resume("auto", output_dir), local_dir, output_dir, one_host=case != "several hosts"
        )
    assert chosen.url == checkpoint_url(output_dir, LAST)
    expected = {
        "damaged": "continuing from the remote copy",
        "another run": "belongs to another run",
        "several hosts": f"upload it first (gcloud storage cp {local} {checkpoint_url(output_dir, LAST)})",
    }[case]
    assert expected in caplog.text


def test_a_fresh_start_deletes_the_local_copies(run):
    output_dir, local_dir, local = run
    write(local, 5)
    assert delete_local_copies(local_dir, output_dir) == [local]
    assert newer_local(None, local_dir, output_dir, one_host=True) is None
    assert delete_local_copies(None, output_dir) == []
