"""What a replica does on its own XLA device, whichever way replicas talk."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from tpustream import progress
from tpustream.observe.profiler import TraceCapture
from tpustream.observe.timing import InputWait
from tpustream.observe.xla_metrics import compilation_count, compile_seconds
from tpustream.runtime.resident import is_resident, resident_batches
from tpustream.runtime.staging import HostStaging

# The variable torch_xla's jax workaround sets and pops around every xp.Trace (timed_parallel_loader).
MEGASCALE_SKIP = "SKIP_MEGASCALE_PJRT_CLIENT"


def map_tensors(function: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """value (tensors in nested dicts, lists and tuples) with function applied to each tensor."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, dict):
        return {k: map_tensors(function, v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(map_tensors(function, v) for v in value)
    return value


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a nested state (what its host copy takes)."""
    sizes: list[int] = []
    map_tensors(lambda tensor: sizes.append(tensor.nbytes), value)
    return sum(sizes)


def to_host(value: Any, clone_cpu: bool = False) -> Any:
    """value with every tensor in it copied to the CPU (device tensors are computed first).

    XLA tensors cross in one batched transfer, as xm.save moves them
    (xm._maybe_convert_to_cpu), not one round trip each: ResNet-50's 481
    state tensors took 0.05-0.20 s batched against 0.22-0.28 s one by one on
    the XLA CPU device (2-core development machine, 2026-11-27).

    .cpu() of a CPU tensor is the tensor itself, which training may go on
    changing (an XLA run's optimizer keeps Adam's step counts on the CPU). A
    copy that outlives the step (a checkpoint written in the background) needs
    clone_cpu: written from an alias, it could hash one value and store
    another. Without it, host tensors pass as they are (a synchronous save's
    FSDP state, consolidated on the host already, is not copied twice).
    """
    on_xla: list[torch.Tensor] = []
    map_tensors(lambda tensor: on_xla.append(tensor.detach()) if tensor.device.type == "xla" else None, value)
    transferred = iter(_xla_to_cpu(on_xla))

    def copy(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type == "xla":
            return next(transferred)  # the same order: map_tensors walks value the same way twice
        return tensor.detach().clone() if clone_cpu and tensor.device.type == "cpu" else tensor.detach().cpu()

    return map_tensors(copy, value)


def _xla_to_cpu(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """XLA tensors as CPU tensors, in one transfer ([] without any, torch_xla not imported)."""
    if not tensors:
        return []
    import torch_xla.core.xla_model as xm

    return list(xm._maybe_convert_to_cpu(tensors))


class ErrorKeepingIterable:
    """Iterates a loader on another thread, keeping its exception instead of raising it there."""

    def __init__(self, loader: Iterable):
        self.loader = loader
        self.error: Exception | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        self.error = None
        try:
            yield from self.loader
        except Exception as exc:
            self.error = exc


def timed_parallel_loader(
    source: Iterable, device: torch.device, wait: InputWait | None, **kwargs
) -> Iterator:
    """What pl.MpDeviceLoader(source, device, **kwargs) yields, timing each wait on its queue.

    The wait is measured where the training thread blocks for a batch the
    background thread has not put on the device yet (ParallelLoader.next_item),
    apart from the step boundary the per-device loader marks before it (which
    may compile, and is not waiting for input).

    The device's gaps between steps are recorded there too (observe.idle.ReadyGaps):
    PerDeviceLoader.next is where the loop asks for a batch, and cuts the
    previous step's graph (torch_xla.sync, which mostly returns while the
    device runs it: torch_xla 2.9 queues several steps) before next_item;
    each step's output tells when it is done through on_ready_callback, which
    neither blocks nor copies.
    """
    import torch_xla.distributed.parallel_loader as pl
    from torch_xla.experimental.callback import on_ready_callback

    from tpustream.observe.idle import ReadyGaps

    # ParallelLoader wraps its threads' work in xp.Trace, and torch_xla 2.9
    # enters every Trace by setting SKIP_MEGASCALE_PJRT_CLIENT in os.environ
    # and popping it again (jax_workarounds.jax_env_context, around its try
    # at importing jax). With data.num_workers=0 the shards are read on the
    # loader's own thread, and reading over HTTP (gs://, https://) iterates
    # os.environ (requests' proxy lookup): a key popped between the listing
    # and the lookup raised KeyError: 'SKIP_MEGASCALE_PJRT_CLIENT' and failed
    # a replica of the simulated pod. Set, the context restores the value
    # instead of popping it, so the environment's keys stop changing. By now
    # this process's own PJRT client exists (the model is on the device); the
    # variable only tells a later one, jax's, not to start MegaScale, which is
    # what torch_xla sets it for.
    os.environ.setdefault(MEGASCALE_SKIP, "true")

    gaps = None if wait is None else ReadyGaps(wait, on_ready_callback)
    if wait is not None:
        wait.gaps = gaps

    class TimedDeviceLoader(pl.PerDeviceLoader):
        def next(self):
            if gaps is not None:
                gaps.asked()
            return super().next()

    class TimedLoader(pl.ParallelLoader):
        def per_device_loader(self, device):
            return TimedDeviceLoader(self, torch.device(device))

        def next_item(self, device):
            start = time.perf_counter()
            progress.input_wait_started()  # the step before was cut (compiled) in next()
            if gaps is not None:
                gaps.handed_over(will_wait=self.nothing_ready(device))
            item = super().next_item(device)
            progress.input_wait_ended()
            if wait is not None:
                wait.add(time.perf_counter() - start)
            if gaps is not None:
                gaps.received(last=item is None)
            return item

        def nothing_ready(self, device) -> bool:
            # torch_xla 2.9's per-device queue (utils.keyd_queue.Queue) keeps its batches in a
            # deque, _items; where it does not, every step is treated as followed by a wait.
            items = getattr(self._queues[device].queue, "_items", None)
            return items is None or not items

    # As MpDeviceLoader: never closed here; a later epoch's iteration makes a new one.
    return TimedLoader(source, [device], **kwargs).per_device_loader(device)


class XlaDevice:
    """What a replica does on its own XLA device, whichever way replicas talk."""

    rank: int
    world_size: int
    local_devices = 1

    def __init__(self, compile_cache_dir: str | None, cache_subdir: str):
        import torch_xla
        import torch_xla.runtime as xr

        if compile_cache_dir:
            # One folder per local process: concurrent writers to one cache
            # folder are not supported, and the same (shape, program) compiles
            # identically on every replica of a host anyway.
            xr.initialize_cache(os.path.join(compile_cache_dir, cache_subdir), readonly=False)
        self.device = torch_xla.device()

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def prepare_model(self, model):
        return model  # XLA lays out and compiles the graph itself

    def accelerator_type(self) -> str | None:
        import torch_xla.runtime as xr

        if xr.device_type() != "TPU":
            return None
        from tpustream.runtime.host import tpu_accelerator_type

        return tpu_accelerator_type()

    def place(self, tensors: Iterable[torch.Tensor]) -> None:
        pass  # one device: a tensor is where it was copied to

    def place_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A batch on this device, copied as the device loader's thread copies each one."""
        import torch_xla.core.xla_model as xm

        return xm.send_cpu_data_to_device([batch], self.device)[0]

    def device_loader(self, loader: Iterable, wait: InputWait | None = None) -> Iterator:
        if is_resident(loader):  # data.synthetic: one batch, kept on the device
            import torch_xla

            yield from resident_batches(loader, self.place_batch, wait, torch_xla.sync)
            return
        # MpDeviceLoader's ParallelLoader moves batches on a background thread and
        # marks a step at every batch, so the training loop never syncs explicitly.
        # If the loader raises on that thread, torch_xla 2.9 closes the queue as if
        # the epoch had ended (and the traceback goes to stderr): catch the
        # error there and raise it here, in the training thread.
        source = ErrorKeepingIterable(loader)
        yield from timed_parallel_loader(source, self.device, wait)
        if source.error is not None:
            raise source.error

    def add_step_closure(self, fn: Callable[..., Any], args: tuple = ()) -> None:
        import torch_xla.core.xla_model as xm

        xm.add_step_closure(fn, args=args)

    def state_to_host(self, state: Any, staging: HostStaging | None = None) -> Any | None:
        import torch_xla

        # What xm.save does, with public calls: every replica cuts the graph
        # here (pending work, collectives included, runs the same program on
        # all of them), then only the master copies tensors, which are plain
        # device data by now, to the host.
        torch_xla.sync()
        if not self.is_master:
            return None
        # XLA's transfers make fresh host tensors: staging buffers would add a copy. A staged
        # (background) save still must not alias the CPU tensors training keeps changing.
        return to_host(state, clone_cpu=staging is not None)

    def gather_state_to_master(self, tag: str, state: Any) -> list[Any] | None:
        import torch_xla

        # Cut the graph first, as state_to_host does: copying pending tensors
        # one by one would compute them in graphs of their own, which XLA may
        # fuse, and round, differently from the training step's graph.
        torch_xla.sync()
        states = self.all_gather_host(tag, to_host(state))
        return states if self.is_master else None

    def rng_state(self) -> int:
        import torch_xla.core.xla_model as xm

        return int(xm.get_rng_state(self.device))

    def set_rng_state(self, state: int) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(state, self.device)

    def wait_device_ops(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    def compilations(self) -> int:
        return compilation_count()

    def trace_capture(self, output_dir: str, name: str) -> TraceCapture:
        return TraceCapture(output_dir, name)

    def compile_seconds(self) -> float:
        return compile_seconds()
