"""One model's training step with augmentation off and on, timed in its own process (bench.augment's child).

    python -m bench.augment.device --model resnet50 --batches FILE --steps 6 --calls 10 --out FILE

bench.augment.steps runs one such process per model and backend, one at a
time: XLA keeps its own process (its runtime, graph cache and metrics are
per process), and eager CPU runs never share one with it. The child moves
the batches (uint8 crops from tpustream's pipeline with the host's draws) to
the device, compiles every graph once (warm-up), then times --steps steps of
each form, alternating off and on so that a change in the machine's load
falls on both, and --calls calls of the augmentation alone (whole, and each
part with the Normalizer: AUGMENT_FORMS), and writes the times (seconds),
the graphs each call ran, the XLA compile counts and the operations that
fell back to the host to --out as JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.augment.recipe import AUGMENT_ON, LABEL_SMOOTHING
from bench.pipeline.harness import ForeignCpu
from bench.pipeline.imagenet_configs import MEAN, STD
from tpustream.augment.transform import DRAW_KEYS, DeviceAugment
from tpustream.training.normalize import Normalizer
from tpustream.training.optimizer import prime_optimizer_state

FORMS = ("off", "on")
# The draws each part of the augmentation reads: DeviceAugment applies the
# parts whose draws a batch carries, so a batch with one part's draws times that part.
PART_DRAWS = {
    "randaugment": ("aug_op", "aug_matrix", "aug_value", "aug_rest"),
    "erasing": ("erase_box", "erase_value", "erase_key"),
    "mixing": ("mix_lam", "mix_rest", "mix_cut", "mix_box"),
}
AUGMENT_FORMS = (*FORMS, *PART_DRAWS)  # off: the Normalizer alone; each part includes it


def make_model(name: str) -> torch.nn.Module:
    """Randomly initialised, 1000 classes (no download: the weights do not change the time)."""
    if name == "resnet50":
        import torchvision

        return torchvision.models.resnet50()
    import timm

    return timm.create_model(name, pretrained=False)


class Backend:
    """Where the step runs: eager CPU, or the XLA device (CPU here) whose lazy graphs finish() runs."""

    def __init__(self, name: str):
        self.name = name
        if name == "xla":
            import torch_xla

            self.device = torch_xla.device()
        else:
            self.device = torch.device("cpu")

    def finish(self) -> None:
        """Run what has been traced and wait for it: the step's end as the host sees it."""
        if self.name == "xla":
            import torch_xla
            import torch_xla.core.xla_model as xm

            torch_xla.sync()
            xm.wait_device_ops()

    def _metric_count(self, name: str) -> int | None:
        if self.name != "xla":
            return None
        import torch_xla.debug.metrics as met

        data = met.metric_data(name)  # None until something records it
        return int(data[0]) if data else 0

    def compilations(self) -> int | None:
        return self._metric_count("CompileTime")

    def executions(self) -> int | None:
        """Graphs run so far: a step that is one graph runs one."""
        return self._metric_count("ExecuteTime")

    def fallbacks(self) -> dict[str, int]:
        """Calls of aten operations torch_xla has no lowering for: each ran on the host (inputs read back)."""
        if self.name != "xla":
            return {}
        import torch_xla.debug.metrics as met

        return {
            name: int(met.counter_value(name)) for name in met.counter_names() if name.startswith("aten::")
        }


class Step:
    """One training step (forward, backward, AdamW), the trainer's two ways.

    off: the Normalizer and cross-entropy; on: DeviceAugment (operations,
    normalise, erase, mix) and its soft-target loss. Label smoothing in both.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, batch_size: int):
        self.model = model.to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.05)
        # Lazily created state would make the first step a graph of its own (one more compilation).
        prime_optimizer_state(self.optimizer)
        self.normalize = Normalizer(MEAN, STD, device)
        self.augment = DeviceAugment(AUGMENT_ON, self.normalize, LABEL_SMOOTHING, group=batch_size, mean=MEAN)

    def __call__(self, batch: dict[str, torch.Tensor], form: str) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        if form == "on":
            batch = self.augment(batch)
            loss = self.augment.loss(self.model(batch["input"]), batch).mean()
        else:
            logits = self.model(self.normalize(batch["image"]))
            loss = F.cross_entropy(logits, batch["label"], label_smoothing=LABEL_SMOOTHING)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def augment_only(self, batch: dict[str, torch.Tensor], form: str) -> torch.Tensor:
        """The model's input alone: what the step computes before the model (AUGMENT_FORMS)."""
        if form == "off":
            return self.normalize(batch["image"])
        if form in PART_DRAWS:
            batch = {
                key: value for key, value in batch.items() if key not in DRAW_KEYS or key in PART_DRAWS[form]
            }
        return self.augment(batch)["input"]


