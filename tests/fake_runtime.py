"""N replicas in this process, on the plain CPU device: a fake ``Runtime``, in-memory batches, a runner.

The trainer's arithmetic across replicas (stop votes, partial sums, reduced
metrics, resume positions) is the same whatever the device; checking it
needs neither torch_xla nor one process per replica. Each replica is a
thread with its own ``FakeRuntime``; the runtimes of one ``FakeWorld`` meet
at a barrier for every collective and check that all of them called the
same one, which also catches replicas whose programs went different ways.

Only eager CPU training runs here: an XLA backward in the same process as an
eager one trips an autograd assertion (see tests/test_training.py).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn as nn

from tpustream.errors import DataError
from tpustream.observe.profiler import TorchTraceCapture
from tpustream.observe.timing import timed
from tpustream.runtime.native import host_copy
from tpustream.runtime.staging import HostStaging

T = TypeVar("T")


class FakeWorld:
    """What the replicas of one simulated job share: the meeting point and their stop flags."""

    def __init__(self, world_size: int, timeout: float = 60.0, accelerator_type: str | None = None):
        self.world_size = world_size
        self.accelerator_type = accelerator_type
        # A timeout, so a replica that skips a collective fails the test instead of hanging it.
        self._barrier = threading.Barrier(world_size, timeout=timeout)
        self._slots: list[Any] = [None] * world_size
        # preemption's flag is process-wide; here each replica thread needs its own,
        # or a stop request on one replica would be seen by all without a vote.
        self._stop_flags = [threading.Event() for _ in range(world_size)]
        self._local = threading.local()

    # -- collectives -------------------------------------------------------
    def exchange(self, rank: int, what: str, value: Any) -> list[Any]:
        """Every replica's value, in rank order; all replicas must call it with the same `what`."""
        self._slots[rank] = (what, value)
        self._barrier.wait()
        entries = list(self._slots)
        self._barrier.wait()  # nobody overwrites a slot before everyone has read them all
        called = {name for name, _ in entries}
        if len(called) > 1:
            raise AssertionError(f"replicas met in different collectives: {sorted(called)}")
        return [v for _, v in entries]

    def abort(self) -> None:
        """Release the replicas waiting for one that failed (they raise BrokenBarrierError)."""
        self._barrier.abort()

    # -- stop requests, per replica thread -----------------------------------
    def bind(self, rank: int) -> None:
        self._local.rank = rank

    def request_stop(self) -> None:
        """preemption.request_stop for the calling replica only."""
        self._stop_flags[self._local.rank].set()

    def stop_requested(self) -> bool:
        """preemption.stop_requested as the calling replica sees it."""
        return self._stop_flags[self._local.rank].is_set()

    def stop_requested_by(self, rank: int) -> bool:
        """Whether replica `rank` itself was asked to stop (not whether it stopped)."""
        return self._stop_flags[rank].is_set()


def _sum_in_rank_order(values: Sequence[torch.Tensor]) -> torch.Tensor:
    total = values[0].clone()
    for value in values[1:]:
        total += value
    return total


class FakeRuntime:
    """tpustream.runtime.Runtime for one replica of a FakeWorld, eager on torch.device("cpu")."""

    def __init__(self, world: FakeWorld, rank: int):
        self.world = world
        self.device = torch.device("cpu")
        self.rank = self.local_rank = rank
        self.world_size = world.world_size
        self._rng = 0
        self.collectives: list[str] = []  # what this replica called, in order

    local_devices = 1

    @property
    def is_master(self) -> bool:
        return self.rank == 0

    def accelerator_type(self) -> str | None:
        return self.world.accelerator_type  # a test's pretend TPU (MFU), else None

    def place(self, tensors) -> None:
        pass

    def prepare_model(self, model):
        return model

    def _exchange(self, what: str, value: Any) -> list[Any]:
        self.collectives.append(what)
        return self.world.exchange(self.rank, what, value)

    def device_loader(self, loader, wait=None) -> Iterator:
        # Batches are on the CPU already, and eager ops run when called: no step to mark.
        yield from timed(loader, wait)

    def broadcast_parameters(self, model: nn.Module) -> None:
        tensors = [*model.parameters(), *model.buffers()]
        master = self._exchange("broadcast_parameters", [t.detach().clone() for t in tensors])[0]
        with torch.no_grad():
            for tensor, value in zip(tensors, master, strict=True):
                tensor.copy_(value)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        every = self._exchange("optimizer_step", [p.grad.detach().clone() for p in params])
        with torch.no_grad():
            for index, param in enumerate(params):
                param.grad.copy_(_sum_in_rank_order([grads[index] for grads in every]) / self.world_size)
        optimizer.step()

    def all_reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        every = self._exchange("all_reduce_sum", [t.detach().clone() for t in tensors])
        return [_sum_in_rank_order([values[i] for values in every]) for i in range(len(tensors))]

    def reduce_host_sum(self, tag: str, values: Sequence[float]) -> list[float]:
        every = self._exchange(f"reduce_host_sum:{tag}", [float(v) for v in values])
        return [sum(column) for column in zip(*every, strict=True)]

    def all_gather_host(self, tag: str, value: Any) -> list[Any]:
        return self._exchange(f"all_gather_host:{tag}", value)

    def barrier(self, tag: str) -> None:
        self._exchange(f"barrier:{tag}", None)

    def add_step_closure(self, fn: Callable[..., Any], args: tuple = ()) -> None:
        fn(*args)  # eager: the step's tensors are computed already

    def state_to_host(self, state: Any, staging: HostStaging | None = None) -> Any | None:
        # Copied: .cpu() of a CPU tensor is the tensor itself, which training goes on changing.
        if not self.is_master:
            return None
        return host_copy(state) if staging is None else staging.copy(state)

    def gather_state_to_master(self, tag: str, state: Any) -> list[Any] | None:
        every = self._exchange(f"gather_state_to_master:{tag}", host_copy(state))
        return every if self.is_master else None

    def rng_state(self) -> int:
        return self._rng

    def set_rng_state(self, state: int) -> None:
        self._rng = state

    def trace_capture(self, output_dir: str, name: str) -> TorchTraceCapture:
        return TorchTraceCapture(output_dir, name, cuda=False)

    def wait_device_ops(self) -> None:
        pass

    def compilations(self) -> int:
        return 0

    def compile_seconds(self) -> float:
        return 0.0


