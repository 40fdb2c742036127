"""One process per host drives all of its devices as one GSPMD program (strategy=spmd, spmd_fsdp).

torch_xla's SPMD mode: the process sees one virtual device; a tensor's
sharding over the device mesh is an annotation, and XLA's GSPMD partitioner
compiles one program per device with the collectives it needs. So the step
math of one replica runs unchanged on the whole global batch: gradients need
no explicit all-reduce, and sums over a sharded batch are already global.

Replicas, as the trainer counts them, are hosts: ``rank`` is this process's
index and ``world_size`` the number of processes, each loading its own part of
the global batch (the exact epoch plan split by host); the loader's batches
become one global array sharded along the mesh's axis (minibatch sharding).
Host numbers (stop votes, loader counts, bad shards) travel between hosts as
small device arrays through the same mechanism, so the code path with one
host is the one a pod runs.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from tpustream.runtime.device import ErrorKeepingIterable, XlaDevice, to_host


def fsdp_partition_spec(shape: Sequence[int], axis: str) -> tuple[str | None, ...]:
    """The sharding FSDPv2 gives a parameter: its largest dimension split along the mesh axis.

    (torch_xla's ``_prepare_spmd_partition_spec`` with shard_maximal=True;
    optimizer state is sharded the same way as its parameter.)
    """
    spec: list[str | None] = [None] * len(shape)
    if spec:
        spec[list(shape).index(max(shape))] = axis
    return tuple(spec)


def device_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes the first device holds of these tensors, read from their shards (padding included)."""
    import torch_xla

    torch_xla.sync()
    shards = torch_xla._XLAC._get_local_shards(list(tensors))
    return sum(per_device[0][0].numel() * per_device[0][0].element_size() for per_device in shards)


TILED = 3  # torch_xla's ShardingType (OpSharding.Type): split across devices


def _whole_on_host(value: Any) -> Any:
    """value with every device tensor copied to the CPU whole; sharded ones assembled from their shards.

    Copying a sharded tensor with .cpu() compiles a small gather program per
    tensor, and again at every checkpoint (measured: 44 compilations per
    epoch for a 22-tensor state); its shards come over as plain transfers.
    Every shard of a tensor must be on this host, as on one host.
    """
    if isinstance(value, dict):
        return {k: _whole_on_host(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_whole_on_host(v) for v in value)
    if not isinstance(value, torch.Tensor) or value.device.type != "xla":
        return to_host(value)
    import torch_xla

    tensor = value.detach()
    if torch_xla._XLAC._get_xla_sharding_type(tensor) != TILED:  # whole on every device
        return tensor.cpu()
    (shards,) = torch_xla._XLAC._get_local_shards([tensor])
    (places,) = torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])
    whole = torch.empty(tensor.shape, dtype=tensor.dtype)
    for (data, _device), (_replica, indices) in zip(shards, places, strict=True):
        if indices is Ellipsis:
            return data
        # A shard at the end of a dimension that does not divide evenly is padded.
        whole[tuple(indices)] = data[tuple(slice(0, s.stop - s.start) for s in indices)]
    return whole


class _BatchSharding(dict):
    """MpDeviceLoader's input_sharding: every batch field split along the mesh axis on dimension 0.

    torch_xla looks up one ShardingSpec per key, and a spec only applies to a
    tensor of its own rank (otherwise the tensor is silently replicated), so
    the specs are made per field from the ranks the loader's batches have.
    """

    def __init__(self, mesh: Any, axis: str):
        super().__init__()
        self.mesh = mesh
        self.axis = axis
        self.ranks: dict[str, int] = {}

    def note(self, batch: dict[str, torch.Tensor]) -> None:
        for key, tensor in batch.items():
            if self.ranks.get(key) != tensor.dim():
                import torch_xla.distributed.spmd as xs

                self.ranks[key] = tensor.dim()
                spec = (self.axis,) + (None,) * (tensor.dim() - 1)
                self[key] = xs.ShardingSpec(self.mesh, spec, minibatch=True)


class _NotedBatches:
    """The loader, noting each batch's field ranks before MpDeviceLoader's thread shards it."""

    def __init__(self, loader: Iterable, sharding: _BatchSharding):
        self.loader = loader
        self.sharding = sharding

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        for batch in self.loader:
            self.sharding.note(batch)
            yield batch


