"""Start this host's replicas, one way per kind of run, and turn their failures into one line.

Three ways to run replicas, chosen from the config by ``way_of_running``:

- ``xla``: xmp.spawn, a process per XLA device (TPU cores; one child on the
  XLA CPU device, or this process with accelerator.in_process), collectives
  through torch_xla;
- ``gloo``: the simulated pod (accelerator=cpu_pod), a process per replica on
  this machine, each with its own XLA CPU device, collectives over gloo;
- ``spmd``: strategy=spmd / spmd_fsdp, one process for all of this host's
  devices, one GSPMD program over the global mesh;
- ``native``: PyTorch without torch_xla (accelerator=cuda, cpu_eager), a
  process per GPU or CPU replica, collectives over NCCL or gloo.

Every replica process goes through ``replica_process``: its logging, stop
handling, death with its parent, and the one way a failure is reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import logging
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

from tpustream import progress
from tpustream.config import SPMD_STRATEGIES, Collectives, Device, RuntimeKind, TrainConfig
from tpustream.errors import TpustreamError
from tpustream.launch.auto_workers import local_replicas
from tpustream.launch.checks import native_processes
from tpustream.launch.hosts import NativeHosts, native_hosts
from tpustream.launch.plan import RunPlan, read_final_metrics
from tpustream.launch.replica import run_replica
from tpustream.logs import setup_replica_logging
from tpustream.observe.advice import usable_cpus
from tpustream.preemption import Preempted, exit_with_parent, install_stop_handlers, starting_replicas
from tpustream.watchdog import Limits, Reports, Watchdog, start_watchdog, stop_watchdog

log = logging.getLogger(__name__)

# XLA:CPU compiles its LLVM code at -O3 by default. At -O1 a ResNet-18 train
# step compiled in 15 s instead of 30-38 s here, and ran at the same speed
# (0.56 s vs 0.52-0.57 s a step at batch 32 of 32 px); -O0 compiled in 7.5 s
# but stepped 5x slower. Debug runs on a CPU are compile-bound: take -O1
# unless the user's XLA_FLAGS chose a level.
CPU_OPT_LEVEL_FLAG = "--xla_backend_optimization_level"
CPU_OPT_LEVEL = 1


def xla_cpu_flags(flags: str | None) -> str:
    """XLA_FLAGS for the XLA CPU device: the user's, with -O1 unless they name a level."""
    flags = (flags or "").strip()
    if CPU_OPT_LEVEL_FLAG in flags:
        return flags
    return f"{flags} {CPU_OPT_LEVEL_FLAG}={CPU_OPT_LEVEL}".strip()


def way_of_running(cfg: TrainConfig) -> str:
    if cfg.accelerator.runtime == RuntimeKind.native:
        return "native"
    if cfg.strategy in SPMD_STRATEGIES:
        return "spmd"
    if cfg.accelerator.collectives == Collectives.gloo:
        return "gloo"
    return "xla"


def configure_device_environment(cfg: TrainConfig) -> None:
    """PJRT reads these when the runtime starts, i.e. in the spawned replicas."""
    if cfg.accelerator.runtime == RuntimeKind.native:
        return  # no PJRT: torch_xla is never imported
    device = cfg.accelerator.device.value
    previous = os.environ.get("PJRT_DEVICE")
    if previous and previous != device:
        log.warning(
            "PJRT_DEVICE=%s in the environment; accelerator=%s sets %s", previous, device.lower(), device
        )
    os.environ["PJRT_DEVICE"] = device
    if cfg.accelerator.device == Device.CPU:
        # N virtual XLA CPU devices in one process only for the GSPMD
        # strategies: across processes, XLA:CPU's collectives deadlock.
        spmd = cfg.strategy in SPMD_STRATEGIES
        os.environ["CPU_NUM_DEVICES"] = str(cfg.accelerator.num_devices or 1) if spmd else "1"
        os.environ["XLA_FLAGS"] = xla_cpu_flags(os.environ.get("XLA_FLAGS"))