def run_replicas(
    world: FakeWorld, body: Callable[[FakeRuntime], T], timeout: float = 120.0
) -> list[T | BaseException]:
    """body(runtime) on every replica of world, each on its own thread; its result or exception per rank."""
    results: list[Any] = [None] * world.world_size

    def run(rank: int) -> None:
        world.bind(rank)
        try:
            results[rank] = body(FakeRuntime(world, rank))
        except BaseException as exc:
            results[rank] = exc
            # Not on Preempted: every replica raises it at the same point, past the last collective.
            if type(exc).__name__ != "Preempted":
                world.abort()

    threads = [
        threading.Thread(target=run, args=(rank,), name=f"replica-{rank}") for rank in range(world.world_size)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), f"{thread.name} did not finish in {timeout:g} s"
    return results


class MemorySource:
    """One replica's batches of an in-memory split: the trainer's EpochSource, without DataLoader.

    Step b of an epoch gives replica r the samples at places (b * world + r) * batch
    onwards of the epoch's order (shuffled per (seed, epoch) when shuffle is
    set); the last step is padded with weight-zero copies of sample 0, as
    last_batch=pad does. stop_at_batch asks (preemption.request_stop, which
    a FakeWorld makes per replica) for a stop just before that batch of each
    pass is handed out.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        shuffle: bool,
        seed: int = 0,
        stop_at_batch: tuple[int, int] | None = None,
        draws: Callable[[int, np.ndarray], dict[str, torch.Tensor]] | None = None,
        delay: float = 0.0,
    ):
        self.images, self.labels = images, labels
        self.delay = delay  # seconds each batch takes to make: a slow input pipeline
        self.draws = draws  # augment.draws.BatchDraws: the device augmentation's, per batch
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.shuffle, self.seed = shuffle, seed
        self.stop_at_batch = stop_at_batch  # (epoch, batch index within it)
        self.steps = math.ceil(len(labels) / (batch_size * world_size))
        self.epoch = self.skip = 0
        self.filled = self.batches = 0
        self.bad_shards: list[str] = []
        self.sample_ids: list[np.ndarray] = []

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.epoch, self.skip = epoch, skip_batches

    def __len__(self) -> int:
        return self.steps - self.skip

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        from tpustream import preemption

        self.filled = self.batches = 0
        self.sample_ids = []
        count = len(self.labels)
        order = (
            torch.randperm(count, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
            if self.shuffle
            else torch.arange(count)
        )
        for step in range(self.skip, self.steps):
            start = (step * self.world_size + self.rank) * self.batch_size
            places = torch.arange(start, start + self.batch_size)
            real = places < count
            ids = order[places.clamp(max=count - 1)].where(real, order[0])
            if self.stop_at_batch == (self.epoch, step):
                preemption.request_stop()
            self.sample_ids.append(ids[real].numpy())
            self.batches += 1
            batch = {"image": self.images[ids], "label": self.labels[ids], "real": real}
            if self.draws is not None:
                batch.update(self.draws(self.epoch, ids.where(real, -1).numpy()))
            time.sleep(self.delay)
            yield batch

    def raise_if_incomplete(self, split: str) -> None:
        if self.batches != len(self):
            raise DataError(f"{split} loader yielded {self.batches} of {len(self)} planned batches")

    def state_dict(self, position: tuple[int, int]) -> dict[str, Any]:
        """The data plan of a per-reader order (training.epoch_order), at position."""
        return {
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "num_workers": 0,
            "steps_per_epoch": self.steps,
            "seed": self.seed,
            "epoch": position[0],
            "step": position[1],
        }


# -- a tiny job -----------------------------------------------------------------


def tiny_split(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """count uint8 (3, 8, 8) images of 4 classes, each class a little brighter than the one before."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.arange(count) % 4
    noise = torch.randint(0, 120, (count, 3, 8, 8), generator=generator)
    return (noise + 40 * labels.view(-1, 1, 1, 1)).to(torch.uint8), labels


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))


def tiny_config(output_dir: str, **changes: Any):
    """A TrainConfig for tiny_split and tiny_model; changes by dotted name ("checkpoint.every_n_steps")."""
    from tpustream.config import AcceleratorConfig, DataConfig, ModelConfig, OptimConfig, TrainConfig

    cfg = TrainConfig()
    cfg.data = DataConfig(root="memory", train_shards="-", val_shards="-", num_workers=0)
    cfg.model = ModelConfig(name="tiny")
    cfg.optim = OptimConfig(lr=0.05)
    cfg.accelerator = AcceleratorConfig()
    cfg.output_dir = output_dir
    cfg.batch_size, cfg.epochs, cfg.log_steps, cfg.tensorboard = 4, 2, 1, False
    cfg.checkpoint.stop_check_every = 1
    for key, value in changes.items():
        target = cfg
        *parents, name = key.split(".")
        for parent in parents:
            target = getattr(target, parent)
        assert hasattr(target, name), key
        setattr(target, name, value)
    return cfg
