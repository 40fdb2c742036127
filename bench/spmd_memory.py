"""Bytes of parameters and optimizer state that each strategy leaves on one device, for wrn_seed.

Reproduce (from the repository root; the devices are virtual XLA CPU devices,
no accelerator needed):

    .venv/bin/python -m bench.spmd_memory                  # N = 8 and 32 -> bench/results/spmd_memory.json
    .venv/bin/python -m bench.spmd_memory --devices 4 8    # other mesh sizes

Two runs here took 123 s and 253 s (2 cores shared with other work, load
average 6-7), using up to 9.2 GB of memory. Most of the time is spmd on 32
devices (55 s and 144 s), where every read copies all 32 replicas of a tensor
to the host; spmd_fsdp on 32 devices took 4 s and 13 s. The bytes are the same
in every run.

The model is the full-size wrn_seed (conf/model/wrn_seed.yaml: k=7, n=4, 7x7
convolutions; 10 classes and 32x32 RGB input as CIFAR-10: 103.4M parameters),
float32. The optimizers are build_optimizer's, from the config train.py
composes with optim=sgd (Nesterov momentum: one buffer per parameter) and
optim=adamw (two moments per parameter), with their state created by
prime_optimizer_state, as training does before its first step.

Measured (one subprocess per strategy and N, with PJRT_DEVICE=CPU
CPU_NUM_DEVICES=N: one process, an N-device mesh), read with
runtime.spmd.device_bytes from the shards XLA really holds on the first
device, padding included:

    spmd_fsdp  SpmdRuntime on the fsdp preset; the model moved to the device and wrapped by
               training.spmd.shard_model with the config's fsdp_wrap_min_params;
               the optimizer state placed by training.spmd.shard_optimizer_state
               (what SpmdFsdpTrainer.place_optimizer_state runs).
    spmd       SpmdRuntime on the data preset; every parameter and state tensor replicated
               with runtime.replicate, as SpmdTrainer does. Replicated on 32
               virtual CPU devices, the model and its AdamW state would take
               32 x 1.24 GB = 40 GB of host memory at once, so this one is
               measured one parameter-holding module at a time (a copy of the
               module on the device, its optimizer built and primed, measured,
               dropped); per-device bytes add up over tensors, so the sum is
               the whole model's.

Computed (no XLA device), from the parameter shapes:

    ddp        every core holds the whole model and the whole optimizer state:
               the sum of numel x element_size of the parameters and of the
               state tensors build_optimizer + prime_optimizer_state create.

Not counted, for any strategy: activations (they depend on the batch size),
gradients (parameter-sized, sharded like the parameters by
spmd_fsdp), BatchNorm's running statistics (50 KB, whole on every device),
AdamW's step counters (host scalars), and the transient whole copy of each
FSDP unit while it runs. MB = 10^6 bytes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from bench.harness import REPO
from tpustream.config import TrainConfig

if TYPE_CHECKING:
    from tpustream.runtime import SpmdRuntime

OPTIMIZERS = ("sgd", "adamw")
# CIFAR-10's; the seed's own study used CIFAR-100, whose head has 40,410 more
# parameters (0.04%).
NUM_CLASSES, IMAGE_SIZE, CHANNELS = 10, 32, 3
MEASURED = ("spmd", "spmd_fsdp")  # the strategies measured on a mesh (their presets)


def compose_configs() -> dict[str, TrainConfig]:
    """The TrainConfig train.py composes for model=wrn_seed with each optimizer, keyed by optim name."""
    from bench.harness import compose_train_config

    return {name: compose_train_config([f"optim={name}", "model=wrn_seed"]) for name in OPTIMIZERS}


def make_model(cfg: TrainConfig) -> nn.Module:
    from tpustream.models import create_model

    return create_model(
        cfg.model.name, num_classes=NUM_CLASSES, image_size=IMAGE_SIZE, channels=CHANNELS, **cfg.model.options
    )


def state_tensors(optimizer: torch.optim.Optimizer, device_type: str) -> list[torch.Tensor]:
    """The optimizer's state tensors on devices of this type (AdamW's step counters stay on the host)."""
    return [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.device.type == device_type
    ]


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# ---------------------------------------------------------------- computed rows


def computed_rows(configs: dict[str, TrainConfig], device_counts: list[int]) -> list[dict]:
    """ddp per device, from the shapes of the parameters and of the primed state."""
    from tpustream.training.optimizer import build_optimizer, prime_optimizer_state

    # Shapes only: the meta device allocates nothing.
    with torch.device("meta"):
        model = make_model(configs["sgd"])
        states = {}
        for name, cfg in configs.items():
            optimizer = build_optimizer(cfg, model)
            prime_optimizer_state(optimizer)
            # Per parameter: its state tensors of its own shape (momentum, moments).
            states[name] = {
                param: [v for v in state.values() if isinstance(v, torch.Tensor) and v.shape == param.shape]
                for param, state in optimizer.state.items()
            }
    params = list(model.parameters())
    rows = []
    for devices in device_counts:
        rows.append(
            {
                "strategy": "ddp",
                "devices": devices,
                "how": "computed",
                "param_bytes": nbytes(params),
                **{
                    f"{name}_state_bytes": sum(nbytes(v) for v in states[name].values())
                    for name in OPTIMIZERS
                },
            }
        )
    return rows


# ---------------------------------------------------------------- measured rows


def measure_spmd_fsdp(runtime: SpmdRuntime, configs: dict[str, TrainConfig]) -> dict:
    from tpustream.runtime.spmd import device_bytes
    from tpustream.training.optimizer import build_optimizer, prime_optimizer_state
    from tpustream.training.sharding_rules import parameter_specs, rules_of
    from tpustream.training.spmd import shard_model, shard_optimizer_state

    cfg = configs["sgd"]
    model = make_model(cfg).to(runtime.device)
    specs = parameter_specs(model, runtime.mesh_shape.tensor, rules_of(cfg.mesh.rules))
    by_param = {param: specs[name] for name, param in model.named_parameters()}
    wrapped = shard_model(model, runtime, cfg.fsdp_wrap_min_params, specs)
    result = {"param_bytes": device_bytes(list(wrapped.parameters()))}
    for name, cfg in configs.items():
        optimizer = build_optimizer(cfg, wrapped)
        prime_optimizer_state(optimizer)
        shard_optimizer_state(optimizer, runtime, by_param)
        result[f"{name}_state_bytes"] = device_bytes(state_tensors(optimizer, "xla"))
        del optimizer
    return result


def measure_spmd(runtime: SpmdRuntime, configs: dict[str, TrainConfig]) -> dict:
    from tpustream.runtime.spmd import device_bytes
    from tpustream.training.optimizer import build_optimizer, prime_optimizer_state

    model = make_model(configs["sgd"])
    result = dict.fromkeys(["param_bytes", *(f"{name}_state_bytes" for name in OPTIMIZERS)], 0)
    # One module at a time (see the module docstring); every parameter belongs
    # to exactly one module's own (non-recursive) parameters.
    for module in model.modules():
        if not list(module.parameters(recurse=False)):
            continue
        piece = copy.deepcopy(module).to(runtime.device)
        params = list(piece.parameters(recurse=False))
        runtime.replicate(params)
        # One tensor per read: device_bytes copies every device's shard to the host.
        result["param_bytes"] += sum(device_bytes([p]) for p in params)
        for name, cfg in configs.items():
            optimizer = build_optimizer(cfg, piece)
            prime_optimizer_state(optimizer)
            tensors = state_tensors(optimizer, "xla")
            runtime.replicate(tensors)
            result[f"{name}_state_bytes"] += sum(device_bytes([t]) for t in tensors)
            del optimizer, tensors
        del piece, params
    return result


def measure_in_this_process(strategy: str) -> None:
    """The child: one measured row as a JSON line on stdout (the parent sets PJRT_DEVICE, CPU_NUM_DEVICES)."""
    # Before any XLA tensor exists (use_spmd).
    from tpustream.config import MeshConfig, Strategy
    from tpustream.runtime import SpmdRuntime

    runtime = SpmdRuntime(MeshConfig(), Strategy(strategy))
    configs = compose_configs()
    start = time.perf_counter()
    result = (
        measure_spmd_fsdp(runtime, configs) if strategy == "spmd_fsdp" else measure_spmd(runtime, configs)
    )
    result["mesh_devices"] = runtime.num_devices
    result["measure_seconds"] = round(time.perf_counter() - start, 1)
    result["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
    print(json.dumps(result))


def measured_row(strategy: str, devices: int) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}
    command = [sys.executable, "-m", "bench.spmd_memory", "--measure", strategy]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(
            f"measuring {strategy} on {devices} virtual CPU devices failed (exit {done.returncode}):\n"
            f"{done.stderr[-3000:]}"
        )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result.pop("mesh_devices") != devices:
        raise RuntimeError(f"asked for {devices} XLA CPU devices, the mesh had another count: {result}")
    result["process_seconds"] = round(time.perf_counter() - start, 1)
    print(
        f"{strategy} on {devices} devices: measured in {result['measure_seconds']}s "
        f"({result['process_seconds']}s with start-up), peak RSS {result['peak_rss_gb']} GB",
        file=sys.stderr,
    )
    return {"strategy": strategy, "devices": devices, "how": "measured", **result}


# ---------------------------------------------------------------- report


def markdown_table(rows: list[dict]) -> str:
    def mb(value: int) -> str:
        return f"{value / 1e6:,.1f}"

    lines = [
        "| strategy | N | how | params MB/device | SGD state MB/device | AdamW state MB/device "
        "| total with SGD MB/device |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['strategy']} | {row['devices']} | {row['how']} | {mb(row['param_bytes'])} "
            f"| {mb(row['sgd_state_bytes'])} | {mb(row['adamw_state_bytes'])} "
            f"| {mb(row['param_bytes'] + row['sgd_state_bytes'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.spmd_memory", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices", type=int, nargs="+", default=[8, 32], help="mesh sizes N (default: 8 32)"
    )
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "spmd_memory.json")
    parser.add_argument("--measure", choices=sorted(MEASURED), help=argparse.SUPPRESS)  # the child's entry
    args = parser.parse_args()
    if args.measure:
        measure_in_this_process(args.measure)
        return

    # The children set their own; without a device type torch_xla warns that it picks CPU.
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    start = time.perf_counter()
    configs = compose_configs()
    computed = computed_rows(configs, args.devices)
    rows = []
    for devices in args.devices:
        computed_here = {row["strategy"]: row for row in computed if row["devices"] == devices}
        # Whole-model strategies first, then the sharded ones.
        rows += [computed_here["ddp"], measured_row("spmd", devices)]
        rows += [measured_row("spmd_fsdp", devices)]
    seconds = time.perf_counter() - start

    with torch.device("meta"):
        parameters = sum(p.numel() for p in make_model(configs["sgd"]).parameters())
    print(markdown_table(rows))
    by_key = {(row["strategy"], row["devices"]): row for row in rows}
    for devices in args.devices:
        spmd, ddp = by_key["spmd", devices], by_key["ddp", devices]
        same = all(spmd[key] == ddp[key] for key in ("param_bytes", "sgd_state_bytes", "adamw_state_bytes"))
        print(f"N={devices}: spmd (measured) holds the whole model and state on a device, as ddp: {same}")
    print(f"{parameters:,} parameters; took {seconds:.0f}s")

    import torch_xla

    args.output.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": shlex.join(["python", "-m", "bench.spmd_memory", *sys.argv[1:]]),
        "model": {
            "name": "wrn_seed",
            "options": dict(configs["sgd"].model.options),
            "num_classes": NUM_CLASSES,
            "image_size": IMAGE_SIZE,
            "parameters": parameters,
        },
        "fsdp_wrap_min_params": configs["sgd"].fsdp_wrap_min_params,
        "megabyte": 10**6,
        "rows": rows,
        "seconds": round(seconds, 1),
        "torch": torch.__version__,
        "torch_xla": torch_xla.__version__,
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output.relative_to(REPO) if args.output.is_relative_to(REPO) else args.output}")


if __name__ == "__main__":
    main()