def launch(plan: RunPlan) -> dict[str, Any] | None:
    """Start this host's replicas and wait for them; returns the final metrics of the run."""
    if plan.finished:
        # Nothing to train: report the run's results without starting a device.
        log.info("nothing to do: the run in %s is finished (%s)", plan.cfg.output_dir, plan.finished)
        return read_final_metrics(plan.cfg.output_dir, plan.cfg.ema.select_best)
    configure_device_environment(plan.cfg)
    way = way_of_running(plan.cfg)
    train, val = plan.train, plan.val
    data = (
        "synthetic data (data.synthetic)"
        if plan.cfg.data.synthetic
        else f"train {train.num_samples} samples in {len(train.shards)} shards, "
        f"validation {val.num_samples} samples"
    )
    log.info(
        "launching %s; %s; output %s%s",
        _describe(plan.cfg, way),
        data,
        plan.cfg.output_dir,
        f"; resuming from {plan.resume_url}" if plan.resume_url else "",
    )
    reports = Reports.create()
    try:
        with starting_replicas():
            SPAWN[way](dataclasses.replace(plan, watchdog_reports=reports.path))
    except BaseException:
        # A watchdog that fired ended the replicas (76, or 75 after a stop it could not
        # honour): that is the run's verdict, whatever their ends looked like from here.
        reports.raise_verdict(plan.cfg.output_dir)
        raise
    finally:
        reports.remove()
        if plan.pretrained is not None:  # the host's copy of model.pretrained: the replicas are done
            with contextlib.suppress(FileNotFoundError):
                os.remove(plan.pretrained[0])
    return read_final_metrics(plan.cfg.output_dir, plan.cfg.ema.select_best)


def _describe(cfg: TrainConfig, way: str) -> str:
    acc = cfg.accelerator
    if way == "gloo":
        return f"a simulated pod of {acc.num_devices} replica processes (XLA CPU + gloo)"
    if way == "native":
        hosts = native_hosts(native_processes(cfg))
        where = f" on each of {hosts.nodes} machines" if hosts.nodes > 1 else ""
        return (
            f"{acc.device.value} without XLA, {hosts.per_node} replica process(es){where} "
            f"({acc.collectives.value})"
        )
    where = "in this process" if acc.in_process else "in a process of its own"
    if way == "spmd":
        devices = acc.num_devices if acc.device == Device.CPU else "every"
        return f"strategy={cfg.strategy.value} on {devices} {acc.device.value} device(s) as one mesh, {where}"
    single = acc.in_process or (acc.device == Device.TPU and acc.num_devices == 1)
    return f"on {acc.device.value} ({'in this process' if single else 'one process per device'})"


# -- the replica processes ---------------------------------------------------


def skip_final_collection() -> None:
    """Spare the interpreter's finalization its full garbage collections over what is alive now.

    Call it when this process is about to exit. A process that imported torch
    and torch_xla (dynamo, sympy) holds over a million objects the collector
    tracks, and finalization's collections walk them all: 1.8 of the 2.3 s
    that a process which had run one tiny XLA computation took to exit
    (measured on XLA:CPU; a replica child, its parent and train.py each pay
    it, one after the other). gc.freeze moves them to the permanent
    generation (vLLM freezes its start-up objects the same way). Exit
    handlers, thread joins and refcount-driven closes still run; only cyclic
    garbage left at exit goes unreclaimed, which the process's end does.
    """
    gc.freeze()