class SpmdRuntime(XlaDevice):
    """This host's process, driving every device of a global mesh with one axis named ``axis``."""

    def __init__(self, axis: str, compile_cache_dir: str | None = None):
        import torch_xla.runtime as xr

        # Before any tensor exists on an XLA device: the process's one virtual
        # device then stands for the whole mesh.
        xr.use_spmd()
        super().__init__(compile_cache_dir, "spmd")
        import torch_xla.distributed.spmd as xs

        self.num_devices = xr.global_runtime_device_count()
        self.local_devices = xr.addressable_runtime_device_count()
        self.rank = xr.process_index()
        self.world_size = xr.process_count()
        self.local_rank = 0
        self.axis = axis
        self.mesh = xs.Mesh(np.arange(self.num_devices), (self.num_devices,), (axis,))
        xs.set_global_mesh(self.mesh)

    def place(self, tensors: Iterable[torch.Tensor]) -> None:
        self.replicate(tensors)

    def replicate(self, tensors: Iterable[torch.Tensor]) -> None:
        """Annotate device tensors as whole on every device.

        A step's outputs come back annotated (replicated or sharded) while a
        tensor put on the device is not, and the annotation is part of the
        graph's identity: without this the first step, the first evaluation
        and the first step after it each compiled a graph of their own.
        """
        import torch_xla.distributed.spmd as xs

        for tensor in tensors:
            xs.mark_sharding(tensor, self.mesh, (None,) * tensor.dim())

    def device_loader(self, loader: Iterable) -> Iterator:
        import torch_xla.distributed.parallel_loader as pl

        sharding = _BatchSharding(self.mesh, self.axis)
        source = ErrorKeepingIterable(_NotedBatches(loader, sharding))
        yield from pl.MpDeviceLoader(source, self.device, input_sharding=sharding)
        if source.error is not None:
            raise source.error

    def broadcast_parameters(self, model: nn.Module) -> None:
        # One program: every host built the same weights from the same seed,
        # and the device copy of a replicated tensor is one array.
        pass

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The loss is over the global batch: GSPMD already reduced the gradients.
        optimizer.step()

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        # Sums over a sharded batch are global values already.
        return list(tensors)

    def reduce_host_sum(self, tag: str, values: Sequence[float]) -> list[float]:
        rows = self.all_gather_host(tag, [float(v) for v in values])
        return [sum(column) for column in zip(*rows, strict=True)]

    def all_gather_host(self, tag: str, value: Any) -> list[Any]:
        """Every host's value, through one array sharded over hosts (one row each), read back whole."""
        if self.world_size == 1:
            return [value]
        payload = np.frombuffer(pickle.dumps(value), np.uint8)
        (lengths,) = self._gather_rows(np.array([[len(payload)]], np.int32)).T
        width = int(lengths.max())
        row = np.zeros((1, width), np.int32)
        row[0, : len(payload)] = payload
        rows = self._gather_rows(row)
        return [pickle.loads(rows[i, : lengths[i]].astype(np.uint8).tobytes()) for i in range(len(rows))]

    def _gather_rows(self, row: np.ndarray) -> np.ndarray:
        """(hosts, n): this host's (1, n) row next to every other host's, on every host."""
        import torch_xla
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.spmd as xs

        # A minibatch array needs a row per local device; the first is ours.
        local = torch.zeros((self.local_devices, row.shape[1]), dtype=torch.int32)
        local[0] = torch.from_numpy(row[0])
        spec = xs.ShardingSpec(self.mesh, (self.axis, None), minibatch=True)
        (global_rows,) = xm.send_cpu_data_to_device([local], self.device, spec)
        whole = global_rows + 0  # a computed copy, replicated below
        xs.mark_sharding(whole, self.mesh, (None, None))
        torch_xla.sync()
        return whole.cpu().numpy()[:: self.local_devices]

    def barrier(self, tag: str) -> None:
        if self.world_size > 1:
            self.all_gather_host(tag, None)

    def state_to_host(self, state: Any) -> Any | None:
        import torch_xla

        # Every host cuts the graph at the same point (pending work runs as
        # the one program it is part of); then the master copies.
        torch_xla.sync()
        if not self.is_master:
            return None
        return _whole_on_host(state)

    def gather_state_to_master(self, tag: str, state: Any) -> list[Any] | None:
        host = self.state_to_host(state)
        return None if host is None else [host]