def timed(run: Callable[[], object], backend: Backend) -> tuple[float, int | None]:
    """(seconds, graphs run) of run() through to its results on the device."""
    executions = backend.executions()
    start = time.perf_counter()
    result = run()
    backend.finish()
    seconds = time.perf_counter() - start
    del result  # kept alive until finish(): XLA runs only what live tensors need
    graphs = None if executions is None else backend.executions() - executions
    return seconds, graphs


def load_batches(path: Path, device: torch.device) -> list[dict[str, torch.Tensor]]:
    batches = torch.load(path, weights_only=True)
    return [{key: value.to(device) for key, value in batch.items()} for batch in batches]


def warm_up(step: Step, batch: dict[str, torch.Tensor], backend: Backend) -> dict[str, float]:
    """Every form once (the compilations), with their seconds."""
    calls = {f"step_{form}": functools.partial(step, batch, form) for form in FORMS}
    calls.update(
        {f"augment_only_{form}": functools.partial(step.augment_only, batch, form) for form in AUGMENT_FORMS}
    )
    return {name: timed(call, backend)[0] for name, call in calls.items()}


def alternate(
    run: Callable, forms: tuple[str, ...], batches: list, backend: Backend, count: int
) -> tuple[dict[str, list[float]], dict[str, list[int | None]]]:
    """count timed calls of run(batch, form) per form, the forms alternating, each round on the next batch.

    batches[0] warmed up; the others carry other draws, so a graph that
    depended on a draw would compile again here. Returns each call's
    seconds and graphs run, per form.
    """
    seconds: dict[str, list[float]] = {form: [] for form in forms}
    graphs: dict[str, list[int | None]] = {form: [] for form in forms}
    for index in range(count):
        batch = batches[(index + 1) % len(batches)]
        for form in forms:
            call_seconds, call_graphs = timed(functools.partial(run, batch, form), backend)
            seconds[form].append(call_seconds)
            graphs[form].append(call_graphs)
    return seconds, graphs


def time_forms(step: Step, batches: list, backend: Backend, steps: int, calls: int) -> dict:
    """Seconds and graphs run of each step and augmentation-alone call, compile counts, host fallbacks."""
    compilations = {"after_warmup": backend.compilations()}
    fallbacks = backend.fallbacks()
    step_seconds, step_graphs = alternate(step, FORMS, batches, backend, steps)
    compilations["after_steps"] = backend.compilations()
    augment_seconds, augment_graphs = alternate(step.augment_only, AUGMENT_FORMS, batches, backend, calls)
    compilations["after_augment_only"] = backend.compilations()
    after = backend.fallbacks()
    return {
        "seconds": {"step": step_seconds, "augment_only": augment_seconds},
        "graphs": {"step": step_graphs, "augment_only": augment_graphs},
        "compilations": compilations,
        "cpu_fallbacks": {name: count - fallbacks.get(name, 0) for name, count in after.items()},
    }


class OwnCpu:
    """Cores this process kept busy while timing (all its threads): how parallel the backend ran."""

    @staticmethod
    def _now() -> tuple[float, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), usage.ru_utime + usage.ru_stime

    def __enter__(self) -> OwnCpu:
        self.start = self._now()
        return self

    def __exit__(self, *exc_info) -> None:
        wall, busy = (now - then for now, then in zip(self._now(), self.start, strict=True))
        self.cores = busy / wall


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.augment.device", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True, help="resnet50 (torchvision) or a timm model name")
    parser.add_argument("--backend", choices=("xla", "eager"), default="xla")
    parser.add_argument("--batches", type=Path, required=True, help="torch.save'd list of batch dicts")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each form")
    parser.add_argument("--calls", type=int, default=10, help="timed augmentation-alone calls of each form")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of the eager backend (default 1: one core)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    backend = Backend(args.backend)
    if args.backend == "eager":
        # One thread: on 2 shared cores a second one mostly waits for the first
        # at every operation's barrier when anything else runs.
        torch.set_num_threads(args.threads)
    batches = load_batches(args.batches, backend.device)
    batch_size = len(batches[0]["label"])
    step = Step(make_model(args.model), backend.device, batch_size)
    # Module.to(device) leaves 0-dim buffers (BatchNorm's num_batches_tracked)
    # as pending computations, which the first step would take in as
    # constants and later ones as data: a second compilation of a ResNet's
    # step. Run now, they are data in every step.
    backend.finish()
    warmup = warm_up(step, batches[0], backend)
    with ForeignCpu() as foreign, OwnCpu() as own:
        result = time_forms(step, batches, backend, args.steps, args.calls)
    result.update(
        model=args.model,
        backend=args.backend,
        device=str(backend.device),
        batch_size=batch_size,
        image_shape=list(batches[0]["image"].shape[1:]),
        parameters=sum(p.numel() for p in step.model.parameters()),
        torch_threads=torch.get_num_threads(),
        warmup_seconds=warmup,
        foreign_cores=foreign.cores,
        own_cores=own.cores,
    )
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
