"""tpustream.pod.types: the slice table (sources in its docstring) holds together; unknown types fail."""

from __future__ import annotations

import math

import pytest

from tpustream.errors import ConfigError
from tpustream.pod.types import SLICE_TYPES, slice_type

# (type, hosts, chips per host, XLA devices per host, topology, GKE accelerator label)
KNOWN = [
    ("v2-8", 1, 4, 8, "2x2", None),
    ("v3-32", 4, 4, 8, "4x4", None),  # docs/pods.md: 4 hosts x 8 cores
    ("v4-8", 1, 4, 4, "2x2x1", "tpu-v4-podslice"),
    ("v4-32", 4, 4, 4, "2x2x4", "tpu-v4-podslice"),
    ("v5p-128", 16, 4, 4, "4x4x4", "tpu-v5p-slice"),
    ("v5litepod-8", 1, 8, 8, "2x4", "tpu-v5-lite-podslice"),
    ("v5litepod-16", 4, 4, 4, "4x4", "tpu-v5-lite-podslice"),
    ("v5litepod-256", 64, 4, 4, "16x16", "tpu-v5-lite-podslice"),
    ("v6e-1", 1, 1, 1, "1x1", "tpu-v6e-slice"),
    ("v6e-64", 16, 4, 4, "8x8", "tpu-v6e-slice"),
]


@pytest.mark.parametrize("name, hosts, chips, devices, topology, accelerator", KNOWN)
def test_known_types(name, hosts, chips, devices, topology, accelerator):
    kind = slice_type(name)
    assert (kind.hosts, kind.chips_per_host, kind.devices_per_host) == (hosts, chips, devices)
    assert (kind.topology, kind.gke_accelerator) == (topology, accelerator)


def test_every_type_is_consistent_with_its_name_and_topology():
    generations = {kind.generation for kind in SLICE_TYPES.values()}
    assert generations == {"v2", "v3", "v4", "v5p", "v5litepod", "v6e"}
    for name, kind in SLICE_TYPES.items():
        chips = math.prod(int(side) for side in kind.topology.split("x"))
        assert kind.chips == chips, name
        cores_per_chip = 2 if kind.generation in ("v2", "v3", "v4", "v5p") else 1
        assert name == f"{kind.generation}-{chips * cores_per_chip}"
        assert kind.runtime_version and (kind.gke_accelerator is None) == (kind.generation in ("v2", "v3"))


def test_an_unknown_type_names_the_known_ones_in_one_line():
    with pytest.raises(ConfigError) as error:
        slice_type("v5e-16")
    message = str(error.value)
    assert "\n" not in message and message.startswith("unknown TPU type 'v5e-16'; known: ")
    for group in ("v2-{8,", "v3-{8,", "v4-{8,", "v5p-{8,", "v5litepod-{1,4,8,16,", "v6e-{1,4,8,16,"):
        assert group in message
