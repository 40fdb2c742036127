"""What one device holds: each strategy's parameters and optimizer state for wrn_seed, and what fits
of the ViT family on a mesh.

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

ViTs (timm's ViT-B/16, ViT-L/16, ViT-H/14 and the ~1B-parameter ViT-g/14, 1000
classes, at 224 and 480 px), per chip on meshes of --vit-devices chips, as
(fsdp=N) and (fsdp=N/2, tensor=2):

    state        float32 parameters, gradients and AdamW's two moments as the
                 trainer splits them (training.sharding_rules with the
                 built-in rules; a split dimension padded up), computed from
                 the shapes; for ViT-B/16 and ViT-L/16 on 8 devices also read
                 from the shards the trainer's placement leaves on the first
                 device of an 8-device XLA CPU mesh, which must be the same.
    activations  what autograd keeps from the forward pass for one sample:
                 its saved tensors other than parameters, float32, counted by
                 running the model on the meta device (shapes only, so the
                 1B-parameter model costs nothing); with model.remat, every
                 block's input, what the rest of the model keeps, and one
                 block's own (the one being recomputed). Attention counts as
                 its math form (the attention probabilities kept), as XLA
                 lowers it; precision=bf16 keeps many of them in half the bytes.
    plan         per chip (v5e 16 GiB, v5p 95 GiB), chip count, size and remat,
                 on (fsdp=N): each ViT's largest batch per chip whose
                 activations fit beside its state, and the largest of the four
                 that fits --vit-batch samples a chip. Not counted: the FSDP
                 unit gathered while it runs, the step's temporaries and what
                 XLA's fusion keeps or drops.
    compiled     ViT-B/16 at 224 and 480, 2 samples a device, on (fsdp=8) and
                 (fsdp=4, tensor=2), remat off and on: one bf16 AdamW step as
                 the trainer places it, compiled (not run) on an 8-device XLA
                 CPU mesh, and the bytes XLA's buffer assignment gives one
                 device's program (Total bytes used). XLA:CPU schedules for
                 speed, not memory: it gathers every FSDP unit's weights at
                 once and runs the recomputation early, so this is what the
                 step needs at most, not what a TPU's memory-aware schedule
                 peaks at (docs/large-models.md, "What fits").

Not counted in the wrn_seed rows, for any strategy: activations (they depend on the batch size),
gradients (parameter-sized, sharded like the parameters by
spmd_fsdp), BatchNorm's running statistics (50 KB, whole on every device),
AdamW's step counters (host scalars), and the transient whole copy of each
FSDP unit while it runs. MB = 10^6 bytes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from bench.harness import REPO
from tpustream.config import MESH_AXES, TrainConfig
from tpustream.runtime.mesh import MeshShape

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
    from tpustream.training.sharding_rules import rules_of
    from tpustream.training.spmd import shard_model, shard_optimizer_state

    cfg = configs["sgd"]
    model = make_model(cfg).to(runtime.device)
    wrapped, by_param = shard_model(model, runtime, cfg.fsdp_wrap_min_params, rules_of(cfg.mesh.rules))
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


# ---------------------------------------------------------------- ViTs: what fits

# (label, timm name): the ViT family's big members, timm's shapes; ViT-g/14 is big_vision's
# "giant" (width 1408, depth 40, MLP 6144: about 1.0B parameters).
VITS = (
    ("ViT-B/16", "vit_base_patch16_224"),
    ("ViT-L/16", "vit_large_patch16_224"),
    ("ViT-H/14", "vit_huge_patch14_224"),
    ("ViT-g/14", "vit_giant_patch14_224"),
)
VIT_SIZES = (224, 480)
VIT_CLASSES = 1000
GIB = 2**30
# Bytes of float32 state per parameter element: the weight, its gradient, AdamW's two moments.
ADAMW_COPIES = 4


def vit_meta(name: str, size: int) -> nn.Module:
    """timm's model for size-pixel images, on the meta device (shapes only, nothing allocated).

    A /14 model at 480 px sees 34 x 34 patches (its last 4 pixels unused), as timm builds it.
    """
    import timm

    with torch.device("meta"):
        return timm.create_model(name, img_size=size, num_classes=VIT_CLASSES)


def state_bytes_per_device(model: nn.Module, shape: MeshShape) -> dict[str, int]:
    """Parameters, gradients and AdamW state on one device of this mesh, float32, as the trainer
    splits them (training.sharding_rules; a split dimension padded to a multiple of its axes)."""
    from tpustream.training.sharding_rules import BUILTIN_RULES, parameter_specs

    specs = parameter_specs(model, shape.tensor, BUILTIN_RULES)
    sizes = dict(zip(MESH_AXES, shape.sizes, strict=True))
    elements = 0
    for name, param in model.named_parameters():
        dims = list(param.shape)
        for dim, entry in enumerate(specs[name]):
            for axis in entry if isinstance(entry, tuple) else (entry,):
                if axis is not None:
                    dims[dim] = -(-dims[dim] // sizes[axis])
        elements += math.prod(dims)
    return {"param_bytes": 4 * elements, "grad_bytes": 4 * elements, "adamw_state_bytes": 8 * elements}


def saved_activation_bytes(model: nn.Module, size: int) -> dict[str, int]:
    """What autograd keeps from the forward pass for one sample, by its saved tensors (parameters
    excluded), counted on the meta device, without and with model.remat.

    With remat a block keeps only its input; in the backward pass one block at a time is
    recomputed, so the most is every block's input, what the rest of the model keeps, and the
    largest block's own saved tensors.
    """
    from tpustream.models.remat import model_blocks

    parameters = {p.untyped_storage()._cdata for p in model.parameters()}
    blocks = model_blocks(model)
    saved: dict[int, tuple[int, int]] = {}  # storage -> (bytes, block index or -1)
    current = [-1]
    block_inputs = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in parameters:
            saved.setdefault(storage._cdata, (storage.nbytes(), current[0]))
        return tensor

    def enter(index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            nonlocal block_inputs
            current[0] = index
            block_inputs += args[0].numel() * args[0].element_size()

        return hook

    def leave(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        current[0] = -1

    handles = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(leave) for b in blocks]
    try:
        images = torch.empty(1, 3, size, size, device="meta")
        labels = torch.zeros(1, dtype=torch.long, device="meta")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            torch.nn.functional.cross_entropy(model(images), labels)
    finally:
        for handle in handles:
            handle.remove()
    per_block = [0] * len(blocks)
    outside = 0
    for nbytes_, block in saved.values():
        if block < 0:
            outside += nbytes_
        else:
            per_block[block] += nbytes_
    return {
        "activation_bytes": outside + sum(per_block),
        "remat_activation_bytes": outside + block_inputs + max(per_block),
    }


def vit_rows(device_counts: list[int], batch: int) -> list[dict]:
    """For each ViT and size: per device state on (fsdp=N) and (fsdp=N/2, tensor=2), and activations."""
    rows = []
    for label, name in VITS:
        for size in VIT_SIZES:
            start = time.perf_counter()
            model = vit_meta(name, size)
            activations = saved_activation_bytes(model, size)
            parameters = sum(p.numel() for p in model.parameters())
            for devices in device_counts:
                for tensor in (1, 2):
                    shape = MeshShape(1, 1, devices // tensor, tensor)
                    row = {"model": label, "timm": name, "image_size": size, "parameters": parameters}
                    row |= {"mesh": shape.describe(), "devices": devices, "batch_per_device": batch}
                    row |= state_bytes_per_device(model, shape) | activations
                    rows.append(row)
            print(f"{label} at {size}: counted in {time.perf_counter() - start:.1f}s", file=sys.stderr)
    return rows


def measure_vit_state_in_this_process(name: str, tensor: int) -> None:
    """The child: a ViT's parameters and AdamW state as the trainer places them on this mesh, read
    from the shards the first device holds (the parent sets CPU_NUM_DEVICES)."""
    import timm

    from tpustream.config import MeshConfig, Strategy
    from tpustream.runtime import SpmdRuntime
    from tpustream.runtime.spmd import device_bytes
    from tpustream.training.optimizer import prime_optimizer_state
    from tpustream.training.sharding_rules import BUILTIN_RULES
    from tpustream.training.spmd import shard_model, shard_optimizer_state

    runtime = SpmdRuntime(MeshConfig(tensor=tensor), Strategy.spmd_fsdp)
    model = timm.create_model(name, num_classes=VIT_CLASSES).to(runtime.device)
    wrapped, by_param = shard_model(model, runtime, 1_000_000, BUILTIN_RULES)
    optimizer = torch.optim.AdamW(wrapped.parameters())
    prime_optimizer_state(optimizer)
    shard_optimizer_state(optimizer, runtime, by_param)
    print(
        json.dumps(
            {
                "mesh": runtime.mesh_shape.describe(),
                "param_bytes": device_bytes(list(wrapped.parameters())),
                "adamw_state_bytes": device_bytes(state_tensors(optimizer, "xla")),
            }
        )
    )


def measured_vit_state(name: str, devices: int, tensor: int) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices)}
    command = [sys.executable, "-m", "bench.spmd_memory", "--measure-vit", name, str(tensor)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(f"measuring {name} (tensor={tensor}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_vit_state(rows: list[dict], devices: int) -> list[dict]:
    """The computed state of ViT-B/16 and ViT-L/16 against the shards measured on a devices-mesh."""
    checks = []
    for row in rows:
        if (
            row["devices"] != devices
            or row["image_size"] != 224
            or row["model"] not in ("ViT-B/16", "ViT-L/16")
        ):
            continue
        tensor = 2 if "tensor=2" in row["mesh"] else 1
        measured = measured_vit_state(row["timm"], devices, tensor)
        same = all(measured[key] == row[key] for key in ("param_bytes", "adamw_state_bytes"))
        checks.append(
            {"model": row["model"], "mesh": row["mesh"], "computed_equals_measured": same, **measured}
        )
        print(
            f"{row['model']} {row['mesh']}: measured shards equal the computed bytes: {same}", file=sys.stderr
        )
    return checks


def largest_batch(row: dict, memory: float, remat: bool) -> int:
    """The most samples per chip whose activations fit beside the state (0: the state alone does not)."""
    activations = row["remat_activation_bytes" if remat else "activation_bytes"]
    free = memory - (row["param_bytes"] + row["grad_bytes"] + row["adamw_state_bytes"])
    return max(0, int(free // activations))


# The compiled step, measured: ViT-B/16 at both sizes, on (fsdp=8) and (fsdp=4, tensor=2), remat
# off and on, a small batch per device (each run compiles the whole step: 20-60 s here).
COMPILED_MODEL = ("ViT-B/16", "vit_base_patch16_224")
COMPILED_BATCH = 2


def measure_compiled_step_in_this_process(name: str, size: int, tensor: int, remat: bool, batch: int) -> None:
    """The child: one bf16 AdamW step of a ViT placed as the trainer places it, compiled on this mesh
    (the parent sets CPU_NUM_DEVICES and XLA_FLAGS' dump folder); the program is compiled, not run."""
    import timm
    import torch_xla

    from tpustream.config import MeshConfig, Strategy
    from tpustream.models.remat import rematerialize
    from tpustream.runtime import SpmdRuntime
    from tpustream.training.optimizer import prime_optimizer_state
    from tpustream.training.sharding_rules import BUILTIN_RULES
    from tpustream.training.spmd import shard_model, shard_optimizer_state

    runtime = SpmdRuntime(MeshConfig(tensor=tensor), Strategy.spmd_fsdp)
    model = timm.create_model(name, img_size=size, num_classes=VIT_CLASSES)
    if remat:
        rematerialize(model, name, xla=True)
    wrapped, by_param = shard_model(model.to(runtime.device), runtime, 1_000_000, BUILTIN_RULES)
    optimizer = torch.optim.AdamW(wrapped.parameters())
    prime_optimizer_state(optimizer)
    shard_optimizer_state(optimizer, runtime, by_param)
    torch_xla.sync(wait=True)
    samples = batch * runtime.num_devices
    images = torch.randn(samples, CHANNELS, size, size)
    placed = runtime.place_batch({"image": images, "label": torch.randint(0, VIT_CLASSES, (samples,))})
    runtime.constrain_batch(placed)
    with torch.autocast("xla", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(wrapped(placed["image"]), placed["label"])
    loss.backward()
    optimizer.step()
    outputs = [*wrapped.parameters(), *state_tensors(optimizer, "xla"), loss]
    torch_xla._XLAC._xla_warm_up_cache(outputs, [])  # compile the step's graph without running it
    print(json.dumps({"mesh": runtime.mesh_shape.describe()}))


def measured_compiled_step(name: str, size: int, devices: int, tensor: int, remat: bool, batch: int) -> dict:
    """XLA's buffer assignment of the compiled step on one device of a devices-mesh (XLA:CPU)."""
    from bench.remat_memory import compiled_step

    with tempfile.TemporaryDirectory(prefix="tpustream-compiled-step-") as dump:
        # Optimization level 1: LLVM's, not XLA's HLO passes, so the same buffers, compiled sooner.
        flags = f"--xla_dump_to={dump} --xla_backend_optimization_level=1"
        env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), "XLA_FLAGS": flags}
        arguments = [name, str(size), str(tensor), str(int(remat)), str(batch)]
        command = [sys.executable, "-m", "bench.spmd_memory", "--measure-compiled", *arguments]
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {' '.join(arguments)} failed:\n{done.stderr[-3000:]}")
        mesh = json.loads(done.stdout.strip().splitlines()[-1])["mesh"]
        return {"mesh": mesh, **compiled_step(Path(dump))}


