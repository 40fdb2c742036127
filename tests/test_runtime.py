"""runtime's host collectives over gloo, between real processes (no XLA device involved)."""

from __future__ import annotations

import datetime

import torch.multiprocessing as mp

from tests.conftest import free_port
from tpustream.runtime.gloo import HostCollectives


class Host(HostCollectives):
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


def exchange(rank: int, world: int, init_method: str, results) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    try:
        host = Host(rank, world)
        value = {"rank": rank, "urls": [f"gs://b/{rank}.tar"] * rank}
        results[rank] = (
            host.reduce_host_sum("sum", [rank, 0.5]),
            host.all_gather_host("all", value),
            host.gather_host("master", value),
        )
        host.barrier("end")
    finally:
        dist.destroy_process_group()


def test_host_values_cross_processes_in_rank_order_and_only_the_master_gathers():
    world = 2
    with mp.Manager() as manager:
        results = manager.dict()
        init_method = f"tcp://127.0.0.1:{free_port()}"
        mp.start_processes(exchange, args=(world, init_method, results), nprocs=world, start_method="spawn")
        results = dict(results)
    values = [{"rank": r, "urls": [f"gs://b/{r}.tar"] * r} for r in range(world)]
    for rank in range(world):
        sums, everyone, gathered = results[rank]
        assert sums == [1.0, 1.0]
        assert everyone == values
        assert gathered == (values if rank == 0 else None)


def test_one_host_keeps_its_values_without_a_process_group():
    host = Host(0, 1)
    assert host.reduce_host_sum("sum", [2, 3]) == [2.0, 3.0]
    assert host.all_gather_host("all", "x") == ["x"] and host.gather_host("master", "x") == ["x"]
    host.barrier("end")
