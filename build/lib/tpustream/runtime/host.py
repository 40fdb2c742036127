"""What this process and its host are, before or apart from any runtime: its replica, its TPU chips.

A leaf of the runtime package: the runtimes and the launcher ask it; it asks
only torch, torch_xla and observe.chips, each imported where it is needed.
"""

from __future__ import annotations

import os


def current_replica() -> tuple[int, int]:
    """(rank, world size) of the calling process, for code that runs outside our launcher.

    torch_xla first (an xmp.spawn replica, where torch.distributed is usually
    not initialised, so webdataset's own split_by_node sees a world of one and
    every replica reads every shard), then torch.distributed, then the RANK /
    WORLD_SIZE environment that torchrun sets; (0, 1) when alone.
    """
    import sys

    if "torch_xla" in sys.modules:  # imported by the caller: an XLA job
        import torch_xla.runtime as xr

        world = xr.world_size()
        if world > 1:
            return xr.global_ordinal(), world
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def tpu_accelerator_type() -> str | None:
    """This TPU host's accelerator type ("v4-8", "v5litepod-16", ...), or None when unknown."""
    from torch_xla._internal import tpu

    try:
        return tpu.get_tpu_type()  # TPU_ACCELERATOR_TYPE's prefix, or the metadata server's
    except Exception:  # no type known: what needs it (MFU, worker demand) is left out, never the run
        return None


def host_chip():
    """This TPU host's chip (observe.chips.Chip), or None when unknown."""
    from tpustream.observe.chips import chip_from_accelerator_type

    return chip_from_accelerator_type(tpu_accelerator_type())


def count_tpu_chips() -> int:
    """TPU chips on this machine's PCI bus, as torch_xla counts them (0 on a machine without)."""
    from torch_xla._internal import tpu

    return tpu.num_available_chips()
