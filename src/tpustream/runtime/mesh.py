"""The named device mesh of strategy=spmd / spmd_fsdp: its shape from mesh.* and the devices, and the mesh.

The mesh has four axes, outermost first (config.choices.MESH_AXES): ``slices``
(TPU slices over the data-centre network), then a slice's ``data``, ``fsdp``
and ``tensor`` devices. A batch is split over the first three (BATCH_AXES);
parameters over fsdp and, where mesh.rules say, tensor. Every axis is always
there, of size 1 when unused, so a partition spec means the same on any shape.

The shape is resolved from the config before spawning where the device count
is known (an XLA CPU mesh) and again in the process that builds the mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpustream.config import BATCH_AXES, MESH_AXES, MeshConfig, Strategy
from tpustream.errors import ConfigError

# The axis a strategy gives the devices mesh.* leaves unassigned (null): spmd is
# data parallel, spmd_fsdp shards the model over every device (FSDPv2).
STRATEGY_AXIS = {Strategy.spmd: "data", Strategy.spmd_fsdp: "fsdp"}
SLICE_AXES = MESH_AXES[1:]  # a slice's own: data, fsdp, tensor


@dataclass(frozen=True)
class MeshShape:
    """Devices along each mesh axis."""

    slices: int
    data: int
    fsdp: int
    tensor: int

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.slices, self.data, self.fsdp, self.tensor)

    @property
    def devices(self) -> int:
        return math.prod(self.sizes)

    @property
    def batch_shards(self) -> int:
        """The batch's pieces: devices along the tensor axis hold the same samples."""
        return self.slices * self.data * self.fsdp

    @property
    def shards_parameters(self) -> bool:
        return self.fsdp > 1 or self.tensor > 1

    def describe(self) -> str:
        axes = " x ".join(f"{name}={size}" for name, size in zip(MESH_AXES, self.sizes, strict=True))
        return axes if self.slices > 1 else axes.removeprefix("slices=1 x ")


def mesh_shape(mesh: MeshConfig, strategy: Strategy, devices: int) -> MeshShape:
    """The sizes of mesh.* over this many devices (every slice's), with null and -1 resolved.

    null is the strategy's: its axis (STRATEGY_AXIS) takes the rest of a
    slice's devices, the other axes 1, unless an axis is -1, which then takes
    the rest and every null is 1.
    """
    if devices % mesh.slices:
        raise ConfigError(
            f"mesh.slices={mesh.slices} does not divide the {devices} devices into equal slices"
        )
    per_slice = devices // mesh.slices
    given = {name: getattr(mesh, name) for name in SLICE_AXES}
    rest = next((name for name, size in given.items() if size == -1), None)
    if rest is None and given[STRATEGY_AXIS[strategy]] is None:
        rest = STRATEGY_AXIS[strategy]
    sizes = {name: 1 if size is None or name == rest else size for name, size in given.items()}
    known = math.prod(sizes.values())
    if rest is not None:
        if per_slice % known:
            raise ConfigError(
                f"mesh: {describe_given(given)} does not divide a slice's {per_slice} devices "
                f"({devices} devices in {mesh.slices} slice(s)), so mesh.{rest} cannot take the rest"
            )
        sizes[rest] = per_slice // known
    elif known != per_slice:
        raise ConfigError(
            f"mesh: {describe_given(given)} is {known} devices, but a slice has {per_slice} ({devices} "
            f"devices in {mesh.slices} slice(s)); set one axis to -1 to give it the rest"
        )
    return MeshShape(mesh.slices, sizes["data"], sizes["fsdp"], sizes["tensor"])


def describe_given(given: dict[str, int | None]) -> str:
    return " x ".join(f"mesh.{name}={'null' if size is None else size}" for name, size in given.items())


def build_mesh(shape: MeshShape) -> Any:
    """The torch_xla mesh: device ids in order within a slice; across slices, torch_xla's HybridMesh
    (the slices axis outermost, over DCN), which reads each device's slice_index."""
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    available = xr.global_runtime_device_count()
    if available != shape.devices:
        raise ConfigError(
            f"mesh: {shape.describe()} is {shape.devices} devices, but the runtime has {available}"
        )
    if shape.slices == 1:
        return xs.Mesh(np.arange(shape.devices), shape.sizes, MESH_AXES)
    attributes = xr.global_runtime_device_attributes()
    found = len({device.get("slice_index", 0) for device in attributes})
    if found != shape.slices:
        raise ConfigError(
            f"mesh.slices={shape.slices}, but the TPU runtime sees {found} "
            "slice(s): multislice needs every host of every slice started with the MEGASCALE_* environment "
            "(tpustream-pod --num-slices, docs/large-models.md)"
        )
    return xs.HybridMesh(
        ici_mesh_shape=(1, shape.data, shape.fsdp, shape.tensor),
        dcn_mesh_shape=(shape.slices, 1, 1, 1),
        axis_names=MESH_AXES,
    )


# The one axis of input_mesh.
INPUT_AXIS = "devices"


def input_mesh(mesh: Any) -> Any:
    """The mesh's devices in its order, as one axis: where the loader puts each batch.

    Split over it, a batch is split over the batch axes as the mesh has them
    (slices, data and fsdp outermost), each piece cut once more along tensor.
    """
    import torch_xla.distributed.spmd as xs

    devices = mesh.get_logical_mesh().flatten()
    return xs.Mesh(devices, (len(devices),), (INPUT_AXIS,))


def batch_partition_spec(rank: int) -> tuple[Any, ...]:
    """A batch field's sharding: its first dimension split over BATCH_AXES."""
    return (BATCH_AXES,) + (None,) * (rank - 1)
