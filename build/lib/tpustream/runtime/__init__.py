"""Everything replica-related behind one small interface.

The trainer, evaluation and checkpointing talk to a ``Runtime``: which device,
which replica, how to step the optimizer across replicas, how to reduce
metrics, how to get state to the host. The implementations:

- ``XlaRuntime``: a replica of an xmp.spawn job (a TPU core, or the single XLA
  CPU device); collectives through torch_xla.
- ``GlooRuntime``: a simulated pod replica, one process with its own XLA CPU
  device; the few collectives the trainer needs go through torch.distributed
  with the gloo backend (XLA:CPU has no working cross-device collectives,
  pytorch/xla#9089), so multi-replica behaviour can be tested on one machine.
- ``SpmdRuntime``: one process per host driving all its devices as one GSPMD
  program (strategy=spmd, spmd_fsdp); a replica is a host.
- ``NativeRuntime``: PyTorch without torch_xla (accelerator=cuda, cpu_eager):
  a process per GPU or CPU replica, collectives over NCCL or gloo.

One module each (``xla``, ``gloo``, ``spmd``, ``native``), the XLA ones on what
they share (``device``). Only ``native`` knows CUDA's specifics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.nn as nn

from tpustream.observe.profiler import TraceCapture
from tpustream.observe.timing import InputWait
from tpustream.runtime.host import count_tpu_chips, current_replica, host_chip, tpu_accelerator_type
from tpustream.runtime.staging import HostStaging


class Runtime(Protocol):
    device: torch.device
    rank: int  # global ordinal, 0 .. world_size - 1
    world_size: int
    local_rank: int
    # Devices this replica drives: its loader's batch is batch_size times this.
    local_devices: int

    @property
    def is_master(self) -> bool: ...

    def accelerator_type(self) -> str | None:
        """The TPU's accelerator type ("v4", "v5litepod", ...) or the GPU's name, for MFU; None on CPUs."""

    def device_loader(self, loader: Iterable, wait: InputWait | None = None) -> Iterator:
        """Iterate loader with batches already on the device (and a step boundary per batch).

        wait: gets the time the caller waited for each batch (observe.timing).
        A resident loader's batch is placed once and handed out as it is (runtime.resident).
        """

    def place(self, tensors: Iterable[torch.Tensor]) -> None:
        """Give tensors just copied to the device the placement the step's outputs have.

        A no-op on one device per replica; under SPMD, where a graph's identity
        includes its inputs' shardings, they are annotated whole on every device.
        """

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """The model on this replica's device as the runtime runs it (memory layout, compilation).

        XLA lays out and compiles the graph itself: the model as it is.
        """

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Copy the master's parameters and buffers to every replica (a collective)."""

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Average gradients over replicas, then step."""

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Sum device tensors over replicas (a collective: every replica must call it)."""

    def reduce_host_sum(self, tag: str, values: Sequence[float]) -> list[float]:
        """Sum host numbers over replicas (a collective)."""

    def all_gather_host(self, tag: str, value: Any) -> list[Any]:
        """Every replica's value of a small picklable object, in rank order (a collective)."""

    def barrier(self, tag: str) -> None: ...

    def add_step_closure(self, fn: Callable[..., Any], args: tuple = ()) -> None:
        """Run fn(*args) on the host once the current step's tensors are computed."""

    def state_to_host(self, state: Any, staging: HostStaging | None = None) -> Any | None:
        """state with its tensors on the CPU, on the master only (None elsewhere).

        A collective: every replica calls it at the same point of the program.
        staging: host buffers the copy may go into, the previous copy's (the
        caller is done with that one); a runtime whose host copies are fresh
        tensors anyway (XLA's transfers) ignores it.
        """

    def gather_state_to_master(self, tag: str, state: Any) -> list[Any] | None:
        """Every replica's state, tensors on the CPU, in rank order, on the master (None elsewhere).

        A collective, for sharded models: each replica holds a different part.
        """

    def rng_state(self) -> int:
        """The device random generator's state (dropout and other device randomness)."""

    def set_rng_state(self, state: int) -> None: ...

    def wait_device_ops(self) -> None: ...

    def compilations(self) -> int:
        """Graphs compiled so far in this process (for recompilation checks)."""

    def compile_seconds(self) -> float:
        """Seconds spent compiling so far in this process."""

    def trace_capture(self, output_dir: str, name: str) -> TraceCapture:
        """A trace of part of the run, under output_dir's tensorboard/name (debug.profile_*), not started."""


from tpustream.runtime.device import to_host  # noqa: E402
from tpustream.runtime.gloo import GlooRuntime  # noqa: E402
from tpustream.runtime.native import NativeRuntime  # noqa: E402
from tpustream.runtime.spmd import SpmdRuntime  # noqa: E402
from tpustream.runtime.xla import XlaRuntime  # noqa: E402

__all__ = [
    "GlooRuntime",
    "NativeRuntime",
    "Runtime",
    "SpmdRuntime",
    "XlaRuntime",
    "count_tpu_chips",
    "host_chip",
    "tpu_accelerator_type",
    "current_replica",
    "to_host",
]
