"""TPU chips' peak bf16 FLOP/s, and model FLOPs utilisation (MFU) against them.

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


def chip_from_accelerator_type(accelerator_type: str | None) -> Chip | None:
    """The chip of an accelerator type ("v4-32", "v5litepod-8", "v6e-8"), None if unknown."""
    if not accelerator_type:
        return None
    prefix = accelerator_type.split("-")[0].lower()
    return CHIPS.get(ALIASES.get(prefix, prefix))


def mfu(flops_per_sample: float, samples_per_second: float, devices: int, chip: Chip) -> float:
    """Model FLOPs utilisation of `devices` XLA devices of `chip` training at samples_per_second."""
    chips = devices / chip.devices_per_chip
    return flops_per_sample * samples_per_second / (chips * chip.peak_flops)
