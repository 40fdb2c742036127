"""What to change, from a run's epoch records: one short line per finding, only when it applies.

The same findings at a run's end (the trainer logs them after its first
measured epoch and when it finishes) and in ``tpustream-report``, which also
compares runs (``advise_runs``). Epoch 0 is left out when later epochs exist:
it compiles and starts the loaders' workers. Input-bound is judged from the
best evidence there is: the run's rate against its synthetic rate, then the
device's own idle time, then the training thread's wait for batches, which
alone cannot tell a starved device from a busy one (measured: a run at 98%
of its GPU's own rate waited 29% of the time for batches).

A resumed run is several processes: each counts its compilations from 0 and
compiles its graphs once, and the epoch it resumed in carries its start in its
rate. ``process_epochs`` reads the records per process, so neither is taken
for a recompilation or a steady rate (a run stopped five times was told it
was compile-bound). A finding names only changes the run has not made.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# A loop waiting for input more than this share of its time is input-bound.
INPUT_BOUND = 0.2
# Saving checkpoints for more than this share of the epoch is worth a look.
CHECKPOINT_HEAVY = 0.1
# Headroom on the suggested worker count: the measured rates move from epoch to epoch.
WORKER_MARGIN = 1.25
# A run this close to its synthetic rate (data.synthetic=true: the same step fed from one
# device-resident batch) has nothing left to gain from its input.
SYNTHETIC_ENOUGH = 0.95
# Below this share of the loader's waits spent on batches not yet made (observe.timing.BatchWaits),
# the workers were ahead: the replica's process delivered made batches late.
MADE_LATE = 0.5
# Steady rates of one configuration move by a few percent from run to run; a smaller gap
# between two runs is not "slower".
SLOWER_BY = 0.03
WORKERS_KEY = "data.num_workers"
# Keys in which every run differs from every other and which say nothing about its speed.
RUN_FOLDERS = ("output_dir", "log_dir")


@dataclass(frozen=True)
class EpochProcess:
    """What an epoch record says once read beside the records before it, per process.

    compiles: graphs compiled in the epoch (a process's whole count in its first
    record). started: the epoch's training loop was its process's first (the
    run's start or a resume): its rate and waits include compiling and starting
    the loaders. recompiles: compiles that were not a process's first of a
    kind (its first training loop, its first evaluation).
    """

    compiles: int | None
    started: bool
    recompiles: int
    process_start: bool  # the process that ended the epoch started in it


def process_epochs(records: Sequence[Mapping[str, Any]]) -> list[EpochProcess]:
    """Each record per process: what it compiled, whether its process started in it, what it recompiled.

    `compilations` is the running count of the process that ended the epoch
    (`process`, where the record names it; else a record with setup_seconds,
    or a count below the previous one, starts a process). The training loop
    may have run in the process before (`train_process`: a stop between the
    training and the evaluation). A process compiles its training graphs in
    its first loop and its evaluation graphs in its first evaluation (later
    with eval_every > 1): an epoch with one of them is not judged.
    """
    epochs: list[EpochProcess] = []
    trained: set[str] = set()  # processes whose training loop an earlier record names
    evaluated: set[str] = set()  # processes that ended an evaluated epoch before
    previous: Mapping[str, Any] | None = None
    segment = 0  # processes so far, for records that do not name theirs
    for record in records:
        total, process = record.get("compilations"), record.get("process")
        before = None if previous is None else previous.get("compilations")
        if previous is None:
            new_process = True
        elif process is not None and previous.get("process") is not None:
            new_process = process != previous["process"]
        else:
            fewer = total is not None and before is not None and total < before
            new_process = record.get("setup_seconds") is not None or fewer
        segment += new_process
        ended_by = process or f"#{segment}"
        trained_by = record.get("train_process") or ended_by
        first_loop = trained_by not in trained
        first_evaluation = record.get("val_accuracy") is not None and ended_by not in evaluated
        trained.add(trained_by)
        if record.get("val_accuracy") is not None:
            evaluated.add(ended_by)
        if total is None:
            compiles = None
        elif new_process or before is None:
            compiles = total
        else:
            compiles = total - before
        first_graphs = new_process or (first_loop and trained_by == ended_by) or first_evaluation
        recompiles = compiles if compiles and compiles > 0 and not first_graphs else 0
        epochs.append(EpochProcess(compiles, first_loop, recompiles, new_process))
        previous = record
    return epochs


def measured(records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The epochs that show steady state: all but those a process started in, where others exist.

    That is epoch 0 and, in a resumed run, the first epoch each process trained
    or ended; with nothing else left, all but epoch 0 (or epoch 0 alone).
    """
    epochs = process_epochs(records)
    steady = [r for r, e in zip(records, epochs, strict=True) if not (e.started or e.process_start)]
    if steady:
        return steady
    return list(records[1:]) if len(records) > 1 else list(records)


def usable_cpus() -> int:
    """The vCPUs this process may run on: its affinity (a container's cpuset, taskset), not the machine's.

    os.cpu_count() counts the whole machine, so on a host shared by pinned
    jobs or a container given 8 of 64 cores it would size workers for cores
    the run cannot use.
    """
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def host_worker_cap(cpus: int, local_replicas: int | None = None) -> int:
    """The most loader workers one replica can use on this host: its share of the vCPUs, less one.

    The one left is the replica's own loop (tracing, stepping, collating).
    Workers beyond that take turns on the same vCPUs with each other and with
    the loop: on a 16-vCPU H100 host 12 workers ran 5% slower than 4.
    The advice and data.num_workers=auto both cap by this, so they agree.
    """
    return max(1, cpus // max(local_replicas or 1, 1) - 1)


def suggested_workers(workers: int, wait_fraction: float) -> int:
    """Workers for the input to keep up with the device.

    Waiting a share f of the loop, the input delivers 1 - f of what the
    device could take; workers scale the input about linearly (each decodes
    its own batches), so W / (1 - f) workers, with a margin (W = 0: the main
    process counts as one).
    """
    current = max(workers, 1)
    return max(current + 1, math.ceil(current * WORKER_MARGIN / max(1.0 - wait_fraction, 0.05)))


@dataclass(frozen=True)
class SavingSettings:
    """The run's checkpoint.* keys the saving advice reads (None: unknown, e.g. an older config.yaml)."""

    every_n_steps: int | None = None
    asynchronous: bool | None = None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SavingSettings:
        """From a run's config.yaml (its checkpoint section)."""
        section = config.get("checkpoint") or {}
        return cls(section.get("every_n_steps"), section.get("asynchronous"))


@dataclass(frozen=True)
class Host:
    """The training host as far as the caller knows it: its vCPUs and the replicas sharing them."""

    cpus: int | None = None
    local_replicas: int | None = None

    def described(self) -> str:
        replicas = self.local_replicas or 1
        return f"{self.cpus} vCPUs" + (f" for {replicas} replicas" if replicas > 1 else "")


def mean_of(records: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """The mean of a field over the records that have it (None: none has)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def advise(
    records: Sequence[Mapping[str, Any]],
    num_workers: int | None = None,
    cpus: int | None = None,
    shards_per_replica: float | None = None,
    max_workers: int | None = None,
    *,
    local_replicas: int | None = None,
    synthetic_rate: float | None = None,
    gpu_could_decode: bool = False,
    gpu_decodes: bool = False,
    saving: SavingSettings | None = None,
) -> list[str]:
    """Findings for these epoch records (metrics.jsonl lines); the run's settings when known.

    cpus and local_replicas: the training host's vCPUs and the replicas sharing
    them (None: unknown, e.g. read later by tpustream-report). max_workers: the
    most workers a replica may have (its canonical streams). synthetic_rate:
    samples/s of the same configuration with data.synthetic=true.
    gpu_could_decode: the run's workers decode JPEG crops for a GPU
    (data.decode=device would leave that to the GPU). gpu_decodes: it runs with
    data.decode=device (the replica's receiving thread decodes). saving: its
    checkpoint.* keys, so the advice never asks for what is already set.
    """
    steady = measured(records)
    if not steady:
        return []
    findings = []
    host = Host(cpus, local_replicas)
    starved = input_finding(steady, synthetic_rate)
    if starved is not None:
        finding, share = starved
        making = mean_of(steady, "input_making_share")
        if share is not None and making is not None and making < MADE_LATE:
            finding += "; " + delivery_finding(making, gpu_decodes)
        elif share is not None:
            finding += "; " + worker_change(
                num_workers, share, host, shards_per_replica, max_workers, gpu_could_decode
            )
        findings.append(finding)
    compiled = compile_finding(records)
    if compiled is not None:
        findings.append(compiled)
    saved = saving_finding(steady, saving or SavingSettings())
    if saved is not None:
        findings.append(saved)
    return findings


def compile_finding(records: Sequence[Mapping[str, Any]]) -> str | None:
    """Graphs a process compiled again after its first ones (process_epochs); None when none was."""
    epochs = process_epochs(records)
    again = [(r["epoch"], e.recompiles) for r, e in zip(records, epochs, strict=True) if e.recompiles]
    if not again:
        return None
    after = "epoch 0" if sum(e.process_start for e in epochs) == 1 else "its process's first epoch"
    return (
        f"compile-bound: {sum(count for _, count in again)} graph(s) compiled after {after} "
        f"(by epoch {again[0][0]}); a shape or a constant changed: debug.metrics=true names the step"
    )


def saving_finding(steady: Sequence[Mapping[str, Any]], settings: SavingSettings) -> str | None:
    """What the loop waited for saves, if it is worth a look: what the wait was, and only changes not made.

    The wait's parts (training.saving.SaveSeconds): the state's copy to host
    memory, which every save costs the loop whether it is written in the
    background or not; the wait for the background writer's previous save;
    and the rest, writing synchronously. The background writing itself is
    not waited for (older records: checkpoint_seconds, no parts).
    """
    shares = []
    for record in steady:
        stall = record.get("checkpoint_stall_seconds", record.get("checkpoint_seconds"))
        if stall is not None and record.get("epoch_seconds"):
            shares.append((stall / record["epoch_seconds"], stall, record))
    if not shares or max(share for share, *_ in shares) <= CHECKPOINT_HEAVY:
        return None
    share, stall, worst = max(shares, key=lambda entry: entry[0])
    finding = f"host-bound: training waited for checkpoints up to {100 * share:.0f}% of an epoch"
    every, asynchronous = settings.every_n_steps, settings.asynchronous
    fewer = (
        "raise checkpoint.every_n_steps (or 0: epoch ends only)"
        if every is None
        else f"raise checkpoint.every_n_steps from {every} (or 0: epoch ends only)"
        if every > 0
        else None  # already 0: only the epoch ends save
    )
    copy, writer_wait = worst.get("checkpoint_copy_seconds"), worst.get("checkpoint_writer_wait_seconds")
    if copy is None or writer_wait is None or stall <= 0:
        parts, wait = "", "writing"
    else:
        writing = max(0.0, stall - copy - writer_wait)
        wait = max((copy, "copy"), (writer_wait, "writer"), (writing, "writing"))[1]
        most = {"copy": copy, "writer": writer_wait, "writing": writing}[wait] / stall
        parts = (
            ", "
            + {
                # Measured on the digits (XLA CPU device, a save every 3 steps, 2026-11-28): the
                # transfer took 4-11 ms of each 100-230 ms copy, the rest the device running the
                # queued steps; the loop waited about 1 s an epoch in copies, yet its epochs took
                # 3.96 s against 3.88 s with no saves (two runs each, a shared 2-vCPU host).
                "copy": f"{100 * most:.0f}% of it in the state's copy to host memory, which every save "
                "makes, written in the background or not; the copy first waits for the device to run "
                "the steps queued before it, work the epoch does anyway, so it may lose much less",
                "writer": f"{100 * most:.0f}% of it for the background writer to finish the previous "
                "save: saves came faster than it wrote them",
                "writing": f"{100 * most:.0f}% of it for writing saves synchronously"
                + (
                    " (checkpoint.asynchronous=false)"
                    if asynchronous is False
                    else " (a state over checkpoint.asynchronous_max_bytes or the memory available)"
                    if asynchronous
                    else ""
                ),
            }[wait]
        )
    changes = [change for change in [fewer] if change]
    if wait != "copy":
        if asynchronous is False:
            changes.append("turn checkpoint.asynchronous on (the writing then overlaps training)")
        elif asynchronous is None and not parts:
            changes.append("turn checkpoint.asynchronous on if it is off")
        changes.append("save to a closer bucket")
    if not changes:  # a copy at each epoch's end alone: nothing in checkpoint.* makes it cheaper
        return f"{finding}{parts}; checkpoint.every_n_steps=0 already saves at epoch ends only"
    listed = changes[0] if len(changes) == 1 else ", ".join(changes[:-1]) + f", or {changes[-1]}"
    return f"{finding}{parts}: {listed}"


def input_finding(
    steady: Sequence[Mapping[str, Any]], synthetic_rate: float | None
) -> tuple[str, float | None] | None:
    """Whether the run is input-bound, and by which figure; None when there is nothing to say.

    Returns the finding and the share of the loop the device lacked input
    (None: not input-bound, and the finding says why not, against a wait that
    looked like it). The finding names its figure: the device's idle time
    (input_bound_fraction) says what the device did; the training thread's
    wait (input_wait_fraction) is host-side, and a thread blocked on the
    loader's queue while the device runs the steps already queued costs nothing.
    """
    device = mean_of(steady, "input_bound_fraction")
    thread = mean_of(steady, "input_wait_fraction")
    waited = worst = ""
    if thread is not None:
        waited = f"the training thread waited for batches {100 * thread:.0f}% of the time"
        slowest = max(thread, *(r.get("input_wait_fraction_worst") or 0.0 for r in steady))
        worst = f"worst replica {100 * slowest:.0f}%"
    if device is not None:
        share, figure = device, f"the device sat idle waiting for input {100 * device:.0f}% of the loop"
    else:
        share, figure = thread, f"{waited} ({worst}; host-side: the device may have been busy)"
    starved = share is not None and share > INPUT_BOUND
    looked_starved = starved or (thread is not None and thread > INPUT_BOUND)
    rate = mean_of(steady, "global_rate")
    if synthetic_rate and rate:
        reached = (
            f"the run reached {100 * rate / synthetic_rate:.0f}% of its synthetic rate "
            f"({rate:.0f} of {synthetic_rate:.0f} samples/s with data.synthetic=true)"
        )
        if rate >= SYNTHETIC_ENOUGH * synthetic_rate:
            if not looked_starved:
                return None
            though = figure if device is not None and starved else f"{waited} ({worst})"
            return f"not input-bound: {reached}, though {though}; more workers cannot make it faster", None
        figure += f"; {reached}"
    if not starved:
        if looked_starved:  # the thread waited, but the device's own figure says it was busy
            return (
                f"not input-bound: the device sat idle waiting for input only {100 * share:.0f}% of the "
                f"loop, though {waited} ({worst}): the device was busy meanwhile; more workers cannot "
                "make it faster"
            ), None
        return None
    return f"input-bound: {figure}", share


def delivery_finding(making: float, gpu_decodes: bool = False) -> str:
    """An input-bound run whose workers had made most of the batches it waited for."""
    return (
        f"the workers were not what it waited for: {100 * (1 - making):.0f}% of the loader's waits "
        "came after a batch's last piece was made (its delivery in the replica's process: receiving "
        "the pieces, the copy out of shared memory, decoding on the device), so more workers cannot "
        "help; "
        + (
            "with data.decode=device that process decodes every JPEG: data.decode=host leaves the "
            "decoding to the workers; "
            if gpu_decodes
            else ""
        )
        + "debug.profile_steps shows where that process spends the time (docs/watching.md)"
    )


def worker_change(
    num_workers: int | None,
    share: float,
    host: Host,
    shards_per_replica: float | None,
    max_workers: int | None,
    gpu_could_decode: bool = False,
) -> str:
    """What to change for an input-bound run: more workers, within what the host and the data allow.

    Never more workers than the vCPUs the host gives a replica, less one for
    its loop (host_worker_cap); where that is reached, what can still help.
    """
    if num_workers is None:
        return "raise data.num_workers, or store fewer bytes per sample"
    wanted = suggested_workers(num_workers, share)
    cap = host_worker_cap(host.cpus, host.local_replicas) if host.cpus else None
    target = min(limit for limit in (wanted, cap, max_workers) if limit is not None)
    if target <= num_workers:
        if cap is not None and cap <= num_workers:
            more = "already uses" if num_workers == cap else "is more than"
            fewer = f", and fewer ({cap}) may be faster" if num_workers > cap else ""
            return (
                f"data.num_workers={num_workers} {more} the {cap} vCPU(s) this host spares a replica "
                f"({host.described()}, one kept for each replica's loop): more workers cannot help on "
                f"this host{fewer}; store fewer bytes per sample, set data.in_memory=true if the split "
                "fits in memory, or use a host with more vCPUs"
                + (
                    "; or let the GPU decode the JPEGs (data.decode=device: the workers then only read "
                    "them and draw the crops)"
                    if gpu_could_decode
                    else ""
                )
            )
        return (
            f"data.num_workers={num_workers} is the most the run's canonical streams allow a replica: "
            "start the next run with more data.streams, or store fewer bytes per sample"
        )
    if cap is None:  # read later (tpustream-report): the training host's vCPUs are unknown there
        room = f" (if the training host has {target + 1} vCPUs per replica: one stays for its loop)"
    elif target == cap:
        room = f" (the most: this host has {host.described()}, one kept for each replica's loop)"
    else:
        room = f" (this host has {host.described()})"
    if target == max_workers and target < wanted:
        room += f"; at most {max_workers}, the canonical streams each replica reads"
    shards = ""
    if shards_per_replica is not None and target > shards_per_replica:
        # A worker reads whole shards; more workers than shards split them by sample ranges,
        # each reading (and skipping) the others' samples: more bytes, not more rate.
        shards = (
            f"; a replica has {shards_per_replica:g} shard(s) for {target} workers: write at "
            f"least {target} shards per replica first"
        )
    about = "about " if target == wanted else ""
    return (
        f"raise data.num_workers from {num_workers} to {about}{target}{room}, or store fewer bytes "
        f"per sample{shards}"
    )


def advise_runs(runs: Sequence[tuple[Mapping[str, Any], Sequence[Mapping[str, Any]]]]) -> list[str]:
    """Findings across runs, each given as (its flattened config, its epoch records).

    Runs alike in everything but data.num_workers are compared by their
    steady rate: where one with more workers was slower than one with fewer,
    adding workers was the wrong way on that host, whatever a single run's
    wait for input suggested.
    """
    ignored = {WORKERS_KEY, *RUN_FOLDERS}
    groups: dict[str, list[tuple[int, float]]] = {}
    for config, records in runs:
        workers, rate = config.get(WORKERS_KEY), mean_of(measured(records), "global_rate")
        # A synthetic run (data.synthetic) trains from the device alone: its workers idle.
        synthetic = any(r.get("synthetic") for r in records)
        if isinstance(workers, bool) or not isinstance(workers, int) or rate is None or synthetic:
            continue
        rest = repr(sorted((key, repr(value)) for key, value in config.items() if key not in ignored))
        groups.setdefault(rest, []).append((workers, rate))
    findings = []
    for group in groups.values():
        fastest_workers, fastest = max(group, key=lambda run: run[1])
        slower = sorted((w, r) for w, r in group if w > fastest_workers and r < fastest * (1 - SLOWER_BY))
        if slower:
            ran = " and ".join(f"data.num_workers={w} ran at {r:.0f} samples/s" for w, r in slower)
            findings.append(
                f"too many workers: {ran}, slower than data.num_workers={fastest_workers} at "
                f"{fastest:.0f}: more workers compete for the host's vCPUs (and with each replica's "
                f"loop); data.num_workers={fastest_workers} is the faster choice on that host"
            )
    return findings
