"""Observability of a run: where its time goes, TensorBoard, XLA's counters, the profiler.

- ``tensorboard``: scalars under ``<output_dir>/tensorboard/`` (uploaded for gs://);
- ``xla``: compile/transfer/fallback metrics and recompile watches;
- ``profiler``: the XLA profiler server per replica, traces (XLA or torch.profiler) captured on demand;
- ``trace_gaps``: where a torch.profiler trace's GPU stood idle between kernels, and why;
- ``flops``: the model's FLOPs per training sample, counted once on the meta device;
- ``chips``: TPU peak FLOP/s per chip and model FLOPs utilisation (MFU);
- ``timing``: where an epoch's time goes (input wait, compile, step, saving).

Nothing here may stop a run. There is no module-level mutable state: on TPU
v2/v3 replicas are threads of one process, and each builds its own objects.
"""

from tpustream.observe.profiler import TorchTraceCapture, TraceCapture, start_profiler
from tpustream.observe.tensorboard import NullTensorBoardLog, TensorBoardLog
from tpustream.observe.xla_metrics import (
    RecompileWatch,
    XlaMetrics,
    compilation_count,
    format_bytes,
    read_xla_metrics,
    xla_metrics_summary,
)

__all__ = [
    "NullTensorBoardLog",
    "RecompileWatch",
    "TensorBoardLog",
    "TorchTraceCapture",
    "TraceCapture",
    "XlaMetrics",
    "compilation_count",
    "format_bytes",
    "read_xla_metrics",
    "start_profiler",
    "xla_metrics_summary",
]
