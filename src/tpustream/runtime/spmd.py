"""One process per host drives all of its devices as one GSPMD program (strategy=spmd, spmd_fsdp).

The devices form the named mesh of runtime.mesh (mesh.*).

torch_xla's SPMD mode: the process sees one virtual device; a tensor's
sharding over the device mesh is an annotation, and XLA's GSPMD partitioner
compiles one program per device with the collectives it needs. So the step
math of one replica runs unchanged on the whole global batch: gradients need
no explicit all-reduce, and sums over a sharded batch are already global.

Replicas, as the trainer counts them, are hosts: ``rank`` is this process's
index and ``world_size`` the number of processes, each loading its own part of
the global batch (the exact epoch plan split by host); the loader's batches
become one global array sharded over the mesh's batch axes (minibatch sharding).
Host values (stop votes, loader counts, bad shards, checkpoint pieces) go
between hosts over a gloo group that torch_xla's xla:// rendezvous sets up;
with one host they stay in the process. (Only the one-host case runs here:
XLA:CPU gives one process at most one mesh.)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from tpustream.config import MeshConfig, Strategy
from tpustream.observe.timing import InputWait
from tpustream.runtime.device import ErrorKeepingIterable, XlaDevice, timed_parallel_loader, to_host
from tpustream.runtime.gloo import HostCollectives
from tpustream.runtime.mesh import INPUT_AXIS, batch_partition_spec, build_mesh, input_mesh, mesh_shape
from tpustream.runtime.resident import is_resident
from tpustream.runtime.staging import HostStaging


def fsdp_partition_spec(shape: Sequence[int]) -> tuple[str | None, ...]:
    """The sharding FSDPv2 gives a parameter: its largest dimension split along the "fsdp" axis.

    (torch_xla's ``_prepare_spmd_partition_spec`` with shard_maximal=True;
    optimizer state is sharded the same way as its parameter.)
    """
    spec: list[str | None] = [None] * len(shape)
    if spec:
        spec[list(shape).index(max(shape))] = "fsdp"
    return tuple(spec)


def device_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes the first device holds of these tensors, read from their shards (padding included)."""
    import torch_xla

    torch_xla.sync(wait=True)  # shards of tensors still being computed cannot be read
    shards = torch_xla._XLAC._get_local_shards(list(tensors))
    return sum(per_device[0][0].numel() * per_device[0][0].element_size() for per_device in shards)


TILED = 3  # torch_xla's ShardingType (OpSharding.Type): split across devices


def _device_tensors(value: Any) -> list[torch.Tensor]:
    """The XLA tensors in a state, in a fixed order (dicts in insertion order)."""
    if isinstance(value, dict):
        return [t for v in value.values() for t in _device_tensors(v)]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _device_tensors(v)]
    return [value] if isinstance(value, torch.Tensor) and value.device.type == "xla" else []


def _local_pieces(state: Any, master: bool) -> list[list[tuple[Any, torch.Tensor]]]:
    """Per XLA tensor of state, what this host holds of it: [(indices or Ellipsis, CPU data)].

    Copying a sharded tensor with .cpu() compiles a small gather program per
    tensor, at every checkpoint (measured: 44 compilations per epoch for a
    22-tensor state); its shards come over as plain transfers. A tensor whole
    on every device is copied once, by the master, which has it too.
    """
    import torch_xla

    tensors = [t.detach() for t in _device_tensors(state)]
    pieces: list[list[tuple[Any, torch.Tensor]]] = []
    for tensor in tensors:
        if torch_xla._XLAC._get_xla_sharding_type(tensor) != TILED:
            pieces.append([(Ellipsis, tensor.cpu())] if master else [])
            continue
        (shards,) = torch_xla._XLAC._get_local_shards([tensor])
        (places,) = torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])
        mine = []
        for (data, _device), (_replica, indices) in zip(shards, places, strict=True):
            # A shard at the end of a dimension that does not divide evenly is padded.
            mine.append((indices, data[tuple(slice(0, s.stop - s.start) for s in indices)].clone()))
        pieces.append(mine)
    return pieces


