"""debug.*: the checks a run does only when asked, apart from the loop they watch.

Recompilations (debug.metrics), replicas that drifted apart
(debug.check_sync_every), the samples each replica trained on
(debug.sample_log_dir), a stop request at a chosen step (debug.stop_at_step),
and traces of chosen steps or an evaluation (debug.profile_*: XLA's or torch.profiler's, by runtime).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os

import numpy as np
import torch.nn as nn

from tpustream import observe, preemption
from tpustream.config import DebugConfig
from tpustream.runtime import Runtime
from tpustream.training.periodic import itstime

log = logging.getLogger(__name__)

# What reads each runtime's traces (observe.profiler).
READERS = {
    "XLA": "TensorBoard's profile plugin",
    "torch": "Perfetto at ui.perfetto.dev, or chrome://tracing",
}


class DebugChecks:
    """One replica's debug checks; the trainer calls them at its step and epoch boundaries."""

    def __init__(self, cfg: DebugConfig, runtime: Runtime, output_dir: str = "."):
        self.cfg = cfg
        self.runtime = runtime
        self.output_dir = output_dir
        self.watch = observe.RecompileWatch() if cfg.metrics else None
        self.trace: observe.TraceCapture | None = None
        self.profiling = cfg.profile_all_replicas or runtime.is_master

    # -- debug.profile_steps / profile_eval_epoch: traces -------------------------
    def _start_trace(self, name: str) -> None:
        if self.cfg.profile_all_replicas:
            name = f"{name}/replica-{self.runtime.rank:03d}"
        self.trace = self.runtime.trace_capture(self.output_dir, name)
        self.trace.start()

    def _stop_trace(self, what: str) -> None:
        if self.trace is None:
            return
        self.runtime.wait_device_ops()  # the window's device work belongs in its trace
        trace, self.trace = self.trace, None
        where = trace.stop()
        if where is not None:
            log.info("%s trace of %s in %s (%s)", trace.kind, what, where, READERS[trace.kind])
            if trace.summary:
                log.info("%s", trace.summary)

    def finish(self, global_step: int) -> None:
        """Training ended inside debug.profile_steps' window: the trace of the steps it had is written."""
        if self.trace is not None and self.cfg.profile_steps:
            start, end = self.cfg.profile_steps
            self._stop_trace(f"global steps {start + 1} to {global_step} (the run ended before step {end})")

    @contextlib.contextmanager
    def profiling_evaluation(self, epoch: int, name: str):
        """debug.profile_eval_epoch: the evaluation of this epoch (the model's, not the average's) traced."""
        traced = self.profiling and epoch == self.cfg.profile_eval_epoch and name == "model"
        if traced:
            self._start_trace(f"profile-eval-epoch-{epoch}")
        try:
            yield
        finally:
            if traced:
                self._stop_trace(f"epoch {epoch}'s evaluation")

    def watch_compiles(self, phase: str, step: int, first: bool) -> None:
        """debug.metrics: warn from a step closure if this step compiled and was not expected to."""
        if self.watch is None:
            return
        if first:
            self.watch.expect_compile()
        self.runtime.add_step_closure(self.watch.check, (step, phase))

    def after_train_step(self, model: nn.Module, global_step: int) -> None:
        """debug.stop_at_step, profile_steps and check_sync_every, after step `global_step` ran."""
        if self.profiling and self.cfg.profile_steps:
            start, end = self.cfg.profile_steps
            if global_step == start:
                self._start_trace(f"profile-steps-{start}-{end}")
            elif global_step == end:
                self._stop_trace(f"global steps {start + 1} to {end}")
            if start <= global_step < end and self.trace is not None:
                self.trace.mark_step(global_step + 1)
        if global_step == self.cfg.stop_at_step:
            preemption.request_stop()
        if itstime(global_step, self.cfg.check_sync_every):
            self.runtime.add_step_closure(self.check_replicas_in_sync, (model, global_step))

    def after_train_epoch(
        self, model: nn.Module, global_step: int, epoch: int, start_step: int, sample_ids: list[np.ndarray]
    ) -> None:
        """Once the epoch's training is done and BatchNorm buffers are averaged."""
        if self.cfg.check_sync_every:
            self.check_replicas_in_sync(model, global_step, include_buffers=True)
        if self.cfg.sample_log_dir:
            self.write_sample_log(sample_ids, epoch, start_step)

    def at_epoch_end(self, epoch: int, first_end: bool) -> None:
        """debug.metrics: the epoch end's compilations, and the XLA metrics summary."""
        if self.watch is None:
            return
        # The first epoch's end compiles its reductions and checkpoint copies.
        if first_end:
            self.watch.expect_compile()
        self.watch.check(epoch, "end of epoch")
        if self.runtime.is_master:
            log.info("epoch %d: %s", epoch, observe.xla_metrics_summary())

    def check_replicas_in_sync(self, model: nn.Module, step: int, include_buffers: bool = False) -> None:
        """Stop if replicas hold different parameters.

        Called as a step closure during the epoch (tensors are computed by
        then); buffers are compared only after average_buffers, since
        BatchNorm statistics legitimately differ within an epoch.
        """
        digest = hashlib.sha256()
        tensors = (*model.parameters(), *(model.buffers() if include_buffers else ()))
        for tensor in tensors:
            digest.update(tensor.detach().cpu().numpy().tobytes())
        fingerprints = self.runtime.all_gather_host(f"sync-{step}", digest.hexdigest())
        if len(set(fingerprints)) > 1:
            # Every replica sees the same list, so all of them stop here together.
            raise RuntimeError(f"replicas diverged by step {step}: parameter fingerprints {fingerprints}")
        log.debug("step %d: all %d replicas hold identical parameters", step, len(fingerprints))

    def write_sample_log(
        self, sample_ids: list[np.ndarray], epoch: int, start_step: int, stop_step: int | None = None
    ) -> None:
        """The ids of the real samples this replica trained on in this pass, for exactness audits.

        A pass resumed inside its epoch is named -fromSTEP, one stopped inside it
        -toSTEP: of its ids, only the batches trained (the loader runs ahead of the loop).
        """
        folder = self.cfg.sample_log_dir
        if not folder:
            return
        if stop_step is not None:
            sample_ids = sample_ids[: stop_step - start_step]
        os.makedirs(folder, exist_ok=True)
        suffix = f"-from{start_step:05d}" if start_step else ""
        suffix += f"-to{stop_step:05d}" if stop_step is not None else ""
        np.save(
            os.path.join(folder, f"train-epoch{epoch:03d}-replica{self.runtime.rank:03d}{suffix}.npy"),
            np.concatenate(sample_ids) if sample_ids else np.empty(0, np.int64),
        )
