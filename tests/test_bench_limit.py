"""bench.limit: a configuration's rate against its own synthetic rate."""

from __future__ import annotations

import json

import pytest

from bench import limit


def test_each_round_runs_synthetic_then_real_without_evaluation(capsys, tmp_path):
    argv = ["--dry-run", "--rounds", "2", "--out", str(tmp_path), "--", "model=small_cnn"]
    assert limit.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    kinds = [line.split("data.synthetic=")[1].split()[0] for line in lines]
    assert kinds == ["true", "false", "true", "false"]
    assert all("model=small_cnn eval_every=0" in line for line in lines)
    with pytest.raises(SystemExit):
        limit.main(["--dry-run", "--", "data.synthetic=true"])  # it sets that itself
    assert "leave data.synthetic out" in capsys.readouterr().err


def test_the_summary_says_how_far_from_synthetic_and_what_was_measured(monkeypatch, tmp_path, capsys):
    """Rates per kind from each run's steady epochs; measured shares from the real runs' steady epochs."""
    rates = {"synthetic": [100.0, 1000.0, 1000.0], "real": [50.0, 700.0, 900.0]}

    def fake_train(command, log_path, timeout=None, tree=None):
        out = next(part.split("=", 1)[1] for part in command if part.startswith("output_dir="))
        kind = "synthetic" if "data.synthetic=true" in command else "real"
        records = [
            {
                "epoch": e,
                "global_rate": rate,
                "input_wait_fraction": 0.5,
                "input_bound_fraction": 0.1 * e,
                "input_making_share": 0.9,
            }
            for e, rate in enumerate(rates[kind])
        ]
        (tmp_path / "runs").mkdir(exist_ok=True)
        folder = tmp_path / "runs" / out.rsplit("/", 1)[1]
        folder.mkdir()
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return 0, 1.0

    monkeypatch.setattr(limit, "run_logged", fake_train)
    monkeypatch.setattr(limit, "check_runnable", lambda overrides: None)  # no shards: the runs are fakes
    assert limit.main(["--out", str(tmp_path), "--", "model=small_cnn"]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["synthetic_rate"] == 1000.0 and result["real_rate"] == 800.0
    assert result["of_synthetic"] == pytest.approx(0.8)
    assert result["implied_input_bound"] == pytest.approx(0.2)
    assert result["input_bound_fraction"] == pytest.approx(0.15)  # epochs 1 and 2: 0.1, 0.2
    assert result["command"] == f"python -m bench.limit --out {tmp_path} -- model=small_cnn"
    out = capsys.readouterr().out
    assert "real / synthetic:                0.800" in out
    assert "input-bound, implied:            20.0% (1 - real/synthetic)" in out
    assert "input-bound, measured:           15.0%" in out
    assert "of the waits, for the making:    90.0% (batches the workers had not made yet" in out
    # Where the accelerator measures no device idle time, it says so rather than invent one.
    summary = limit.summarise([10.0], [10.0], {"input_bound_fraction": None, "input_wait_fraction": 0.3})
    assert "not measured here" in limit.describe(summary) and summary["implied_input_bound"] == 0.0


def test_a_real_run_faster_than_its_twin_is_called_noise():
    text = limit.describe(limit.summarise([1000.0], [1104.0], {"input_bound_fraction": None}))
    assert "1.104 (above 1: the real run was faster than its synthetic twin" in text
    assert "input-bound, implied:            0.0% (noise" in text


@pytest.mark.parametrize("override", ["output_dir=/tmp/mine", "epochs=9", "hydra.run.dir=/tmp/x"])
def test_what_it_sets_per_run_is_refused_rather_than_replaced(override, capsys):
    with pytest.raises(SystemExit):
        limit.main(["--dry-run", "--", override])
    assert f"leave {override.split('=')[0]} out of the overrides" in capsys.readouterr().err


def test_missing_shards_or_a_bad_key_stop_it_in_one_line_before_any_run(monkeypatch, tmp_path):
    monkeypatch.setattr(limit, "run_logged", lambda *a, **k: pytest.fail("a run was started"))
    missing = tmp_path / "digits"
    with pytest.raises(SystemExit) as stopped:
        limit.main(["--out", str(tmp_path / "out"), "--", f"data.root={missing}"])
    message = str(stopped.value)
    assert "\n" not in message and "cannot list the shards" in message
    assert f"tpustream-make-shards digits {missing}" in message
    with pytest.raises(SystemExit) as stopped:
        limit.main(["--out", str(tmp_path / "out"), "--", "data.num_wrkers=2"])
    assert "train.py would refuse data.num_wrkers=2" in str(stopped.value)
