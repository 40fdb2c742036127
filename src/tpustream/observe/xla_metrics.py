"""XLA's own counters: compilations, transfers, CPU fallbacks (torch_xla.debug.metrics), recompiles.

torch_xla is imported inside functions, so importing this module initialises nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# torch_xla's timing metrics accumulate nanoseconds.
NANOSECONDS = 1e-9
# `.item()` / `float()` of a device tensor is counted as aten::_local_scalar_dense:
# a device-to-host read the program asked for, not an op missing an XLA lowering.
ITEM_COUNTER = "aten::_local_scalar_dense"


@dataclass(frozen=True)
class XlaMetrics:
    """Process-wide totals from torch_xla.debug.metrics (all replicas of a process together)."""

    compilations: int = 0
    compile_seconds: float = 0.0
    executions: int = 0
    execute_seconds: float = 0.0
    to_device_transfers: int = 0
    to_device_bytes: int = 0
    from_device_transfers: int = 0
    from_device_bytes: int = 0
    item_calls: int = 0
    # aten ops that ran on the CPU because XLA has no lowering for them, with counts:
    # each one cuts the graph and copies tensors to the host and back.
    cpu_fallbacks: dict[str, int] = field(default_factory=dict)

    def scalars(self) -> dict[str, float]:
        """The numbers worth plotting, named for TensorBoardLog.scalars."""
        return {
            "xla/compilations": self.compilations,
            "xla/compile_seconds": self.compile_seconds,
            "xla/executions": self.executions,
            "xla/execute_seconds": self.execute_seconds,
            "xla/to_device_bytes": self.to_device_bytes,
            "xla/from_device_bytes": self.from_device_bytes,
            "xla/cpu_fallbacks": sum(self.cpu_fallbacks.values()),
        }

    def summary(self) -> str:
        fallbacks = (
            ", ".join(f"{name} x{count}" for name, count in self.cpu_fallbacks.items())
            if self.cpu_fallbacks
            else "none"
        )
        return (
            f"XLA: {self.compilations} compilations ({self.compile_seconds:.2f} s), "
            f"{self.executions} executions ({self.execute_seconds:.2f} s), "
            f"host->device {self.to_device_transfers} transfers ({format_bytes(self.to_device_bytes)}), "
            f"device->host {self.from_device_transfers} transfers ({format_bytes(self.from_device_bytes)}), "
            f"{self.item_calls} .item() reads, CPU fallbacks: {fallbacks}"
        )


def format_bytes(count: float) -> str:
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    index = 0
    while count >= 1024 and index < len(units) - 1:
        count /= 1024
        index += 1
    return f"{count:.0f} B" if index == 0 else f"{count:.1f} {units[index]}"


def _metric_count_and_total(met: Any, name: str) -> tuple[int, float]:
    # metric_data is None for a metric nothing has recorded yet.
    data = met.metric_data(name)
    return (int(data[0]), float(data[1])) if data else (0, 0.0)


def read_xla_metrics() -> XlaMetrics:
    """The process's XLA metrics so far (torch_xla 2.9 names, checked on the XLA CPU device)."""
    import torch_xla.debug.metrics as met

    compilations, compile_ns = _metric_count_and_total(met, "CompileTime")
    executions, execute_ns = _metric_count_and_total(met, "ExecuteTime")
    # SPMD programs run through ExecuteReplicated instead.
    replicated, replicated_ns = _metric_count_and_total(met, "ExecuteReplicatedTime")
    to_device, _ = _metric_count_and_total(met, "TransferToDeviceTime")
    from_device, _ = _metric_count_and_total(met, "TransferFromDeviceTime")
    # Named from the host's side: OutboundData grows with host->device copies,
    # InboundData with device->host reads (measured with a 1 MB tensor each way).
    _, to_device_bytes = _metric_count_and_total(met, "OutboundData")
    _, from_device_bytes = _metric_count_and_total(met, "InboundData")
    aten = {name: int(met.counter_value(name)) for name in met.counter_names() if name.startswith("aten::")}
    item_calls = aten.pop(ITEM_COUNTER, 0)
    return XlaMetrics(
        compilations=compilations,
        compile_seconds=compile_ns * NANOSECONDS,
        executions=executions + replicated,
        execute_seconds=(execute_ns + replicated_ns) * NANOSECONDS,
        to_device_transfers=to_device,
        to_device_bytes=int(to_device_bytes),
        from_device_transfers=from_device,
        from_device_bytes=int(from_device_bytes),
        item_calls=item_calls,
        cpu_fallbacks=dict(sorted(aten.items(), key=lambda item: (-item[1], item[0]))),
    )


def xla_metrics_summary() -> str:
    """One line: compilations, executions, transfers both ways, .item() reads, CPU fallback ops."""
    return read_xla_metrics().summary()


def compilation_count() -> int:
    """Graphs XLA has compiled in this process (cache hits in memory are not compilations)."""
    import torch_xla.debug.metrics as met

    return _metric_count_and_total(met, "CompileTime")[0]


def compile_seconds() -> float:
    """Seconds XLA has spent compiling in this process."""
    import torch_xla.debug.metrics as met

    return _metric_count_and_total(met, "CompileTime")[1] * NANOSECONDS


class RecompileWatch:
    """Warns when XLA compiles a graph it was not expected to: a shape or a constant changed.

    Call ``check(step)`` after each step's graph has run, i.e. from a step closure
    (``runtime.add_step_closure(watch.check, (step, "train"))``): with
    MpDeviceLoader a step's graph is compiled and run when the next batch is
    taken, after the loop body. The first ``warmup_checks`` checks may compile
    (the first training step); call ``expect_compile()`` before any other check
    that legitimately compiles (the first evaluation batch, the first epoch's
    end-of-epoch reductions).

    Compilations are counted per process: on a v2/v3 host, where replicas are
    threads of one process, one watch (local ordinal 0) sees every thread's
    compilations, so give it warm-up enough for all of them.
    """

    def __init__(self, warmup_checks: int = 1, count_compilations: Callable[[], int] | None = None):
        self._count = count_compilations or compilation_count
        # Compilations before the watch exists (model set-up) are not its business.
        self._seen = self._count()
        self._expected_checks = warmup_checks
        self._last_check: tuple[str, int] | None = None
        self.unexpected = 0

    def expect_compile(self, checks: int = 1) -> None:
        """The next `checks` checks may see compilations without a warning."""
        self._expected_checks = max(self._expected_checks, checks)

    def check(self, step: int, phase: str = "train") -> int:
        """Compilations since the previous check; warns if they were not expected."""
        total = self._count()
        new, self._seen = total - self._seen, total
        expected = self._expected_checks > 0
        self._expected_checks = max(0, self._expected_checks - 1)
        since = f" (since {self._last_check[0]} step {self._last_check[1]})" if self._last_check else ""
        self._last_check = (phase, step)
        if new > 0 and not expected:
            self.unexpected += new
            log.warning(
                "%s step %d: XLA compiled %d new graph(s)%s, %d in total: a tensor shape or a constant "
                "baked into the graph changed, and each change costs a compilation. Rerun with "
                "PT_XLA_DEBUG_LEVEL=1 to see the cause of each compilation",
                phase,
                step,
                new,
                since,
                total,
            )
        return new
