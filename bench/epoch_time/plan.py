"""The epoch-time sweep's plan: the switches, every run's Hydra overrides, composed before anything runs."""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Setting:
    name: str
    overrides: tuple[str, ...]


@dataclass(frozen=True)
class Switch:
    """Two settings of the same keys; the first is the baseline."""

    name: str
    baseline: Setting
    flipped: Setting

    @property
    def keys(self) -> set[str]:
        return {override_key(o) for o in self.baseline.overrides + self.flipped.overrides}

    def setting(self, name: str) -> Setting:
        return self.baseline if name == self.baseline.name else self.flipped


SWITCHES = {
    s.name: s
    for s in (
        Switch("validation", Setting("on", ("eval_every=1",)), Setting("off", ("eval_every=0",))),
        Switch(
            "augmentation",
            Setting("on", ("data.crop_padding=4", "data.hflip=true")),
            Setting("off", ("data.crop_padding=0", "data.hflip=false")),
        ),
        Switch(
            "source",
            Setting("shards", ("data.in_memory=false",)),
            Setting("memory", ("data.in_memory=true",)),
        ),
        Switch("workers", Setting("4", ("data.num_workers=4",)), Setting("1", ("data.num_workers=1",))),
    )
}
# Written for a switch the sweep does not vary: the config decides.
NOT_SET = "config"


def override_key(override: str) -> str:
    """'data.num_workers=4' -> 'data.num_workers'; '+foo=1' / '~foo' -> 'foo'."""
    return override.split("=", 1)[0].lstrip("+~")


def cache_key() -> str:
    """The config key of the persistent XLA compile cache (checked against the schema)."""
    from tpustream.config import TrainConfig

    if "xla_cache_dir" not in TrainConfig.__dataclass_fields__:
        raise SystemExit("found no XLA compile cache key in tpustream.config (xla_cache_dir)")
    return "xla_cache_dir"


@dataclass(frozen=True)
class RunSpec:
    """One train.py run of the sweep."""

    name: str  # folder name under runs/
    batch_size: int
    settings: tuple[tuple[str, str], ...]  # (switch, setting) for the switches varied
    cache: str  # "off" (key set to null), "cold" or "warm"
    overrides: tuple[str, ...]  # everything but the run folder keys

    @property
    def label(self) -> str:
        """The configuration without the batch size: 'baseline', 'validation off', ..."""
        flipped = [f"{s} {v}" for s, v in self.settings if v != SWITCHES[s].baseline.name]
        text = ", ".join(flipped) or "baseline"
        return text if self.cache == "off" else f"{text}, compile cache {self.cache}"

    def setting(self, switch: str) -> str:
        return dict(self.settings).get(switch, NOT_SET)


def combinations(switches: Sequence[str], full: bool) -> list[tuple[tuple[str, str], ...]]:
    """Baseline first; then one switch flipped at a time, or (full) every combination."""
    baseline = tuple((s, SWITCHES[s].baseline.name) for s in switches)
    if full:
        choices = [(SWITCHES[s].baseline.name, SWITCHES[s].flipped.name) for s in switches]
        return [tuple(zip(switches, values, strict=True)) for values in itertools.product(*choices)]
    flips = [tuple((t, SWITCHES[t].flipped.name if t == s else v) for t, v in baseline) for s in switches]
    return [baseline, *flips]


def reserved_keys(cache: str) -> set[str]:
    return {"epochs", "batch_size", "output_dir", "resume", "hydra.run.dir", cache}


def check_extra_overrides(extra: Sequence[str], switches: Sequence[str], cache: str) -> None:
    """Refuse overrides that the harness sets itself or that a varied switch controls."""
    for override in extra:
        if override.startswith("-"):
            raise SystemExit(
                f"{override!r}: the harness runs the sweep itself; pass Hydra overrides "
                "(key=value) after --, and batch sizes with --batch-sizes"
            )
        if "=" not in override and not override.startswith("~"):
            raise SystemExit(f"{override!r} is not a Hydra override (key=value)")
        key = override_key(override)
        if key in reserved_keys(cache):
            raise SystemExit(f"{override!r}: the harness sets {key} itself; drop it from the overrides")
        for name in switches:
            if key in SWITCHES[name].keys:
                raise SystemExit(
                    f"{override!r}: {key} belongs to the switch {name!r}, which the sweep varies; "
                    f"leave {name!r} out of --switches to set it yourself"
                )


