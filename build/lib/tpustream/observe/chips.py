"""TPU chips' and NVIDIA GPUs' peak bf16 FLOP/s, and model FLOPs utilisation (MFU) against them.

MFU = the model's training FLOPs per second (FLOPs per sample x samples per
second) over the peak of the chips that ran them: what the model needs, not
what the compiled program happened to execute (rematerialisation and padding
do not count), so it compares runs, models and chips honestly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Chip:
    name: str
    peak_flops: float  # bf16 FLOP/s per chip
    devices_per_chip: int  # XLA devices (replicas under ddp) per chip
    source: str


# Peak bf16 compute per chip from Google Cloud's system-architecture pages. v2 and v3
# chips are two TensorCores, each its own XLA device; v4 and v5p join their two into
# one device (megacore); v5e and v6e chips have one.
CHIPS: dict[str, Chip] = {
    chip.name: chip
    for chip in (
        Chip("v2", 45e12, 2, "https://cloud.google.com/tpu/docs/v2"),
        Chip("v3", 123e12, 2, "https://cloud.google.com/tpu/docs/v3"),
        Chip("v4", 275e12, 1, "https://cloud.google.com/tpu/docs/v4"),
        Chip("v5e", 197e12, 1, "https://cloud.google.com/tpu/docs/v5e"),
        Chip("v5p", 459e12, 1, "https://cloud.google.com/tpu/docs/v5p"),
        Chip("v6e", 918e12, 1, "https://cloud.google.com/tpu/docs/v6e"),
    )
}
# Accelerator type prefixes (TPU_ACCELERATOR_TYPE, e.g. v5litepod-16) that name a chip otherwise.
ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e"}

# NVIDIA's dense bf16 tensor-core peaks (their data sheets quote twice these, "with
# sparsity"), matched against torch.cuda.get_device_name(), most specific first.
GPUS: list[tuple[str, Chip]] = [
    ("H200", Chip("H200", 989e12, 1, "https://www.nvidia.com/en-us/data-center/h200/")),
    ("H100 PCIe", Chip("H100 PCIe", 756e12, 1, "https://www.nvidia.com/en-us/data-center/h100/")),
    ("H100 80GB HBM3", Chip("H100 SXM", 989e12, 1, "https://www.nvidia.com/en-us/data-center/h100/")),
    ("H100 SXM", Chip("H100 SXM", 989e12, 1, "https://www.nvidia.com/en-us/data-center/h100/")),
    ("A100", Chip("A100", 312e12, 1, "https://www.nvidia.com/en-us/data-center/a100/")),
    ("L4", Chip("L4", 121e12, 1, "https://www.nvidia.com/en-us/data-center/l4/")),
]


def chip_from_accelerator_type(accelerator_type: str | None) -> Chip | None:
    """The chip of an accelerator type ("v4-32", "v5litepod-8", "v6e-8") or GPU name, None if unknown.

    GPU names are CUDA's ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"); a
    GPU not in GPUS (an H100 NVL, a consumer card) has no MFU rather than a guessed one.
    """
    if not accelerator_type:
        return None
    if accelerator_type.startswith("NVIDIA"):
        words = accelerator_type.replace("-", " ").split()
        return next((chip for key, chip in GPUS if _has_words(words, key.split())), None)
    prefix = accelerator_type.split("-")[0].lower()
    return CHIPS.get(ALIASES.get(prefix, prefix))


def _has_words(words: list[str], wanted: list[str]) -> bool:
    """Whether wanted appears in words as consecutive whole words."""
    return any(words[i : i + len(wanted)] == wanted for i in range(len(words) - len(wanted) + 1))


def mfu(flops_per_sample: float, samples_per_second: float, devices: int, chip: Chip) -> float:
    """Model FLOPs utilisation of `devices` XLA devices of `chip` training at samples_per_second."""
    chips = devices / chip.devices_per_chip
    return flops_per_sample * samples_per_second / (chips * chip.peak_flops)