def compiled_rows(vits: list[dict], devices: int) -> list[dict]:
    """ViT-B/16's compiled step beside the computed state and activations of the same batch."""
    label, name = COMPILED_MODEL
    rows = []
    for size in VIT_SIZES:
        for tensor in (1, 2):
            computed = next(
                r
                for r in vits
                if r["model"] == label
                and r["image_size"] == size
                and r["devices"] == devices
                and r["mesh"] == MeshShape(1, 1, devices // tensor, tensor).describe()
            )
            for remat in (False, True):
                begun = time.perf_counter()
                measured = measured_compiled_step(name, size, devices, tensor, remat, COMPILED_BATCH)
                activations = computed["remat_activation_bytes" if remat else "activation_bytes"]
                state = computed["param_bytes"] + computed["grad_bytes"] + computed["adamw_state_bytes"]
                row = {"model": label, "image_size": size, "devices": devices, "remat": remat}
                row |= {"batch_per_device": COMPILED_BATCH, "computed_state_bytes": state}
                row |= {"computed_activation_bytes": activations * COMPILED_BATCH, **measured}
                rows.append(row)
                print(
                    f"{label} at {size} {measured['mesh']} remat={remat}: compiled step "
                    f"{measured['peak_bytes'] / GIB:.2f} GiB a device ({time.perf_counter() - begun:.0f}s)",
                    file=sys.stderr,
                )
    return rows


# The chips the plan is made for: v5e's 16 GiB and v5p's 95 GiB of HBM a chip.
CHIPS = (("v5e", 16 * GIB), ("v5p", 95 * GIB))


def fitting_plan(rows: list[dict], batch: int) -> dict:
    """On (fsdp=N): each ViT's largest batch per chip, and the largest ViT that fits at `batch`."""
    order = [label for label, _ in VITS]
    batches, largest = [], []
    for row in rows:
        if "tensor=2" in row["mesh"]:
            continue
        for chip, memory in CHIPS:
            for remat in (False, True):
                most = largest_batch(row, memory, remat)
                batches.append(
                    {"model": row["model"], "image_size": row["image_size"], "devices": row["devices"]}
                    | {"chip": chip, "remat": remat, "largest_batch": most}
                )
    for chip, _ in CHIPS:
        for devices in sorted({row["devices"] for row in rows}):
            for size in VIT_SIZES:
                for remat in (False, True):
                    fit = [
                        entry["model"]
                        for entry in batches
                        if (entry["chip"], entry["devices"], entry["image_size"], entry["remat"])
                        == (chip, devices, size, remat)
                        and entry["largest_batch"] >= batch
                    ]
                    best = max(fit, key=order.index, default=None)
                    largest.append(
                        {
                            "chip": chip,
                            "devices": devices,
                            "image_size": size,
                            "remat": remat,
                            "largest": best,
                        }
                    )
    return {"largest_batch": batches, "largest_model": largest}


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


def gib(value: float) -> str:
    """Bytes as GiB with two decimals, as the ViT tables show them."""
    return f"{value / GIB:,.2f}"


def vit_table(rows: list[dict]) -> str:
    lines = [
        "| model | params | px | chips | mesh | params+grads+AdamW GiB/chip | activations GiB/sample "
        "| with remat GiB/sample |",
        "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        state = row["param_bytes"] + row["grad_bytes"] + row["adamw_state_bytes"]
        lines.append(
            f"| {row['model']} | {row['parameters'] / 1e6:,.0f}M | {row['image_size']} | {row['devices']} "
            f"| {row['mesh']} | {gib(state)} | {gib(row['activation_bytes'])} "
            f"| {gib(row['remat_activation_bytes'])} |"
        )
    return "\n".join(lines)


def compiled_table(rows: list[dict]) -> str:
    lines = [
        "| model | px | mesh | remat | batch/device | compiled step GiB/device (XLA:CPU) | matmuls "
        "| computed state GiB/device | computed activations GiB/device |",
        "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['image_size']} | {row['mesh']} | {row['remat']} "
            f"| {row['batch_per_device']} | {gib(row['peak_bytes'])} | {row['matmuls']} "
            f"| {gib(row['computed_state_bytes'])} | {gib(row['computed_activation_bytes'])} |"
        )
    return "\n".join(lines)


def plan_table(plan: dict, devices: list[int]) -> str:
    """Rows: model, size, remat; columns: the largest batch per chip on each chip type and count."""
    columns = [(chip, n) for chip, _ in CHIPS for n in devices]
    header = " | ".join(f"{chip} x{n}" for chip, n in columns)
    lines = [f"| model | px | remat | {header} |", "| --- | ---: | --- |" + " ---: |" * len(columns)]
    by_key = {
        (e["model"], e["image_size"], e["remat"], e["chip"], e["devices"]): e["largest_batch"]
        for e in plan["largest_batch"]
    }
    for label, _ in VITS:
        for size in VIT_SIZES:
            for remat in (False, True):
                cells = " | ".join(str(by_key[label, size, remat, chip, n]) for chip, n in columns)
                lines.append(f"| {label} | {size} | {remat} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.spmd_memory", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices", type=int, nargs="+", default=[8, 32], help="mesh sizes N (default: 8 32)"
    )
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "spmd_memory.json")
    parser.add_argument(
        "--vit-devices",
        type=int,
        nargs="+",
        default=[8, 64, 256],
        help="chips for the ViT plan (default: 8 64 256)",
    )
    parser.add_argument(
        "--vit-batch", type=int, default=8, help="per-device batch of the ViT plan (default 8)"
    )
    parser.add_argument("--measure", choices=sorted(MEASURED), help=argparse.SUPPRESS)  # the child's entry
    parser.add_argument("--measure-vit", nargs=2, metavar=("NAME", "TENSOR"), help=argparse.SUPPRESS)
    parser.add_argument("--measure-compiled", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_compiled:
        name, size, tensor, remat, batch = args.measure_compiled
        measure_compiled_step_in_this_process(name, int(size), int(tensor), remat == "1", int(batch))
        return
    if args.measure:
        measure_in_this_process(args.measure)
        return
    if args.measure_vit:
        measure_vit_state_in_this_process(args.measure_vit[0], int(args.measure_vit[1]))
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

    vit_start = time.perf_counter()
    vits = vit_rows(args.vit_devices, args.vit_batch)
    checks = check_vit_state(vits, 8)
    compiled = compiled_rows(vits, 8)
    plan = fitting_plan(vits, args.vit_batch)
    print(vit_table(vits))
    print(compiled_table(compiled))
    print(plan_table(plan, args.vit_devices))
    vit_seconds = time.perf_counter() - vit_start

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
        "vit": {
            "batch_per_device": args.vit_batch,
            "activations": "autograd's saved tensors for one sample, float32, counted on the meta device",
            "state": "float32 parameters, gradients and AdamW moments as training.sharding_rules splits them",
            "rows": vits,
            "checked_on_8_devices": checks,
            "compiled_step_on_8_devices": {
                "how": "XLA:CPU's buffer assignment of the compiled step (Total bytes used), one device",
                "rows": compiled,
            },
            "plan": plan,
            "seconds": round(vit_seconds, 1),
        },
        "torch": torch.__version__,
        "torch_xla": torch_xla.__version__,
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output.relative_to(REPO) if args.output.is_relative_to(REPO) else args.output}")


if __name__ == "__main__":
    main()
