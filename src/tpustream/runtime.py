"""Everything replica-related behind one small interface.

The trainer, evaluation and checkpointing talk to a ``Runtime``: which device,
which replica, how to step the optimizer across replicas, how to reduce
metrics, how to get state to the host. ``XlaRuntime`` implements it with
torch_xla; a multi-process simulation can implement the same methods.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch


class Runtime(Protocol):
    device: torch.device
    rank: int  # global ordinal, 0 .. world_size - 1
    world_size: int
    local_rank: int

    @property
    def is_master(self) -> bool: ...

    def device_loader(self, loader: Iterable) -> Iterator:
        """Iterate loader with batches already on the device (and a step boundary per batch)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Average gradients over replicas, then step."""

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Sum device tensors over replicas (a collective: every replica must call it)."""

    def reduce_host_sum(self, tag: str, values: Sequence[float]) -> list[float]:
        """Sum host numbers over replicas (a collective)."""

    def barrier(self, tag: str) -> None: ...

    def add_step_closure(self, fn: Callable[..., Any], args: tuple = ()) -> None:
        """Run fn(*args) on the host once the current step's tensors are computed."""

    def serialize(self, state: Any) -> bytes | None:
        """torch.save bytes of state with tensors on the CPU, on the master only (None elsewhere)."""

    def wait_device_ops(self) -> None: ...

    def compilations(self) -> int:
        """Graphs compiled so far in this process (for recompilation checks)."""


class _ErrorKeepingIterable:
    """Iterates a loader on another thread, keeping its exception instead of raising it there."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self.error: Exception | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        self.error = None
        try:
            yield from self.loader
        except Exception as exc:
            self.error = exc


class XlaRuntime:
    """A replica of an xmp.spawn job: one XLA device (a TPU core, or the XLA CPU device)."""

    def __init__(self, compile_cache_dir: str | None = None):
        import torch_xla
        import torch_xla.runtime as xr

        if compile_cache_dir:
            # One folder per local process: concurrent writers to one cache
            # folder are not supported, and the same (shape, program) compiles
            # identically on every replica of a host anyway.
            xr.initialize_cache(os.path.join(compile_cache_dir, str(xr.local_ordinal())), readonly=False)
        self.device = torch_xla.device()
        # xm.get_ordinal / xm.xrt_world_size are gone in torch_xla 2.9.
        self.rank = xr.global_ordinal()
        self.world_size = xr.world_size()
        self.local_rank = xr.local_ordinal()

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def device_loader(self, loader: Iterable) -> Iterator:
        import torch_xla.distributed.parallel_loader as pl

        # MpDeviceLoader moves batches on a background thread and marks a step
        # at every batch, so the training loop never syncs explicitly. If the
        # loader raises on that thread, torch_xla 2.9 closes the queue as if
        # the epoch had ended (and the traceback goes to stderr): catch the
        # error there and raise it here, in the training thread.
        source = _ErrorKeepingIterable(loader)
        yield from pl.MpDeviceLoader(source, self.device)
        if source.error is not None:
            raise source.error

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        import torch_xla.core.xla_model as xm

        xm.optimizer_step(optimizer)

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        import torch_xla.core.xla_model as xm

        if self.world_size == 1:
            return list(tensors)
        return [xm.all_reduce(xm.REDUCE_SUM, t) for t in tensors]

    def reduce_host_sum(self, tag: str, values: Sequence[float]) -> list[float]:
        import torch_xla.core.xla_model as xm

        if self.world_size == 1:
            return [float(v) for v in values]
        return xm.mesh_reduce(
            tag, [float(v) for v in values], lambda rows: [sum(c) for c in zip(*rows, strict=True)]
        )

    def barrier(self, tag: str) -> None:
        import torch_xla.core.xla_model as xm

        if self.world_size > 1:
            xm.rendezvous(tag)

    def add_step_closure(self, fn: Callable[..., Any], args: tuple = ()) -> None:
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(fn, args=args)

    def serialize(self, state: Any) -> bytes | None:
        import torch_xla.core.xla_model as xm

        buffer = io.BytesIO()
        # Every replica must call xm.save (it syncs pending device work);
        # only the global master transfers tensors and writes.
        xm.save(state, buffer, master_only=True, global_master=True)
        return buffer.getvalue() if self.is_master else None

    def wait_device_ops(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    def compilations(self) -> int:
        import torch_xla.debug.metrics as met

        data = met.metric_data("CompileTime")
        return int(data[0]) if data else 0
