"""bench.checkpoints: synchronous against asynchronous saves, measured with the trainer's own writer."""

from __future__ import annotations

import json

from bench import checkpoints


def test_a_run_measures_both_modes_and_reports_the_goals(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(checkpoints.MODELS, "small_cnn", ({"num_classes": 4, "image_size": 8, "width": 4}, 8))
    monkeypatch.setattr(checkpoints, "RESULTS", tmp_path)
    assert checkpoints.main(["--models", "small_cnn", "--saves", "3", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "small_cnn: worst stall after the first" in out and "vs 10% of the synchronous save" in out
    (result,) = tmp_path.glob("*.json")
    saved = json.loads(result.read_text())
    assert saved["command"] == "python -m bench.checkpoints --models small_cnn --saves 3 --batch-size 2"
    (row,) = saved["rows"]
    assert row["runtime"] == "cpu_eager" and len(row["stalls_s"]) == 3
    assert row["stall_first_s"] == row["stalls_s"][0] and row["stall_max_s"] == max(row["stalls_s"][1:])
    assert row["steps_idle"] >= 2 and row["background_s_per_save"] > 0 and row["state_mb"] > 0
