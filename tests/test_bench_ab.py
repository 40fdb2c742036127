"""bench.ab: two commits' samples/s, alternating runs."""

from __future__ import annotations

import pytest

from bench.ab import main, run_order
from bench.harness import steady_rate


def test_the_rate_leaves_out_epoch_0_and_runs_alternate():
    records = [{"global_rate": 10.0}, {"global_rate": 300.0}, {"global_rate": 100.0}]
    assert steady_rate(records) == 200.0
    assert steady_rate(records[:1]) == 10.0
    assert run_order(["a", "b"], 2) == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    with pytest.raises(ValueError):
        steady_rate([])


def test_a_dry_run_prints_each_commits_train_py_in_turn(capsys):
    assert main(["HEAD~1", "HEAD", "--dry-run", "--epochs", "3", "--", "data.num_workers=0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all("epochs=3 data.num_workers=0" in line for line in lines)
    trees = [line.split()[1].rsplit("/", 2)[-2] for line in lines]
    assert trees[0] == trees[2] != trees[1] == trees[3]


def test_a_ref_that_is_no_commit_is_one_line():
    with pytest.raises(SystemExit, match="no-such-ref: not a commit of this repository"):
        main(["no-such-ref", "HEAD", "--dry-run"])
