"""What each runtime (torch_xla, native PyTorch) and strategy allow, checked before spawning.

One line per refusal, naming the setting and what to use instead: strategies
that need torch_xla's collectives or GSPMD, what the simulated pod and the
XLA CPU device can run, and what FSDP2 (strategy=fsdp natively) cannot shard.
"""

from __future__ import annotations

from tpustream.config import (
    SPMD_STRATEGIES,
    Collectives,
    Decode,
    Device,
    OptimizerName,
    RuntimeKind,
    Strategy,
    TrainConfig,
)
from tpustream.errors import ConfigError

CPU_COLLECTIVES_BUG = "https://github.com/pytorch/xla/issues/9089"


def check_runtime_and_strategy(cfg: TrainConfig) -> None:
    """What the chosen runtime (XLA or native PyTorch) and strategy allow together."""
    if cfg.accelerator.runtime == RuntimeKind.native:
        check_native(cfg)
    else:
        _check_xla_accelerator(cfg)
        if cfg.data.decode == Decode.device and not cfg.data.synthetic:
            # An XLA device has no JPEG decoder; a TPU host decodes in its workers.
            raise ConfigError(
                "data.decode=device decodes JPEGs with nvJPEG on the native runtime (accelerator=cuda, "
                "or cpu_eager to try it on the CPU); on TPUs and XLA devices use data.decode=host"
            )
    if cfg.strategy in SPMD_STRATEGIES and cfg.debug.check_sync_every:
        raise ConfigError(
            f"debug.check_sync_every compares the replicas' copies of the model; strategy="
            f"{cfg.strategy.value} runs one program with one model"
        )
    if cfg.strategy == Strategy.fsdp:
        if cfg.accelerator.runtime != RuntimeKind.native:
            # torch_xla's first FSDP (one process per core) was tested on one replica only;
            # FSDPv2 (spmd_fsdp) is torch_xla's way to shard a model over a host's cores.
            raise ConfigError(
                "strategy=fsdp is PyTorch's FSDP2, on the native runtime (accelerator=cuda, cpu_eager); "
                "on TPUs and XLA devices shard parameters, gradients and optimizer state with "
                "strategy=spmd_fsdp (FSDPv2, one process per host: docs/large-models.md)"
            )
        if cfg.debug.check_sync_every:
            raise ConfigError(
                "debug.check_sync_every compares whole-model replicas; under strategy=fsdp every "
                "replica holds a different shard"
            )
        if cfg.accelerator.channels_last:
            raise ConfigError(
                "accelerator.channels_last=true: FSDP2 (strategy=fsdp on the native runtime) shards "
                "contiguous parameters only (torch 2.9); set it false, or use strategy=ddp"
            )
        if cfg.optim.name in (OptimizerName.lars, OptimizerName.lamb):
            raise ConfigError(
                f"optim={cfg.optim.name.value} takes a norm of every whole parameter; under strategy=fsdp "
                "on the native runtime (FSDP2) it would see shards: use strategy=ddp, or optim=sgd/adamw"
            )


def _check_xla_accelerator(cfg: TrainConfig) -> None:
    """What xmp.spawn, the simulated pod and the GSPMD mesh each allow."""
    acc = cfg.accelerator
    if acc.device == Device.CUDA:
        raise ConfigError(
            "accelerator.device=CUDA runs native PyTorch (accelerator=cuda): torch_xla's CUDA plugin "
            "is not installed with tpustream"
        )
    if acc.collectives == Collectives.nccl:
        raise ConfigError("accelerator.collectives=nccl is for accelerator=cuda (accelerator.runtime=native)")
    if acc.collectives == Collectives.gloo:
        if acc.device != Device.CPU:
            raise ConfigError(
                "accelerator.collectives=gloo is the simulated pod: it needs accelerator.device=CPU"
            )
        if acc.num_devices is None:
            raise ConfigError("the simulated pod (collectives=gloo) needs accelerator.num_devices >= 1")
        if cfg.strategy in SPMD_STRATEGIES:
            raise ConfigError(
                f"strategy={cfg.strategy.value} runs one process over a device mesh; the simulated pod "
                "(accelerator=cpu_pod) runs strategy=ddp only: use accelerator=cpu "
                "accelerator.num_devices=N for N virtual XLA CPU devices"
            )
    elif cfg.strategy in SPMD_STRATEGIES:
        if acc.device == Device.CPU and acc.num_devices is None:
            raise ConfigError(
                f"strategy={cfg.strategy.value} on CPU needs accelerator.num_devices >= 1 "
                "(the virtual XLA CPU devices of the mesh)"
            )
        if acc.device == Device.TPU and acc.num_devices is not None:
            raise ConfigError(
                f"accelerator.num_devices={acc.num_devices}: strategy={cfg.strategy.value} drives every "
                "device of the host (null); limit devices with TPU_VISIBLE_CHIPS instead"
            )
    elif acc.device == Device.CPU and acc.num_devices not in (None, 1):
        raise ConfigError(
            f"accelerator.num_devices={acc.num_devices} on CPU with strategy={cfg.strategy.value}: XLA:CPU "
            f"collectives deadlock across processes ({CPU_COLLECTIVES_BUG}); use 1, strategy=spmd or "
            "spmd_fsdp (N devices in one process), or accelerator=cpu_pod to simulate replicas over gloo"
        )
    if acc.device == Device.TPU and acc.num_devices not in (None, 1):
        raise ConfigError(
            f"accelerator.num_devices={acc.num_devices}: xmp.spawn runs either every device "
            "of the host (null) or one (1); limit devices with TPU_VISIBLE_CHIPS instead"
        )


def check_native(cfg: TrainConfig) -> None:
    """accelerator.runtime=native (cuda, cpu_eager): PyTorch's own devices and torch.distributed."""
    acc = cfg.accelerator
    if acc.device == Device.TPU:
        raise ConfigError("TPUs run through torch_xla: accelerator.runtime=xla (accelerator=tpu)")
    wanted = Collectives.nccl if acc.device == Device.CUDA else Collectives.gloo
    if acc.collectives != wanted:
        raise ConfigError(
            f"accelerator.collectives={acc.collectives.value}: native PyTorch on {acc.device.value} "
            f"reduces over {wanted.value}"
        )
    if cfg.strategy in SPMD_STRATEGIES:
        raise ConfigError(
            f"strategy={cfg.strategy.value} is torch_xla's GSPMD (accelerator.runtime=xla); "
            "accelerator.runtime=native runs strategy=ddp or fsdp (PyTorch's FSDP2)"
        )
    debug = cfg.debug
    for name, on in (
        ("debug.metrics", debug.metrics),
        ("debug.profiler_port", debug.profiler_port),
    ):
        # debug.profile_steps and profile_eval_epoch trace with torch.profiler here.
        if on:
            raise ConfigError(
                f"{name} reads torch_xla's metrics and profiler server; not with accelerator.runtime=native"
            )
