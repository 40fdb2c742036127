"""A replica in PyTorch itself, without torch_xla: a process per GPU (NCCL) or per CPU replica (gloo).

accelerator=cuda and accelerator=cpu_eager. torch.distributed must already be
initialised with this rank and world size. Tensors live on the replica's own
device and ops run when called, so there is no step to mark, no graph to
compile, and a step closure runs at once. Nothing here imports torch_xla: a
GPU machine without it installed runs this path.

The device is spoken to through torch.accelerator and its device module
(torch.get_device_module: torch.cuda for a GPU), not through CUDA by name: a
backend whose module has CUDA's stream, event and RNG calls (torch.xpu, or an
out-of-tree PrivateUse1 device registered with torch._register_device_module)
needs only its Device member and accelerator option (config.choices.PLATFORMS).
Only cuDNN's settings and the profiler's activity are CUDA's alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn

from tpustream.observe.idle import EventGaps, SynchronousGaps
from tpustream.observe.profiler import TorchTraceCapture
from tpustream.observe.timing import InputWait, timed
from tpustream.runtime.device import map_tensors, to_host
from tpustream.runtime.gloo import HostCollectives, average_flat
from tpustream.runtime.resident import is_resident, resident_batches
from tpustream.runtime.staging import HostStaging

# A device generator's state (CUDA's Philox): its seed and offset, 8 bytes each.
DEVICE_RNG_STATE_BYTES = 16


def native_device(device_type: str, local_rank: int, deterministic: bool = False) -> torch.device:
    """This replica's device: <type>:<local_rank> made current (cuDNN set up on CUDA), or the CPU.

    device_type is config.Device's value (CPU, CUDA). deterministic: cuDNN's
    deterministic algorithms and no autotuning (what bitwise resumes need: the
    autotuner may pick another kernel in a resumed process, and some backward
    kernels add in a varying order); otherwise cudnn.benchmark, the fastest
    kernel for each shape.
    """
    kind = device_type.lower()
    if kind == "cpu":
        return torch.device("cpu")
    device = torch.device(kind, local_rank)
    torch.get_device_module(device).set_device(local_rank)
    if kind == "cuda":
        torch.backends.cudnn.deterministic = deterministic
        torch.backends.cudnn.benchmark = not deterministic
    return device


def host_copy(value: Any) -> Any:
    """value with its tensors copied to the CPU, never aliased (one copy each: runtime.device.to_host).

    .cpu() of a CPU tensor is the tensor itself, which training goes on
    changing after a checkpoint's state was taken.
    """
    return to_host(value, clone_cpu=True)


def _to_device(value: Any, device: torch.device) -> Any:
    # From page-locked memory the copy is asynchronous: the host goes on
    # preparing the next step while the GPU copies this one's batch. Images
    # decoded on the GPU (data.decode=device) are there already.
    return map_tensors(
        lambda tensor: (
            tensor if tensor.device == device else tensor.pin_memory().to(device, non_blocking=True)
        ),
        value,
    )


class _CopyStream:
    """Batches copied to the GPU on a stream of their own, each handed over once its copy is done.

    On the compute stream, a batch's copy (about 38 MB for ResNet-50's 256 at
    224: over a millisecond of PCIe) ran between one step's kernels and the
    next: the GPU stood still for it every step, and observe.idle counted it
    as waiting for input. Here it runs on the GPU's copy engine while the step
    before computes (apex's data_prefetcher pattern): the compute stream waits
    for its event just before the step that reads it, and each tensor is
    recorded as used by the compute stream, so its memory, allocated on the
    copy stream, is not reused while the step reads it. The page-locked source
    is kept by torch's host allocator until the copy's own stream passes it.
    """

    def __init__(self, device: torch.device):
        self.module = torch.get_device_module(device)
        self.stream = self.module.Stream(device)
        self.compute = self.module.current_stream(device)

    def place(self, place_batch: Callable[[Any], Any], batch: Any) -> tuple[Any, torch.Event]:
        """(the batch on the device, the event its copy and layout end at), queued on the copy stream."""
        # Images decoded on the GPU (data.decode=device) are complete already, but made on
        # another stream: the layout change reads them here, so their memory waits for it.
        _used_on(self.stream, batch)
        with self.module.stream(self.stream):
            moved = place_batch(batch)
            copied = self.module.Event()
            copied.record()
        return moved, copied

    def ready(self, moved: Any, copied: torch.Event) -> Any:
        """The batch, for the compute stream's next step: after its copy, its memory held for it."""
        self.compute.wait_event(copied)
        _used_on(self.compute, moved)
        return moved


def _used_on(stream: torch.Stream, value: Any) -> None:
    """Each device tensor of value recorded as used on `stream`: its memory outlasts the work queued there."""

    def record(tensor: torch.Tensor) -> None:
        if tensor.device.type != "cpu":
            tensor.record_stream(stream)

    map_tensors(record, value)


def _recorded_event(module: Any) -> torch.Event:
    """A timing event recorded on the device's current (compute) stream: no synchronisation, read later."""
    event = module.Event(enable_timing=True)
    event.record()
    return event


def _between_events(batch: Any, gaps: EventGaps | None) -> Iterator:
    """batch, yielded between its step's start and end events."""
    if gaps is not None:
        gaps.started()
    yield batch
    if gaps is not None:
        gaps.ended()


class NativeRuntime(HostCollectives):
    """tpustream.runtime.Runtime for one replica of a torch.distributed job, on a GPU or the CPU."""

    local_devices = 1

    def __init__(
        self,
        rank: int,
        world_size: int,
        local_rank: int,
        device: torch.device,
        channels_last: bool = False,
        compile: bool = False,
    ):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.device = device
        self.channels_last = channels_last
        self.compile = compile

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """channels_last weights; torch.compile in place (nn.Module.compile: the same state_dict keys)."""
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        if self.compile:
            model.compile()
        return model

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def accelerator_type(self) -> str | None:
        # The GPU's name, for MFU's peak table (observe.chips); a CPU has none.
        if self.device.type == "cpu":
            return None
        return torch.get_device_module(self.device).get_device_name(self.device)

    def place(self, tensors: Iterable[torch.Tensor]) -> None:
        pass

    def place_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A batch on this replica's device in the model's memory layout, as the loader copies each one."""
        return self._laid_out(batch if self.device.type == "cpu" else _to_device(batch, self.device))

    def device_loader(self, loader: Iterable, wait: InputWait | None = None) -> Iterator:
        if is_resident(loader):  # data.synthetic: one batch, kept on the device; eager: no step to mark
            yield from resident_batches(loader, self.place_batch, wait)
            return
        batches = timed(loader, wait)
        if self.device.type == "cpu":
            if wait is not None:
                wait.gaps = SynchronousGaps(wait)  # eager on the CPU: idle exactly while waiting
            yield from map(self.place_batch, batches)  # the batch is where the model is
            return
        # Events on the compute stream at each step's start and end (observe.idle).
        module = torch.get_device_module(self.device)
        gaps = None if wait is None else EventGaps(wait, lambda: _recorded_event(module))
        if wait is not None:
            wait.gaps = gaps
        # One batch ahead, on a stream of its own: the next batch's copy overlaps this one's step.
        copies = _CopyStream(self.device)
        pending = None
        for batch in batches:
            moved = copies.place(self.place_batch, batch)
            if pending is not None:
                yield from _between_events(copies.ready(*pending), gaps)
            pending = moved
        if pending is not None:
            yield from _between_events(copies.ready(*pending), gaps)

    def _laid_out(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch's images in the model's memory layout (the uint8 copy is the cheap one to convert)."""
        if self.channels_last and "image" in batch:
            batch["image"] = batch["image"].contiguous(memory_format=torch.channels_last)
        return batch

    def broadcast_parameters(self, model: nn.Module) -> None:
        import torch.distributed as dist

        if self.world_size == 1:
            return
        with torch.no_grad():
            for tensor in (*model.parameters(), *model.buffers()):
                dist.broadcast(tensor.data, src=0)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if grads and self.world_size > 1:
            average_flat(grads, self.world_size)
        optimizer.step()

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        import torch.distributed as dist

        if self.world_size == 1:
            return list(tensors)
        out = []
        for tensor in tensors:
            total = tensor.detach().clone()
            dist.all_reduce(total)
            out.append(total)
        return out

    def add_step_closure(self, fn: Callable[..., Any], args: tuple = ()) -> None:
        fn(*args)  # eager: the step's tensors are computed (or queued, on a GPU) already

    def state_to_host(self, state: Any, staging: HostStaging | None = None) -> Any | None:
        if not self.is_master:
            return None
        return host_copy(state) if staging is None else staging.copy(state)

    def gather_state_to_master(self, tag: str, state: Any) -> list[Any] | None:
        return self.gather_host(tag, host_copy(state))

    def rng_state(self) -> int:
        # The CPU generator is checkpointed as torch's own; a device's is its seed and offset.
        if self.device.type == "cpu":
            return 0
        state = torch.get_device_module(self.device).get_rng_state(self.device)
        return int.from_bytes(bytes(state.tolist()), "little")

    def set_rng_state(self, state: int) -> None:
        if self.device.type == "cpu":
            return
        module = torch.get_device_module(self.device)
        if state < 2**64:
            # A seed (an XLA run's checkpoint, or a device state at offset 0: the same thing).
            module.manual_seed(state)
            return
        raw = state.to_bytes(DEVICE_RNG_STATE_BYTES, "little")
        module.set_rng_state(torch.tensor(list(raw), dtype=torch.uint8), self.device)

    def wait_device_ops(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)

    def compilations(self) -> int:
        return 0  # eager: nothing is compiled

    def trace_capture(self, output_dir: str, name: str) -> TorchTraceCapture:
        return TorchTraceCapture(output_dir, name, cuda=self.device.type == "cuda")

    def compile_seconds(self) -> float:
        return 0.0