def share_host_threads(replicas_here: int) -> int | None:
    """Give this replica process its share of the host's vCPUs for torch's intra-op threads.

    torch sizes its thread pool to every vCPU the process may use, so N
    replica processes on one host ask for N times the cores, and OpenMP's
    threads spin while they wait for each other: 2 eager CPU replicas on 2
    cores spent 55 CPU-seconds on a 3-epoch digits run with 2 threads each,
    36 with 1 (its epochs took 1.1 s instead of 2.7). torchrun sets
    OMP_NUM_THREADS=1 for its processes for the same reason; a share keeps
    a one-replica host's cores busy. OMP_NUM_THREADS, when set, is the
    user's choice and wins. Returns the count set, or None.
    """
    if replicas_here <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    threads = max(1, usable_cpus() // replicas_here)
    torch.set_num_threads(threads)
    return threads


def replica_process(plan: RunPlan, rank: int, world: int, make_runtime: Callable[[], Any]) -> None:
    """One replica process, from its logging to its end; re-raises what the parent must report."""
    setup_replica_logging(rank, world, plan.cfg.log_dir)
    install_stop_handlers()  # effective only if this replica runs on its process's main thread
    child = multiprocessing.parent_process() is not None  # a spawned child, not train.py itself
    if child:
        exit_with_parent()
    share_host_threads(local_replicas(plan.cfg))
    watchdog = start_watchdog(replica_watchdog(plan, rank))
    try:
        run_replica(plan, make_runtime())
    except Preempted:
        raise  # every replica stopped at the same step after the save: nobody waits for us
    except TpustreamError as exc:
        if world > 1:
            log.error("replica %d failed: %s", rank, exc)
        raise
    except BaseException as exc:
        if world > 1 and peer_left(exc):
            # Not this replica's fault: a peer ended (its own error says why) while this one
            # waited for it in a collective. One line; the parent reports the first failure.
            log.warning("replica %d stopped: another replica left the collective (%s)", rank, exc)
            # The parent reports the first replica it sees fail: let that be the one that left.
            time.sleep(PEER_GRACE_SECONDS)
        else:
            # A bug, not bad input: keep the traceback, the parent only sees the type.
            log.error("replica %d failed:\n%s", rank, traceback.format_exc())
        raise
    finally:
        progress.beat("the replica is closing")
        if child:
            # Its process ends with this replica (train.py itself freezes on its way out); the
            # watchdog watches that end too: a stuck exit (a child that will not be joined) is a hang.
            skip_final_collection()
        else:
            stop_watchdog(watchdog)  # train.py goes on (a multirun's next job starts its own)


# What gloo's TCP transport says when the replica at the other end of a collective is gone.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer")
# How long a replica whose peer left waits before it ends too (the peer's end is then seen first).
PEER_GRACE_SECONDS = 2.0


def peer_left(exc: BaseException) -> bool:
    """Whether exc is a collective that broke because another replica's process ended."""
    return isinstance(exc, RuntimeError) and any(words in str(exc) for words in PEER_GONE)


def replica_watchdog(plan: RunPlan, rank: int) -> Watchdog:
    """The progress watchdog of replica `rank` (tpustream.watchdog), not started."""
    cfg = plan.cfg
    reports = Reports(plan.watchdog_reports) if plan.watchdog_reports else None
    return Watchdog(
        Limits.from_config(cfg.watchdog),
        rank,
        cfg.output_dir,
        log_dir=cfg.log_dir,
        reports=reports,
        local_replicas=local_replicas(cfg),
        backstop=True,
    )


def xla_replica_main(index: int, plan: RunPlan) -> None:
    """The xmp.spawn target."""
    import torch_xla.runtime as xr

    from tpustream.runtime import XlaRuntime

    world = xr.world_size()
    try:
        replica_process(plan, xr.global_ordinal(), world, lambda: XlaRuntime(plan.cfg.xla_cache_dir))
    except Preempted:
        raise
    except BaseException:
        if world == 1:
            raise  # nobody waits for us; the parent reports our one-line error
        # Peers may be waiting in a collective for this replica and would wait
        # forever. Dying hard breaks xmp.spawn's process pool, which then
        # terminates every replica of this host.
        logging.shutdown()
        os._exit(1)


def simulated_replica_main(rank: int, plan: RunPlan, world: int, init_method: str) -> None:
    """One replica of the simulated pod: gloo process group, own XLA CPU device."""
    import torch.distributed as dist

    from tpustream.runtime import GlooRuntime

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10)
    )
    try:
        replica_process(plan, rank, world, lambda: GlooRuntime(rank, world, plan.cfg.xla_cache_dir))
    finally:
        dist.destroy_process_group()


