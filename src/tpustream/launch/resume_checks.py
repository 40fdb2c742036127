"""Checks of the checkpoint a run resumes from, before anything starts: its model, its config."""

from __future__ import annotations

import logging
from typing import Any

from tpustream.checkpoint import RESUME_MAY_DIFFER, config_differences
from tpustream.config import TrainConfig
from tpustream.data.manifest import ShardManifest
from tpustream.errors import ConfigError

log = logging.getLogger(__name__)

# Differing keys named in the error when a run folder is continued under another config.
MAX_SHOWN_DIFFERENCES = 8


def check_resume_fits(cfg: TrainConfig, train: ShardManifest, state: dict[str, Any], source: str) -> None:
    """The checkpoint's weights have the shapes of the configured model, or ConfigError naming them.

    The model is built on the meta device (shapes, no memory, no init
    arithmetic), so even wrn_seed's 103M parameters cost nothing here, and a
    changed model, class count or channel count is one line before spawning
    instead of a load_state_dict traceback in every replica.
    """
    import torch

    from tpustream.models import create_model

    height, width = train.image_size
    with torch.device("meta"):
        model = create_model(
            cfg.model.name,
            num_classes=train.num_classes,
            image_size=max(height, width),
            channels=train.channels,
            **cfg.model.options,
        )
    wanted = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    saved = {name: tuple(t.shape) for name, t in state.get("model", {}).items()}
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    differ = sorted(n for n in set(wanted) & set(saved) if wanted[n] != saved[n])
    if not (missing or unexpected or differ):
        return
    if differ:
        first = differ[0]
        shapes = f"{saved[first]} saved, {wanted[first]} now"
        detail = f"{len(differ)} tensor(s) differ in shape, first {first}: {shapes}"
    else:
        first = (missing or unexpected)[0]
        detail = f"{len(missing)} missing and {len(unexpected)} unexpected tensor(s), first {first}"
    raise ConfigError(
        f"resume from {source}: the checkpoint holds another model than model={cfg.model.name} with "
        f"{train.num_classes} classes ({detail}); use another output_dir, or resume=null to start fresh"
    )


def check_resume_config(
    cfg: TrainConfig, config: dict[str, Any], saved: dict[str, Any] | None, source: str
) -> None:
    """A run folder continued under another config: refused under resume=auto, naming the keys.

    Rerunning a folder with changed settings would otherwise continue (or, if
    it had finished, merely re-report) the earlier run as if it were this one.
    resume=force continues anyway; a checkpoint named explicitly (resume=URL,
    e.g. to fine-tune) and eval_only only warn.
    """
    if saved is None:
        return
    differences = config_differences(saved, config, RESUME_MAY_DIFFER)
    if not differences:
        return
    shown = "; ".join(differences[:MAX_SHOWN_DIFFERENCES])
    if len(differences) > MAX_SHOWN_DIFFERENCES:
        shown += f"; and {len(differences) - MAX_SHOWN_DIFFERENCES} more"
    if cfg.resume == "auto" and not cfg.eval_only:
        raise ConfigError(
            f"output_dir {cfg.output_dir} holds a run made with another config ({shown}): choose another "
            "output_dir, or set resume=force to continue that run with this config"
        )
    log.warning("%s was written with another config (%s); continuing with this one", source, shown)
