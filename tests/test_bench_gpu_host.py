"""bench/gpu_host.sh: the committed command a session lent a GPU host runs, checked here without one."""

from __future__ import annotations

import importlib
import os
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The benchmark each step runs, and the module whose parse_args reads its arguments.
PARSERS = {
    "bench.cuda_check": "bench.cuda_check",
    "bench.feed": "bench.feed.__main__",
    "bench.pipeline": "bench.pipeline.__main__",
    "bench.limit": "bench.limit",
}


def planned(tmp_path: Path, **env: str) -> list[tuple[str, int, list[str]]]:
    result = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_host.sh"), "run", str(tmp_path / "out")],
        cwd=REPO,
        env={**os.environ, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    steps = []
    for line in result.stdout.splitlines():
        name, seconds, *command = shlex.split(line)
        steps.append((name, int(seconds), command))
    return steps


def test_every_planned_step_is_a_command_its_benchmark_accepts_within_one_device_call(tmp_path):
    from bench.harness import compose_train_config

    steps = planned(tmp_path)
    assert [name for name, _, _ in steps] == ["cuda_check", "feed", "decode", "limit"]
    assert sum(seconds for _, seconds, _ in steps) <= 560  # a device call runs 600 s at most
    for name, _, command in steps:
        assert command[:2] == ["python", "-m"] and command[2] in PARSERS, (name, command)
        arguments = command[3:]
        importlib.import_module(PARSERS[command[2]]).parse_args(arguments)  # exits 2 on a bad option
        if "--" in arguments:  # train.py's overrides compose as train.py would compose them
            compose_train_config(arguments[arguments.index("--") + 1 :])
    assert not (tmp_path / "out" / "summary.txt").exists()  # a dry run runs nothing


def test_steps_and_their_seconds_can_be_chosen(tmp_path):
    steps = planned(tmp_path, STEPS="feed,limit", STEP_SECONDS="feed=300")
    assert [(name, seconds) for name, seconds, _ in steps] == [("feed", 300), ("limit", 90)]