def native_replica_main(local_rank: int, plan: RunPlan, hosts: NativeHosts) -> None:
    """One replica of a native PyTorch job: its device, its torch.distributed group."""
    import torch.distributed as dist

    from tpustream.runtime import NativeRuntime
    from tpustream.runtime.native import native_device

    acc = plan.cfg.accelerator
    rank = hosts.node_rank * hosts.per_node + local_rank
    device = native_device(acc.device.value, local_rank, acc.deterministic)
    dist.init_process_group(
        acc.collectives.value,
        init_method=hosts.init_method,
        rank=rank,
        world_size=hosts.world_size,
        timeout=datetime.timedelta(minutes=10),
    )
    try:
        replica_process(
            plan,
            rank,
            hosts.world_size,
            lambda: NativeRuntime(rank, hosts.world_size, local_rank, device, acc.channels_last, acc.compile),
        )
    finally:
        dist.destroy_process_group()


def spmd_replica_main(index: int, plan: RunPlan) -> None:
    """This host's process of a GSPMD run: every local device, one program."""
    import torch_xla.runtime as xr

    from tpustream.runtime import SpmdRuntime

    cfg = plan.cfg
    xr.use_spmd()  # before anything asks the runtime about its devices
    replica_process(
        plan,
        xr.process_index(),
        xr.process_count(),
        lambda: SpmdRuntime(cfg.mesh, cfg.strategy, cfg.xla_cache_dir),
    )


# -- starting them -------------------------------------------------------------


def _spawn_xla(plan: RunPlan) -> None:
    import torch_xla.distributed.xla_multiprocessing as xmp  # after PJRT_DEVICE is set

    acc = plan.cfg.accelerator
    # xmp.spawn accepts nprocs None (a process per device; on CPU one child
    # process) or 1 (run in this process). CPU goes through a child like TPU
    # does, so the local run exercises the pod's code path.
    single = acc.in_process or (acc.device == Device.TPU and acc.num_devices == 1)
    try:
        xmp.spawn(xla_replica_main, args=(plan,), nprocs=1 if single else None)
    except (TpustreamError, Preempted):
        raise
    except Exception as exc:  # a bug in a replica, or BrokenProcessPool: the replica logged why
        raise TpustreamError(
            f"a replica failed ({exc.__class__.__name__}: {exc}); its error is logged above"
        ) from exc


def _spawn_spmd(plan: RunPlan) -> None:
    if plan.cfg.accelerator.in_process:
        spmd_replica_main(0, plan)
        return
    # A child, as xmp.spawn starts one on CPU: SPMD mode is for the whole
    # process, and this one (train.py) stays free to report and to forward stops.
    _start_processes(spmd_replica_main, (plan,), 1)


def _spawn_simulated_pod(plan: RunPlan) -> None:
    from tpustream.runtime.gloo import free_port

    world = plan.cfg.accelerator.num_devices
    _start_processes(simulated_replica_main, (plan, world, f"tcp://127.0.0.1:{free_port()}"), world)


def _spawn_native(plan: RunPlan) -> None:
    acc = plan.cfg.accelerator
    if acc.in_process:
        native_replica_main(0, plan, native_hosts(1))
        return
    per_node = native_processes(plan.cfg)
    _start_processes(native_replica_main, (plan, native_hosts(per_node)), per_node)


SPAWN = {"xla": _spawn_xla, "gloo": _spawn_simulated_pod, "spmd": _spawn_spmd, "native": _spawn_native}


def _start_processes(target: Callable[..., None], args: tuple, nprocs: int) -> None:
    """Run target(i, *args) in nprocs spawned processes; a replica's failure raised here as one line.

    If one fails, torch.multiprocessing terminates the others (which may be
    waiting for it in a collective) and raises here.
    """
    import torch.multiprocessing as mp

    try:
        mp.start_processes(target, args=args, nprocs=nprocs, start_method="spawn")
    except mp.ProcessRaisedException as exc:
        # The replica logged its error; its last traceback line names it.
        last = str(exc).strip().splitlines()[-1]
        error, _, message = last.partition(": ")
        if error == "tpustream.preemption.Preempted":
            raise Preempted(message) from None
        if error.startswith("tpustream.errors."):
            raise TpustreamError(f"replica {exc.error_index}: {message}") from None
        raise TpustreamError(
            f"replica {exc.error_index} failed ({last}); its traceback is logged above"
        ) from None
    except mp.ProcessExitedException as exc:
        raise TpustreamError(f"replica {exc.error_index} exited with code {exc.exit_code}") from None
