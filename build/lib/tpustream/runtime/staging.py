"""Host buffers a checkpoint's state is copied into, kept from one save to the next.

A fresh host copy of a large state costs page faults for every page of it
(828 MB of wrn_seed: about 200,000), which on a virtual machine that hands
freed memory back to its host are the larger part of the copy. torch's own
asynchronous checkpointing keeps its staged state dict between saves for the
same reason (torch.distributed.checkpoint.staging, cache_staged_state_dict);
for a GPU the buffers are page-locked, so the device-to-host copies run at
the bus's speed and overlap one another. The cost: the buffers stay allocated
for the run, one copy of the state (the memory an asynchronous save holds
anyway while it is written).
"""

from __future__ import annotations

from typing import Any

import torch


class HostStaging:
    """copy(state): the state with every tensor copied into a host buffer kept for the next copy.

    The buffers of one copy are reused by the next: the caller must be done
    with a copy (written it) before asking for another. Buffers are matched by
    the tensor's place in the state and its shape, dtype and strides; a place
    that changed gets a new buffer, and a place gone from the state frees its.
    """

    def __init__(self, pin_memory: bool = False):
        self.pin_memory = pin_memory
        self._buffers: dict[tuple, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self._buffers.values())

    def release(self) -> None:
        """Free the buffers (a save too large to keep a copy of between saves)."""
        self._buffers = {}

    def copy(self, state: Any) -> Any:
        used: dict[tuple, torch.Tensor] = {}
        with torch.no_grad():  # a parameter's values into a plain buffer: nothing to record
            copied = self._copy(state, (), used)
        self._buffers = used
        if self.pin_memory and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
        return copied

    def _copy(self, value: Any, path: tuple, used: dict[tuple, torch.Tensor]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, path, used)
        if isinstance(value, dict):
            return {key: self._copy(item, (*path, key), used) for key, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._copy(item, (*path, index), used) for index, item in enumerate(value))
        return value

    def _copy_tensor(self, tensor: torch.Tensor, path: tuple, used: dict[tuple, torch.Tensor]) -> Any:
        buffer = self._buffers.get(path)
        if (
            buffer is None
            or buffer.shape != tensor.shape
            or buffer.dtype != tensor.dtype
            or buffer.stride() != tensor.stride()
        ):
            # The source's layout where it is dense (channels_last stays channels_last), as a
            # fresh .cpu() gives: a plain copy, and the same bytes for torch.save.
            pin = self.pin_memory and tensor.device.type == "cuda"
            buffer = torch.empty_like(tensor, device="cpu", pin_memory=pin)
        buffer.copy_(tensor, non_blocking=buffer.is_pinned())
        used[path] = buffer
        return buffer
