"""Checks of the run folder and the checkpoint a run resumes from, before anything starts.

Its model and config must fit; a finished run is not trained again; an
earlier run in the folder is never overwritten without resume=overwrite.
"""

from __future__ import annotations

import logging
from typing import Any

from tpustream import checkpoint, storage
from tpustream.checkpoint import (
    FORCE_RESUME,
    OVERWRITE_RESUME,
    RESUME_MAY_DIFFER,
    SHAPE_MAY_DIFFER,
    ResumePoint,
    config_differences,
    read_metrics,
    schema_defaults,
)
from tpustream.checkpoint.local_tier import delete_local_copies, local_checkpoint_url
from tpustream.config import BestOf, EpochsChange, TrainConfig
from tpustream.data.format.manifest import ShardManifest
from tpustream.errors import ConfigError
from tpustream.launch.run_model import meta_model
from tpustream.observe.best import best_record, describe_best, read_select_best
from tpustream.observe.synthetic_rate import describe_synthetic, is_synthetic
from tpustream.training.epoch_order import describe_change
from tpustream.training.schedule import SchedulePhase, describe_epochs_change, epochs_changed
from tpustream.training.state import TrainState

log = logging.getLogger(__name__)

# Differing keys named in the error when a run folder is continued under another config.
MAX_SHOWN_DIFFERENCES = 8
# How to get back to each part of a per-reader order's shape (check_per_reader_shape).
SHAPE_SETTINGS = {
    "world_size": "on {} replica(s)",
    "batch_size": "with a replica batch of {}",
    "num_workers": "with data.num_workers={}",
}


def describe_run(history: list[dict[str, Any]], select_best: BestOf | str = BestOf.raw) -> str:
    """An earlier run in a few words, from its metrics.jsonl records, its best epoch as best.pt's."""
    if not history:
        return "no finished epoch"
    if is_synthetic(history):
        return f"a synthetic run, {len(history)} epoch(s); {describe_synthetic(history)}"
    text = f"{len(history)} epoch(s)"
    best = best_record(history, select_best)
    if best is not None:
        text += f", best validation accuracy {describe_best(best, select_best, counts=False)}"
    return text


def check_fresh_start(cfg: TrainConfig) -> None:
    """A run that starts fresh never silently overwrites an earlier run in its folder.

    resume=null in a folder with a run refuses, naming what would be lost;
    resume=overwrite deletes that run's checkpoints and metrics.jsonl first,
    so a preempted new run is never confused with the old one.
    """
    found = checkpoint.existing_run_files(cfg.output_dir)
    if not found:
        if cfg.resume in (None, "", OVERWRITE_RESUME):
            forget_local_copies(cfg)
        return
    # Its best.pt followed its own ema.select_best, whatever this run's is.
    held = describe_run(read_metrics(cfg.output_dir), read_select_best(cfg.output_dir) or cfg.ema.select_best)
    if cfg.resume == OVERWRITE_RESUME:
        checkpoint.delete_run_files(cfg.output_dir)
        forget_local_copies(cfg)
        log.warning(
            "resume=overwrite: deleted the earlier run in %s (%s: %s); starting fresh",
            cfg.output_dir,
            held,
            ", ".join(found),
        )
        return
    # Only a checkpoint continues; a synthetic run continues nothing (nor writes one to continue).
    continues = not cfg.data.synthetic and any(name.startswith(checkpoint.CHECKPOINTS) for name in found)
    this_run = "a synthetic run (data.synthetic)" if cfg.data.synthetic else f"resume={cfg.resume or 'null'}"
    to_continue = "set resume=auto to continue it, " if continues else ""
    raise ConfigError(
        f"output_dir {cfg.output_dir} holds a run ({held}) that {this_run} would overwrite "
        f"({', '.join(found)}): choose another output_dir, {to_continue}or "
        f"resume={OVERWRITE_RESUME} to delete it and start fresh"
    )


