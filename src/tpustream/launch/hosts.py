"""This host's part in a multi-host pod before spawning: who counts a split's shards, and the wait for it.

Every host must plan the epoch from the same sample counts. Shards without a
recorded count are counted by pod host 0 alone, which writes the folder's
index; the other hosts read the split the same way but may not count, and
wait here until host 0's index covers it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence

from tpustream.config import Device, RuntimeKind, TrainConfig, positive_seconds
from tpustream.data.format.manifest import ShardManifest
from tpustream.data.resolve.split import SplitOptions, load_split, load_split_counted_elsewhere
from tpustream.errors import ConfigError
from tpustream.preemption import raise_if_stop_requested

log = logging.getLogger(__name__)


def host_index() -> int:
    """This host's index in its slice of a multi-host job (0 when alone).

    As the pod launcher sets it (TPUSTREAM_HOST_INDEX), else a native job's
    NODE_RANK (torchrun's convention).
    """
    name = "TPUSTREAM_HOST_INDEX" if "TPUSTREAM_HOST_INDEX" in os.environ else "NODE_RANK"
    value = os.environ.get(name) or "0"
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r}: expected a host number") from None


def slice_index() -> int:
    """This host's TPU slice in a multislice job (0 when one slice): MEGASCALE_SLICE_ID, the TPU
    runtime's own, as tpustream-pod --num-slices sets it."""
    value = os.environ.get("MEGASCALE_SLICE_ID") or "0"
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"MEGASCALE_SLICE_ID={value!r}: expected a slice number") from None


def counts_shards() -> bool:
    """Whether this host counts shards without recorded sample counts: the first host of the first slice."""
    return host_index() == 0 and slice_index() == 0


def runs_on_one_host(cfg: TrainConfig) -> bool:
    """Whether the job's replicas all run on this machine, as far as it can tell before spawning.

    A TPU VM cannot tell a one-host VM from a pod's host before its runtime
    starts: there the answer is False, the cautious one (checkpoint.local_tier).
    """
    if cfg.accelerator.runtime == RuntimeKind.native:
        return os.environ.get("MASTER_ADDR", "") == "" or _env_int("NNODES", 1, 1) == 1
    return cfg.accelerator.device == Device.CPU


def index_wait_seconds() -> float:
    """How long a pod host other than the first waits for host 0's index (TPUSTREAM_INDEX_WAIT_SECONDS)."""
    return positive_seconds("TPUSTREAM_INDEX_WAIT_SECONDS", 3600.0)


def load_split_on_this_host(
    spec: str | Sequence[str],
    split: str,
    options: SplitOptions,
    sleep: Callable[[float], None] = time.sleep,
) -> ShardManifest:
    """load_split as this pod host may: host 0 counts what is missing, the others wait for its index."""
    if counts_shards():
        return load_split(spec, split, options)

    def between_polls() -> None:
        raise_if_stop_requested("while waiting for pod host 0's index")

    return load_split_counted_elsewhere(
        spec, split, options, "pod host 0", index_wait_seconds(), between_polls, sleep
    )


# -- a native PyTorch job's machines (accelerator=cuda, cpu_eager) ----------------

# torchrun's default rendezvous port.
DEFAULT_MASTER_PORT = 29500


@dataclasses.dataclass(frozen=True)
class NativeHosts:
    """Where this machine's replica processes sit in a native job, and how they meet."""

    node_rank: int
    nodes: int
    per_node: int
    init_method: str

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node


def _env_int(name: str, default: int, minimum: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    try:
        number = int(value)
    except ValueError:
        number = minimum - 1
    if number < minimum:
        raise ConfigError(f"{name}={value!r}: expected a whole number >= {minimum}")
    return number


def native_hosts(per_node: int) -> NativeHosts:
    """This machine's part, from the variables torchrun's launch uses.

    Alone (no MASTER_ADDR): this machine's processes meet on 127.0.0.1 at a
    free port. Several machines: every one runs the same train.py command with
    MASTER_ADDR and MASTER_PORT (node 0's address), NNODES and its own
    NODE_RANK; WORLD_SIZE, when set, must be NNODES x processes per machine.
    """
    from tpustream.runtime.gloo import free_port

    address = os.environ.get("MASTER_ADDR", "")
    if not address:
        return NativeHosts(0, 1, per_node, f"tcp://127.0.0.1:{free_port()}")
    nodes = _env_int("NNODES", 1, 1)
    node_rank = _env_int("NODE_RANK", 0, 0)
    if node_rank >= nodes:
        raise ConfigError(f"NODE_RANK={node_rank} with NNODES={nodes}: node ranks run 0..{nodes - 1}")
    world = _env_int("WORLD_SIZE", nodes * per_node, 1)
    if world != nodes * per_node:
        raise ConfigError(
            f"WORLD_SIZE={world}, but NNODES={nodes} x {per_node} replica process(es) per machine "
            f"= {nodes * per_node}; unset WORLD_SIZE or set accelerator.num_devices"
        )
    port = _env_int("MASTER_PORT", DEFAULT_MASTER_PORT, 1)
    return NativeHosts(node_rank, nodes, per_node, f"tcp://{address}:{port}")
