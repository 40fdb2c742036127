"""data.num_workers=auto (launch.auto_workers): the count from a measured worker rate and the demand."""

from __future__ import annotations

import math

import pytest

from tests.fake_runtime import tiny_config
from tpustream.data.resolve.split import load_manifest
from tpustream.errors import ConfigError
from tpustream.launch.auto_workers import (
    AUTO_MFU,
    MAX_AUTO_WORKERS,
    choose_workers,
    measure_worker_rate,
    replica_demand,
    resolve_auto_workers,
)
from tpustream.observe.chips import Chip


def test_a_known_demand_over_one_workers_rate_sets_the_count_within_the_hosts_spare_vcpus():
    # 300 samples/s wanted, 100 per worker, the advice's 1.25 margin: 4 workers.
    choice = choose_workers(worker_rate=100, demand=300, cpus=96, local_replicas=4, shards_per_replica=64)
    assert choice.workers == 4 and "300 samples/s per replica" in choice.why and "capped" not in choice.why
    # 13 wanted: the cap is the smallest of the spare vCPUs ((96 - 4) / 4 = 23), the shards and 8.
    choice = choose_workers(worker_rate=100, demand=1000, cpus=96, local_replicas=4, shards_per_replica=64)
    assert choice.workers == MAX_AUTO_WORKERS and choice.why.endswith(f"capped by at most {MAX_AUTO_WORKERS}")
    choice = choose_workers(worker_rate=100, demand=1000, cpus=96, local_replicas=4, shards_per_replica=2.5)
    assert choice.workers == 2 and choice.why.endswith("capped by 2.5 shard(s) per replica")
    choice = choose_workers(worker_rate=100, demand=1000, cpus=8, local_replicas=4, shards_per_replica=64)
    assert choice.workers == 1 and choice.why.endswith("capped by 1 spare vCPU(s) per replica")


def test_without_a_known_demand_the_count_is_what_the_host_can_spare():
    choice = choose_workers(worker_rate=100, demand=None, cpus=8, local_replicas=1, shards_per_replica=64)
    assert choice.workers == 7 and "unknown" in choice.why
    # This machine: 2 vCPUs, one replica.
    here = choose_workers(worker_rate=1, demand=None, cpus=2, local_replicas=1, shards_per_replica=6)
    assert here.workers == 1


def test_auto_and_the_advice_cap_workers_by_the_same_vcpus_per_replica():
    """Neither ever goes past the vCPUs a replica gets, less one for its loop."""
    from tpustream.observe.advice import advise, host_worker_cap

    starved = [{"epoch": epoch, "input_wait_fraction": 0.9} for epoch in range(3)]
    for cpus in (1, 2, 8, 16, 96):
        for replicas in (1, 2, 4, 8):
            cap = host_worker_cap(cpus, replicas)
            assert cap == max(1, cpus // replicas - 1)
            host = {"cpus": cpus, "local_replicas": replicas}
            auto = choose_workers(worker_rate=1, demand=1e6, shards_per_replica=64, **host)
            assert auto.workers == min(cap, MAX_AUTO_WORKERS)
            # 8 workers waiting 90%: 100 wanted, never more than the cap.
            (finding,) = advise(starved, num_workers=8, **host)
            assert f"from 8 to {cap} (the most" in finding or "workers cannot help on this host" in finding


def test_a_tpu_replicas_demand_is_its_share_of_the_chips_peak_at_the_assumed_mfu():
    v3 = Chip("v3", 123e12, 2, "")
    assert replica_demand(24.5e9, v3) == pytest.approx(123e12 / 2 * AUTO_MFU / 24.5e9)
    assert replica_demand(None, v3) is None and replica_demand(24.5e9, None) is None


def test_one_workers_rate_is_measured_on_the_training_pipeline(digits_root):
    cfg = tiny_config("unused")
    train = load_manifest(f"{digits_root}/train")
    rate = measure_worker_rate(cfg, train, seconds=0.3)
    assert 0 < rate < math.inf


def test_auto_is_resolved_in_both_forms_of_the_config_and_a_mid_epoch_resume_keeps_its_count(
    digits_root, monkeypatch, caplog
):
    train = load_manifest(f"{digits_root}/train")
    cfg = tiny_config("unused")
    cfg.data.num_workers = "auto"
    plain = {"data": {"num_workers": "auto"}}
    resolve_auto_workers(cfg, plain, train, 1, {"position": {"step": 5}, "data_plan": {"num_workers": 3}})
    assert cfg.data.num_workers == plain["data"]["num_workers"] == 3
    cfg.data.num_workers = plain["data"]["num_workers"] = "auto"
    resolve_auto_workers(cfg, plain, train, 1, {"position": {"step": 0}, "data_plan": {"num_workers": 3}})
    assert isinstance(cfg.data.num_workers, int) and cfg.data.num_workers == plain["data"]["num_workers"] >= 1
    # Canonical streams continue with any workers up to a replica's streams: chosen afresh, capped.
    from tpustream.launch import auto_workers as workers

    many = workers.WorkerChoice(6, "a machine of many cores")
    monkeypatch.setattr(workers, "choose_workers", lambda **_: many)
    cfg.data.num_workers = plain["data"]["num_workers"] = "auto"
    canonical = {"num_workers": 3, "streams": 8, "stream_buffer": 250, "global_batch": 64}
    with caplog.at_level("INFO", logger="tpustream.launch.auto_workers"):
        resolve_auto_workers(cfg, plain, train, 4, {"position": {"step": 5}, "data_plan": canonical})
    assert cfg.data.num_workers == 2  # 8 streams over 4 replicas
    assert "at most 2, the canonical streams each replica reads" in caplog.text


@pytest.mark.parametrize("value", ["two", -1, 1.5, True])
def test_anything_else_is_one_line(value):
    cfg = tiny_config("unused")
    cfg.data.num_workers = value
    with pytest.raises(ConfigError, match="data.num_workers must be a whole number >= 0 or auto"):
        cfg.data.check()