def forget_local_copies(cfg: TrainConfig) -> None:
    """A fresh start in output_dir: its copies under checkpoint.local_dir are an older run's: deleted."""
    for url in delete_local_copies(cfg.checkpoint.local_dir, cfg.output_dir):
        log.warning("a fresh start in %s: deleted the earlier run's local copy %s", cfg.output_dir, url)


def clear_interrupted_writes(cfg: TrainConfig) -> list[str]:
    """Delete what writes killed before they finished left in the run's folders; their URLs.

    A process killed with SIGKILL mid-save (the OOM killer, a preempted VM)
    leaves its temporary object (gs://.../last.pt.tmp-*, a local
    .last.pt.*.tmp) up to a checkpoint's size, in the run folder, its
    checkpoints folder or checkpoint.local_dir's copy; nothing else ever
    removes it. At start no write of this run is in flight.
    """
    last = checkpoint.checkpoint_url(cfg.output_dir, checkpoint.LAST)
    folders = [cfg.output_dir, storage.dirname(last)]
    if cfg.checkpoint.local_dir:
        folders.append(storage.dirname(local_checkpoint_url(cfg.checkpoint.local_dir, cfg.output_dir)))
    deleted = []
    for folder in folders:
        for url in storage.interrupted_writes(folder):
            if storage.delete(url):
                log.warning("deleted %s, which a write killed before it finished left behind", url)
                deleted.append(url)
    return deleted


def check_not_finished(cfg: TrainConfig, resume: ResumePoint) -> str | None:
    """Why the run has nothing left to train, for its own checkpoint (None: train on).

    A checkpoint named explicitly that has nothing left would start a run
    that trains nothing and report results it never made: an error.
    """
    if cfg.eval_only:
        return None
    done = TrainState.from_checkpoint(resume.state).finished(cfg.epochs, cfg.early_stop_patience)
    if done is None or resume.own:
        return done
    raise ConfigError(
        f"resume={cfg.resume}: nothing to train, {done}; raise epochs (or early_stop_patience) to train "
        "on from it, or set eval_only=true to evaluate it"
    )


def check_resume_fits(cfg: TrainConfig, train: ShardManifest, state: dict[str, Any], source: str) -> None:
    """The checkpoint's weights have the shapes of the configured model, or ConfigError naming them.

    The model is built on the meta device (shapes, no memory, no init
    arithmetic), so even wrn_seed's 103M parameters cost nothing here, and a
    changed model, class count or channel count is one line before spawning
    instead of a load_state_dict traceback in every replica.
    """
    model = meta_model(cfg, train)
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
        f"resume from {source}: the checkpoint holds another model than model.name={cfg.model.name} with "
        f"{train.num_classes} classes ({detail}); {advise_other_model(cfg, state, source)}"
    )


def advise_other_model(cfg: TrainConfig, state: dict[str, Any], source: str) -> str:
    """What to do about a checkpoint of another model: it depends on what the run wants of it.

    Evaluating it (eval_only) or starting from it (resume=URL) needs its
    model, named from the config it was saved with; only a run folder's own
    run can instead be left alone (another output_dir) or deleted.
    """
    its = describe_saved_model(cfg, (state.get("config") or {}).get("model") or {})
    if cfg.eval_only:
        return f"to evaluate it, use {its} as it was saved with, or name another checkpoint in resume"
    own = source in (
        checkpoint.checkpoint_url(cfg.output_dir, name) for name in (checkpoint.LAST, checkpoint.BEST)
    )
    if not own:
        return f"to train on from it, use {its} as it was saved with, or name another checkpoint in resume"
    return (
        f"to continue it, use {its} as it was saved with; else use another output_dir, or "
        f"resume={OVERWRITE_RESUME} to delete the run there and start fresh"
    )


def describe_saved_model(cfg: TrainConfig, saved: dict[str, Any]) -> str:
    """The settings in which a checkpoint's model (its config's model section) differs from this run's."""
    name, library = saved.get("name"), saved.get("library") or "tpustream"
    if name is None:  # a checkpoint without its config
        return "the model.* and data.* settings"
    options = saved.get("options") or {}
    ours = getattr(cfg.model.library, "value", cfg.model.library)  # config.ModelLibrary: its value
    if (library, name) != (ours, cfg.model.name):
        model = f"model={name}" if library == "tpustream" else f"model={library} model.name={name}"
        return model + (f" with model.options {options}" if options else "")
    if options != dict(cfg.model.options):
        return f"model.options {options}"
    return "the data's classes and channels (data.num_classes, data.channels)"


