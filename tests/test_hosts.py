"""A pod's hosts before spawning: host 0 counts unindexed shards, the others wait for its index."""

from __future__ import annotations

import pytest

from tests.conftest import write_wds_shards
from tpustream.data.resolve import counting
from tpustream.data.resolve.index_command import main as index_main
from tpustream.data.resolve.split import SplitOptions
from tpustream.errors import ConfigError
from tpustream.launch import hosts

DIGITS = SplitOptions(num_classes=10, progress=False)


@pytest.fixture
def unindexed(tmp_path) -> str:
    folder = str(tmp_path / "wds")
    write_wds_shards(folder, "cifar-train-%06d.tar", 25, maxcount=7)
    return folder


def test_a_second_pod_host_waits_for_host_zero_instead_of_counting(unindexed, monkeypatch):
    monkeypatch.setenv("TPUSTREAM_HOST_INDEX", "1")
    count_shards = counting.count_shards
    monkeypatch.setattr(counting, "count_shards", lambda *a, **k: pytest.fail("host 1 counted"))
    naps = []

    def host_zero_finishes(seconds: float) -> None:
        naps.append(seconds)
        if len(naps) == 2:  # meanwhile host 0, which may count, writes the index
            with monkeypatch.context() as host_zero:
                host_zero.setattr(counting, "count_shards", count_shards)
                assert index_main([unindexed, "--no-progress"]) == 0

    split = hosts.load_split_on_this_host(unindexed, "train", DIGITS, sleep=host_zero_finishes)
    assert [s.samples for s in split.shards] == [7, 7, 7, 4] and len(naps) == 2
    assert split.counts_from.endswith("(written by pod host 0)")


def test_only_the_first_host_of_the_first_slice_counts(unindexed, monkeypatch):
    """Multislice: every slice has a host 0; slice 1's waits for slice 0's like any other host."""
    monkeypatch.setenv("TPUSTREAM_HOST_INDEX", "0")
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")
    monkeypatch.setenv("TPUSTREAM_INDEX_WAIT_SECONDS", "0.01")
    monkeypatch.setattr(counting, "count_shards", lambda *a, **k: pytest.fail("slice 1's host 0 counted"))
    with pytest.raises(ConfigError, match="pod host 0 wrote no index"):
        hosts.load_split_on_this_host(unindexed, "train", DIGITS, sleep=lambda s: None)
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "0")
    assert hosts.counts_shards()


def test_a_second_pod_host_gives_up_naming_the_folder(unindexed, monkeypatch):
    monkeypatch.setenv("TPUSTREAM_HOST_INDEX", "1")
    monkeypatch.setenv("TPUSTREAM_INDEX_WAIT_SECONDS", "0.01")
    with pytest.raises(ConfigError, match=rf"{unindexed}: pod host 0 wrote no index .* `tpustream-index"):
        hosts.load_split_on_this_host(unindexed, "train", DIGITS, sleep=lambda s: None)
    monkeypatch.setenv("TPUSTREAM_HOST_INDEX", "one")
    with pytest.raises(ConfigError, match="TPUSTREAM_HOST_INDEX='one': expected a host number"):
        hosts.load_split_on_this_host(unindexed, "train", DIGITS)


def test_a_native_job_meets_on_this_machine_alone_or_as_torchruns_variables_say(monkeypatch):
    from tpustream.launch.hosts import native_hosts

    for name in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    alone = native_hosts(2)
    assert (alone.node_rank, alone.nodes, alone.world_size) == (0, 1, 2)
    assert alone.init_method.startswith("tcp://127.0.0.1:")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.2")
    monkeypatch.setenv("NNODES", "3")
    monkeypatch.setenv("NODE_RANK", "2")
    hosts = native_hosts(4)
    assert (hosts.node_rank, hosts.world_size, hosts.init_method) == (2, 12, "tcp://10.0.0.2:29500")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(
        ConfigError, match=r"WORLD_SIZE=8, but NNODES=3 x 4 replica process\(es\) per machine = 12"
    ):
        native_hosts(4)
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("NODE_RANK", "3")
    with pytest.raises(ConfigError, match="NODE_RANK=3 with NNODES=3"):
        native_hosts(4)