def build_plan(
    batch_sizes: Sequence[int],
    switches: Sequence[str],
    *,
    epochs: int,
    extra: Sequence[str] = (),
    full: bool = False,
    cold_warm: Sequence[int] = (),
    cache: str = "xla_cache_dir",
    cache_root: Path | None = None,
) -> list[RunSpec]:
    """Every run of the sweep, in order: per batch size the combinations, then cold/warm pairs."""
    check_extra_overrides(extra, switches, cache)
    runs = []

    def add(batch: int, settings: tuple[tuple[str, str], ...], mode: str, cache_value: str) -> None:
        flipped = [f"{s}-{v}" for s, v in settings if v != SWITCHES[s].baseline.name]
        name = f"bs{batch}-" + ("-".join(flipped) or "baseline")
        if mode != "off":
            name += f"-cache-{mode}"
        switch_overrides = [o for s, v in settings for o in SWITCHES[s].setting(v).overrides]
        overrides = (
            *extra,
            f"epochs={epochs}",
            f"batch_size={batch}",
            *switch_overrides,
            f"{cache}={cache_value}",
        )
        runs.append(RunSpec(name, batch, settings, mode, overrides))

    for batch in batch_sizes:
        for settings in combinations(switches, full):
            add(batch, settings, "off", "null")
    for batch in cold_warm:
        folder = (cache_root or Path("xla-cache")) / f"bs{batch}"
        for mode in ("cold", "warm"):
            add(batch, combinations(switches, False)[0], mode, str(folder))
    return runs


def check_with_hydra(runs: Sequence[RunSpec]) -> Any:
    """Compose every distinct override list as train.py would; return the first config.

    A key that does not exist (yet) in conf/ fails here, naming the run,
    before anything is started.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from tpustream.config import register_configs

    register_configs()
    first, seen = None, set()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for run in runs:
            overrides = tuple(
                o for o in run.overrides if not override_key(o).startswith(("hydra.", "hydra/"))
            )
            if overrides in seen:
                continue
            seen.add(overrides)
            try:
                cfg = compose(
                    config_name="config", overrides=["output_dir=/unused", "log_dir=null", *overrides]
                )
            except Exception as exc:  # Hydra raises several types; all mean "train.py would refuse"
                missing = re.search(r"Could not override '([^']+)'", str(exc))
                owners = [s for s in SWITCHES.values() if missing and missing[1] in s.keys]
                hint = (
                    f"; this checkout has no {missing[1]}: leave the switch {owners[0].name!r} "
                    "out of --switches to sweep without it"
                    if owners
                    else ""
                )
                raise SystemExit(
                    f"train.py would refuse run {run.name} ({' '.join(overrides)}): {exc}{hint}"
                ) from None
            first = first if first is not None else cfg
    GlobalHydra.instance().clear()
    return first


# conf/accelerator's choices; --accelerator picks one for every run.
ACCELERATORS = ("cpu", "tpu", "cpu_pod", "cpu_eager", "cuda")


def _device_and_runtime(cfg: Any) -> tuple[str, str]:
    from tpustream.config import PLATFORMS, Accelerator

    platform = PLATFORMS[Accelerator(cfg.accelerator.name)]
    return platform.device.value, platform.runtime.value


def default_name(cfg: Any) -> str:
    device, runtime = _device_and_runtime(cfg)
    suffix = device.lower() if runtime == "xla" else {"CPU": "cpu_eager"}.get(device, device.lower())
    data = str(cfg.data.root).rstrip("/").rsplit("/", 1)[-1]  # the dataset's folder: digits, imagenet
    return f"{cfg.model.name}-{data}-{suffix}"


def describe_device(cfg: Any) -> str:
    """What ran the sweep's steps, as its table says: the device type, the runtime, the GPU's name."""
    device, runtime = _device_and_runtime(cfg)
    through = "torch_xla" if runtime == "xla" else "native PyTorch, no XLA"
    name = ""
    if device == "CUDA":
        import torch

        if torch.cuda.is_available():
            name = f", {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return f"{device} ({through}{name})"