def check_resume_config(cfg: TrainConfig, config: dict[str, Any], resume: ResumePoint) -> None:
    """A run folder continued under another config: refused unless resume=force, naming the keys.

    Rerunning a folder with changed settings would otherwise continue (or, if
    it had finished, merely re-report) the earlier run as if it were this one.
    A checkpoint named explicitly (resume=URL, e.g. to fine-tune) and
    eval_only only warn.
    """
    saved = resume.state.get("config")
    if saved is None:
        return
    canonical = bool((resume.state.get("data_plan") or {}).get("streams"))
    may_differ = (*RESUME_MAY_DIFFER, *SHAPE_MAY_DIFFER) if canonical else RESUME_MAY_DIFFER
    differences = config_differences(saved, config, may_differ, schema_defaults())
    if not differences:
        return
    shown = "; ".join(differences[:MAX_SHOWN_DIFFERENCES])
    if len(differences) > MAX_SHOWN_DIFFERENCES:
        shown += f"; and {len(differences) - MAX_SHOWN_DIFFERENCES} more"
    if resume.own and cfg.resume != FORCE_RESUME and not cfg.eval_only:
        raise ConfigError(
            f"output_dir {cfg.output_dir} holds a run made with another config ({shown}): choose another "
            f"output_dir, set resume=force to continue that run with this config, or "
            f"resume={OVERWRITE_RESUME} to delete it and start fresh"
        )
    log.warning("%s was written with another config (%s); continuing with this one", resume.url, shown)


def check_schedule_horizon(cfg: TrainConfig, resume: ResumePoint) -> None:
    """A run continued with another `epochs` under a schedule drawn over them: refused until
    optim.on_epochs_change says what the schedule does, naming what each choice would do to the lr."""
    if cfg.eval_only or cfg.optim.on_epochs_change != EpochsChange.refuse:
        return
    state = resume.state
    saved = SchedulePhase.from_checkpoint(state, cfg.epochs)
    if not epochs_changed(saved, cfg):
        return
    position, steps = state["position"], (state.get("data_plan") or {}).get("steps_per_epoch")
    at = position["epoch"] + (position["step"] / steps if steps else 0.0)
    raise ConfigError(f"resume from {resume.url}: {describe_epochs_change(saved, at, cfg)}")


def check_per_reader_shape(
    saved_plan: dict[str, int], epoch: int, step: int, shape: dict[str, int], source: str
) -> None:
    """A mid-epoch position without canonical streams continues only on its shape, or ConfigError.

    That order (data.streams=0, or a run begun before canonical streams)
    deals the epoch out by replicas x replica batch x workers, so on another
    shape the position means nothing: the trainer could only restart the
    epoch and train the samples of its first steps a second time
    (TrainState.under_data_plan), which takes resume=force. ``shape``:
    world_size, batch_size (a replica's), num_workers (resolved from auto).
    """
    steps = saved_plan.get("steps_per_epoch")
    if not saved_plan or step <= 0 or (steps is not None and step >= steps):
        return  # at an epoch's start or end, which any order shares
    saved = {key: saved_plan.get(key) for key in shape}
    if saved == shape:
        return
    back = " and ".join(SHAPE_SETTINGS[key].format(saved[key]) for key in shape if saved[key] != shape[key])
    raise ConfigError(
        f"{source} stopped at step {step} of epoch {epoch} in an order cut for its shape (no canonical "
        f"streams: data.streams=0, or a run begun before them), which this run's shape cannot continue "
        f"({describe_change(saved, shape)}): resume it {back} to finish the epoch (from an epoch's end "
        f"any shape continues), or set resume={FORCE_RESUME} to restart epoch {epoch} from its first batch "
        f"(the samples of its first {step} step(s) are trained again)"
    )
