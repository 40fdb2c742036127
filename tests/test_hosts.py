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
    assert split.counts_from.endswith("(written by host 0)")


def test_a_second_pod_host_gives_up_naming_the_folder(unindexed, monkeypatch):
    monkeypatch.setenv("TPUSTREAM_HOST_INDEX", "1")
    monkeypatch.setenv("TPUSTREAM_INDEX_WAIT_SECONDS", "0.01")
    with pytest.raises(ConfigError, match=rf"{unindexed}: pod host 0 wrote no index .* `tpustream-index"):
        hosts.load_split_on_this_host(unindexed, "train", DIGITS, sleep=lambda s: None)
    monkeypatch.setenv("TPUSTREAM_HOST_INDEX", "one")
    with pytest.raises(ConfigError, match="TPUSTREAM_HOST_INDEX='one': expected a host number"):
        hosts.load_split_on_this_host(unindexed, "train", DIGITS)
