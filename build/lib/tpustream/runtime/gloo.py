"""A simulated pod replica: its own process and XLA CPU device, collectives over gloo."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from tpustream.runtime.device import XlaDevice


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (a rendezvous, a local server).

    The one helper for it: the simulated pod's gloo rendezvous, the GCS
    emulator and the tests' servers take their ports here.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def average_flat(grads: Sequence[torch.Tensor], world_size: int, via_host: bool = False) -> None:
    """Replace grads by their mean over replicas: one flat all-reduce (the mean xm.optimizer_step computes).

    via_host: the flat copy crosses to the host and back (a backend that cannot read the device).
    """
    import torch.distributed as dist

    flat = torch.cat([g.detach().reshape(-1) for g in grads])
    if via_host:
        flat = flat.cpu()
    dist.all_reduce(flat)
    flat.div_(world_size)
    flat = flat.to(grads[0].device)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()


class HostCollectives:
    """Host numbers and objects between replica processes, over torch.distributed's gloo group.

    The simulated pod's replicas use it; so do the hosts of a multi-host spmd
    run, whose one program leaves no replica collectives to carry host values.
    """

    rank: int
    world_size: int

    def reduce_host_sum(self, tag: str, values: Sequence[float]) -> list[float]:
        import torch.distributed as dist

        if self.world_size == 1:
            return [float(v) for v in values]
        host = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(host)
        return host.tolist()

    def all_gather_host(self, tag: str, value: Any) -> list[Any]:
        import torch.distributed as dist

        if self.world_size == 1:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def gather_host(self, tag: str, value: Any) -> list[Any] | None:
        """Every replica's value, in rank order, on the master only (None elsewhere)."""
        import torch.distributed as dist

        if self.world_size == 1:
            return [value]
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(value, gathered, dst=0)
        return gathered

    def barrier(self, tag: str) -> None:
        import torch.distributed as dist

        if self.world_size > 1:
            dist.barrier()


class GlooRuntime(HostCollectives, XlaDevice):
    """A simulated pod replica: its own process and XLA CPU device, collectives over gloo.

    torch.distributed must already be initialised (gloo) with this rank and
    world size. Tensors cross to the host for each collective, which makes a
    step slower than on a pod but exercises the same trainer code.
    """

    def __init__(self, rank: int, world_size: int, compile_cache_dir: str | None = None):
        super().__init__(compile_cache_dir, str(rank))
        self.rank = rank
        self.world_size = world_size
        self.local_rank = rank

    def broadcast_parameters(self, model: nn.Module) -> None:
        import torch.distributed as dist

        tensors = [t for t in (*model.parameters(), *model.buffers())]
        for tensor in tensors:
            host = tensor.detach().cpu()
            dist.broadcast(host, src=0)
            tensor.data.copy_(host.to(self.device))

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads:
            average_flat(grads, self.world_size, via_host=True)  # gloo cannot reach an XLA device
        optimizer.step()

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        import torch.distributed as dist

        out = []
        for tensor in tensors:
            host = tensor.detach().cpu()
            dist.all_reduce(host)
            out.append(host.to(self.device))
        return out