def _assemble(state: Any, hosts: list[list[list[tuple[Any, torch.Tensor]]]], clone_cpu: bool = False) -> Any:
    """state with each XLA tensor replaced by the whole CPU tensor made of every host's pieces.

    clone_cpu: its CPU tensors copied too (runtime.device.to_host).
    """
    tensors = iter(range(len(hosts[0])))

    def whole(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: whole(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(whole(v) for v in value)
        if not (isinstance(value, torch.Tensor) and value.device.type == "xla"):
            return to_host(value, clone_cpu)
        index = next(tensors)
        result = torch.empty(value.shape, dtype=value.dtype)
        for host in hosts:
            for indices, data in host[index]:
                if indices is Ellipsis:
                    return data
                result[tuple(indices)] = data
        return result

    return whole(state)


class _BatchSharding(dict):
    """MpDeviceLoader's input_sharding: every batch field split over all devices on dimension 0.

    torch_xla looks up one ShardingSpec per key, and a spec only applies to a
    tensor of its own rank (otherwise the tensor is silently replicated), so
    the specs are made per field from the ranks the loader's batches have.
    The mesh is the run's mesh flattened (runtime.mesh.input_mesh): torch_xla
    2.9's loader cannot place a tensor on a mesh of more than one axis, and
    its minibatch sharding must split over every device.
    """

    def __init__(self, mesh: Any):
        super().__init__()
        self.mesh = mesh
        self.ranks: dict[str, int] = {}

    def note(self, batch: dict[str, torch.Tensor]) -> None:
        for key, tensor in batch.items():
            if self.ranks.get(key) != tensor.dim():
                import torch_xla.distributed.spmd as xs

                self.ranks[key] = tensor.dim()
                spec = (INPUT_AXIS,) + (None,) * (tensor.dim() - 1)
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


class SpmdRuntime(HostCollectives, XlaDevice):
    """This host's process, driving every device of a global mesh named as mesh.* and the strategy say."""

    def __init__(self, layout: MeshConfig, strategy: Strategy, compile_cache_dir: str | None = None):
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
        self.mesh_shape = mesh_shape(layout, strategy, self.num_devices)
        self.mesh = build_mesh(self.mesh_shape)
        self.input_mesh = input_mesh(self.mesh)
        xs.set_global_mesh(self.mesh)
        if self.world_size > 1:
            import torch.distributed as dist
            import torch_xla.distributed.xla_backend  # noqa: F401  (registers the xla:// rendezvous)

            # Host values between the hosts' processes: torch_xla's rendezvous
            # finds process 0's host from the TPU metadata (or MASTER_ADDR).
            if not dist.is_initialized():
                dist.init_process_group("gloo", init_method="xla://")

    def place(self, tensors: Iterable[torch.Tensor]) -> None:
        self.replicate(tensors)

    def shard(self, tensor: torch.Tensor, spec: Sequence[Any]) -> None:
        """Annotate a device tensor with a partition spec over this mesh's named axes."""
        import torch_xla.distributed.spmd as xs

        xs.mark_sharding(tensor, self.mesh, tuple(spec))

    def constrain_batch(self, batch: dict[str, torch.Tensor]) -> None:
        """Tell the partitioner how the step's batch is split: over the batch axes, whole along tensor.

        Batches arrive split over every device (runtime.mesh.input_mesh),
        which is that split when the tensor axis is 1; otherwise the devices
        of a tensor group gather their pieces here.
        """
        if self.mesh_shape.tensor == 1:
            return
        import torch_xla.distributed.spmd as xs

        for tensor in batch.values():
            xs.annotate_custom_sharding(tensor, self.mesh, batch_partition_spec(tensor.dim()))

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

    def place_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A batch split over the mesh as the device loader's thread sends each one (minibatch sharding)."""
        import torch_xla.core.xla_model as xm

        sharding = _BatchSharding(self.input_mesh)
        sharding.note(batch)
        return {key: xm.send_cpu_data_to_device(t, self.device, sharding[key])[0] for key, t in batch.items()}

    def device_loader(self, loader: Iterable, wait: InputWait | None = None) -> Iterator:
        if is_resident(loader):  # data.synthetic: sharded once, then XlaDevice's per-step marks
            yield from XlaDevice.device_loader(self, loader, wait)
            return
        sharding = _BatchSharding(self.input_mesh)
        source = ErrorKeepingIterable(_NotedBatches(loader, sharding))
        yield from timed_parallel_loader(source, self.device, wait, input_sharding=sharding)
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

    def state_to_host(self, state: Any, staging: HostStaging | None = None) -> Any | None:
        import torch_xla

        # Every host cuts the graph at the same point (pending work runs as
        # the one program it is part of), copies the shards it holds, and the
        # master puts each tensor together from every host's pieces. The cut
        # must also wait for that program: sync() returns while it still runs,
        # and reading a shard of a tensor it is computing fails ("Trying to
        # access XLA data ... while an async operation is in flight"). Only
        # whole tensors' .cpu() waits by itself, so saves passed whenever a
        # step closure had just read the loss (log_steps=1) and crashed
        # mid-epoch otherwise.
        torch_xla.sync(wait=True)
        pieces = self.gather_host("state-pieces", _local_pieces(state, self.is_master))
        if pieces is None:  # not the master
            return None
        # A staged (background) save must not alias the CPU tensors training keeps changing.
        return _assemble(state, pieces, clone_cpu=staging is not None)

    def gather_state_to_master(self, tag: str, state: Any) -> list[Any] | None:
        host = self.state_to_host(state)
        return None if host is None else [host]
