"""Cloud TPU slice types: hosts per slice, chips and XLA devices per host, topology, GKE labels, runtime.

Sources, read 2026-11-27:
- xpk's system characteristics table (AI-Hypercomputer/xpk, src/xpk/core/system_characteristics.py
  at 367c838): the GKE accelerator label (``cloud.google.com/gke-tpu-accelerator``), the topology
  (``cloud.google.com/gke-tpu-topology``), the machine type and 4 chips per VM for v4, v5p, v5e
  and v6e slices; a slice's name counts TensorCores (v4, v5p: 2 per chip) or chips (v5e, v6e).
- Cloud TPU's version pages (https://cloud.google.com/tpu/docs/v3, /v4, /v5e): a v2 or v3 chip
  has 2 TensorCores, each an XLA device, and a host has 4 chips (v2-8 and v3-8 are one host); a
  v4 or v5p chip's 2 cores are one XLA device (megacore); v5e and v6e name chips, one core each;
  an 8-chip v5e or v6e slice is one host of 8 chips as a TPU VM (GKE: the ct5lp-hightpu-8t or
  ct6e-standard-8t machine). xpk lists no GKE labels for v2 and v3: gke-manifest refuses them.
- Cloud TPU "TPU software versions" (https://cloud.google.com/tpu/docs/runtimes): the runtime
  for PyTorch: v2-alpha-tpuv6e, v2-alpha-tpuv5 (v5p), v2-alpha-tpuv5-lite (v5e),
  tpu-ubuntu2204-base (v4 and older).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpustream.errors import ConfigError


@dataclass(frozen=True)
class SliceType:
    """One accelerator type, e.g. v5litepod-16: 4 hosts of 4 chips, topology 4x4."""

    name: str  # as gcloud's --accelerator-type takes it
    generation: str  # v2, v3, v4, v5p, v5litepod, v6e
    hosts: int  # TPU VMs in the slice: the pod launcher's workers, the JobSet's pods
    chips_per_host: int  # google.com/tpu per pod on GKE
    devices_per_host: int  # XLA devices per host: replicas xmp.spawn starts there
    topology: str
    runtime_version: str
    gke_accelerator: str | None  # None: not offered on GKE
    gke_machine_type: str | None

    @property
    def chips(self) -> int:
        return self.hosts * self.chips_per_host

    @property
    def devices(self) -> int:
        return self.hosts * self.devices_per_host


@dataclass(frozen=True)
class _Generation:
    cores_per_chip: int  # the name counts TensorCores (2) or chips (1)
    devices_per_chip: int  # XLA devices: v2/v3 cores are devices; megacore chips are one
    runtime_version: str
    gke_accelerator: str | None
    machine_type: str | None  # GKE machine type of a 4-chip host
    topologies: str  # the slices offered, smallest first, space-separated


_GENERATIONS = {
    "v2": _Generation(2, 2, "tpu-ubuntu2204-base", None, None, "2x2 4x4 8x8 8x16 16x16"),
    "v3": _Generation(2, 2, "tpu-ubuntu2204-base", None, None, "2x2 4x4 4x8 8x8 8x16 16x16 16x32 32x32"),
    "v4": _Generation(
        2,
        1,
        "tpu-ubuntu2204-base",
        "tpu-v4-podslice",
        "ct4p-hightpu-4t",
        "2x2x1 2x2x2 2x2x4 2x4x4 4x4x4 4x4x8 4x8x8 8x8x8 8x8x12 8x8x16 8x16x16",
    ),
    "v5p": _Generation(
        2,
        1,
        "v2-alpha-tpuv5",
        "tpu-v5p-slice",
        "ct5p-hightpu-4t",
        "2x2x1 2x2x2 2x2x4 2x4x4 4x4x4 4x4x8 4x8x8 8x8x8 8x8x16 8x16x16 16x16x16",
    ),
    "v5litepod": _Generation(
        1,
        1,
        "v2-alpha-tpuv5-lite",
        "tpu-v5-lite-podslice",
        "ct5lp-hightpu-4t",
        "1x1 2x2 2x4 4x4 4x8 8x8 8x16 16x16",
    ),
    "v6e": _Generation(
        1,
        1,
        "v2-alpha-tpuv6e",
        "tpu-v6e-slice",
        "ct6e-standard-4t",
        "1x1 2x2 2x4 4x4 4x8 8x8 8x16 16x16",
    ),
}
CHIPS_PER_HOST = 4  # every multi-host slice of these generations
# Slices smaller than a host, or v5e/v6e's 8-chip host: (machine type, chips) by generation.
_SINGLE_HOST_MACHINES = {
    "v5litepod": {1: "ct5lp-hightpu-1t", 8: "ct5lp-hightpu-8t"},
    "v6e": {1: "ct6e-standard-1t", 8: "ct6e-standard-8t"},
}


def _build(generation: str, spec: _Generation, topology: str) -> SliceType:
    chips = math.prod(int(side) for side in topology.split("x"))
    single = _SINGLE_HOST_MACHINES.get(generation, {})
    if chips in single:
        hosts, per_host, machine = 1, chips, single[chips]
    else:
        hosts, per_host = max(1, chips // CHIPS_PER_HOST), min(chips, CHIPS_PER_HOST)
        machine = spec.machine_type
    return SliceType(
        name=f"{generation}-{chips * spec.cores_per_chip}",
        generation=generation,
        hosts=hosts,
        chips_per_host=per_host,
        devices_per_host=per_host * spec.devices_per_chip,
        topology=topology,
        runtime_version=spec.runtime_version,
        gke_accelerator=spec.gke_accelerator,
        gke_machine_type=machine if spec.gke_accelerator else None,
    )


SLICE_TYPES: dict[str, SliceType] = {
    built.name: built
    for generation, spec in _GENERATIONS.items()
    for built in (_build(generation, spec, topology) for topology in spec.topologies.split())
}


def known_types() -> str:
    """The known types in one line, grouped by generation: ``v2-8..512 (5), ...``."""
    groups = []
    for generation in _GENERATIONS:
        sizes = [t.name.rsplit("-", 1)[1] for t in SLICE_TYPES.values() if t.generation == generation]
        groups.append(f"{generation}-{{{','.join(sizes)}}}")
    return " ".join(groups)


def slice_type(name: str) -> SliceType:
    """The SliceType called ``name``; a ConfigError naming the known ones for any other."""
    try:
        return SLICE_TYPES[name]
    except KeyError:
        raise ConfigError(f"unknown TPU type {name!r}; known: {known_types()}") from None
