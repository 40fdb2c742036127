"""bench.loaders' measurements: a row's rate and resume, each in a fresh process; a checkpoint on 2 ranks.

measure_rate (one row per library and worker count), on 1 rank, in a fresh
process (bench.loaders.task rate; its imports done before the clock starts):
    build the reader and read `warmup` batches, the first one's time from
    building it being "first batch" (workers starting, files opening), then
    time `measured` batches: images/s. At that step k = warmup + measured
    (half an epoch at the defaults) take the library's state: its size as the
    library hands it over (JSON bytes; pickle where it is not JSON; Grain's
    get_state is JSON bytes already).
    Then resume, in another fresh process (task resume), as after a
    preemption: the seconds from building a new reader through loading the
    state (load_state_dict / set_state, the new iterator) to its first batch.
    webdataset has no state: its resume reads and drops k batches.

measure_elastic (one per library), the global batch kept (2 x B, then 1 x 2B):
    one uninterrupted epoch on world 2, rank 0's state taken after k = half
    its steps as a checkpoint would (the run goes on, as training does after
    saving); then that state loaded on world 1 and read to the end of the
    epoch. The run that stopped at k read the epoch's first k batches of each
    rank, then the resumed ones. Against the uninterrupted epoch's sample
    counts: duplicated = samples read more often than it read them, missed =
    samples read less often (padding and repeats the library itself makes
    appear in both and cancel). A library that refuses the state says so.
    Ranks are readers in this process, one after the other, except where
    they must run at once (Reader.own_process: Mosaic streaming), each then a
    task process with the variables torchrun sets on one machine.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.loaders.data import LoaderData
from bench.loaders.libraries import Place, Reader

# How long one task process may take.
TASK_TIMEOUT = 600.0
# Lines of a failed task's output kept in its error.
TAIL_LINES = 5


@dataclass(frozen=True)
class Settings:
    """How much each measurement reads."""

    batch_size: int
    warmup: int  # batches read before the timing, the first included
    measured: int  # batches timed; the state is taken after warmup + measured
    elastic_workers: int
    seed: int = 0


class TaskFailed(RuntimeError):
    """A task process that ended without its result (its output's last lines in the message)."""


def state_size(state: Any, has_state: bool) -> tuple[int | None, str]:
    """(bytes, how serialised) of a state as the library hands it over; (None, "none") without one."""
    if not has_state:
        return None, "none"
    if isinstance(state, bytes):
        return len(state), "json bytes"
    try:
        return len(json.dumps(state).encode()), "json"
    except TypeError:
        return len(pickle.dumps(state)), "pickle"


def describe_error(error: BaseException) -> str:
    """The exception's type and first line: what a table cell can hold."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


# ---------------------------------------------------------------- in the task process


def read_rate(reader_class: type[Reader], data: LoaderData, place: Place, settings: Settings) -> dict:
    """The rate row on this process (task rate): first batch, images/s, and the state at step k."""
    started = time.perf_counter()
    reader = reader_class(data, place)
    try:
        reader.start()
        reader.next_batch()
        first = time.perf_counter() - started
        for _ in range(settings.warmup - 1):
            reader.next_batch()
        timed = time.perf_counter()
        images = sum(reader.next_batch()[0] for _ in range(settings.measured))
        seconds = time.perf_counter() - timed
        state = reader.state()
    finally:
        reader.close()
    size, serialised = state_size(state, reader_class.has_state)
    return {
        "workers": place.workers,
        "batch_size": place.batch_size,
        "first_batch_seconds": first,
        "images": images,
        "seconds": seconds,
        "images_per_second": images / seconds,
        "images_per_second_per_worker": images / seconds / max(place.workers, 1),
        "state_step": settings.warmup + settings.measured,
        "state_bytes": size,
        "state_format": serialised,
        "state": state,
    }


def read_resumed(reader_class: type[Reader], data: LoaderData, place: Place, state: Any) -> float:
    """Seconds from building a reader and loading `state` to its first batch (task resume)."""
    started = time.perf_counter()
    reader = reader_class(data, place)
    try:
        reader.start(state)
        reader.next_batch()
        return time.perf_counter() - started
    finally:
        reader.close()


@dataclass
class Phase:
    """What one rank read in one epoch: image indices, how many before the checkpoint, its state there."""

    ids: list[int] = field(default_factory=list)
    read_before_checkpoint: int = 0
    state: Any = None
    error: str | None = None


def read_epoch(
    reader_class: type[Reader], data: LoaderData, place: Place, checkpoint: int | None, state: Any
) -> Phase:
    """Read to the end of the epoch (from `state` if given), taking the state after `checkpoint` batches.

    An error (the library refusing the state, say) is kept in the result, not raised.
    """
    phase, reader, read = Phase(), None, 0
    try:
        reader = reader_class(data, place)
        reader.start(state)
        while True:
            if read == checkpoint:
                phase.state, phase.read_before_checkpoint = reader.state(), len(phase.ids)
            try:
                _, ids = reader.next_batch()
            except StopIteration:
                break
            phase.ids += ids.tolist()
            read += 1
        if checkpoint is not None and read < checkpoint:
            raise AssertionError(f"the epoch ended at batch {read}, before the checkpoint at {checkpoint}")
    except Exception as error:  # the library's own refusal is the result
        phase.error = describe_error(error)
    finally:
        if reader is not None:
            reader.close()
    return phase


# ---------------------------------------------------------------- in the parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_tasks(
    task: str, reader_class: type[Reader], data: LoaderData, places: list[Place], **inputs: Any
) -> list[Any]:
    """`python -m bench.loaders.task` once per place, all at once; each one's result, in order.

    inputs (settings, checkpoint, state) travel pickled. With more than one
    place the processes are ranks of one world: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE (one node) and a MASTER_ADDR / MASTER_PORT are set as
    torchrun sets them, for the libraries that read them.
    """
    reader_class.clean_up()
    port = str(free_port())
    with tempfile.TemporaryDirectory(prefix="bench-loaders-") as folder:
        inputs_path = Path(folder, "inputs.pickle")
        inputs_path.write_bytes(pickle.dumps(inputs))
        started = []
        for place in places:
            out, log = Path(folder, f"rank{place.rank}.pickle"), Path(folder, f"rank{place.rank}.log")
            command = [
                sys.executable,
                "-m",
                "bench.loaders.task",
                task,
                f"--library={reader_class.name}",
                f"--data={data.root}",
                f"--place={json.dumps(asdict(place))}",
                f"--inputs={inputs_path}",
                f"--out={out}",
            ]
            rank, world = str(place.rank), str(place.world)
            environment = os.environ | {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world}
            environment |= {"LOCAL_WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            # Mosaic streaming leaves a file lock per dataset in the temporary folder: this one goes away.
            environment["TMPDIR"] = folder
            with open(log, "wb") as output:
                process = subprocess.Popen(command, env=environment, stdout=output, stderr=subprocess.STDOUT)
            started.append((process, out, log))
        wait_for(process for process, _, _ in started)
        results = []
        for process, out, log in started:
            if not out.exists():
                tail = " / ".join(log.read_text(errors="replace").strip().splitlines()[-TAIL_LINES:])
                raise TaskFailed(
                    f"{task} task of {reader_class.name}, exit code {process.returncode}: {tail}"
                )
            results.append(pickle.loads(out.read_bytes()))
        return results


def wait_for(processes: Iterable[subprocess.Popen]) -> None:
    """Until every process has ended; once one fails (or TASK_TIMEOUT passes), the others are killed:
    ranks waiting at a barrier for a rank that died would wait out the timeout."""
    running, deadline = list(processes), time.monotonic() + TASK_TIMEOUT
    while running:
        failed = any(process.poll() not in (None, 0) for process in running)
        if failed or time.monotonic() > deadline:
            for process in running:
                if process.poll() is None:
                    process.kill()
                process.wait()
            return
        running = [process for process in running if process.poll() is None]
        time.sleep(0.1)


def measure_rate(reader_class: type[Reader], data: LoaderData, workers: int, settings: Settings) -> dict:
    """One row: its rate and state (task rate), then the resume from that state (task resume)."""
    place = Place(0, 1, settings.batch_size, workers, settings.seed)
    [row] = run_tasks("rate", reader_class, data, [place], settings=settings)
    state = row.pop("state")
    [row["resume_seconds"]] = run_tasks("resume", reader_class, data, [place], state=state)
    row["resume_how"] = "load state" if reader_class.has_state else "read and drop k batches"
    return row


def run_ranks(
    reader_class: type[Reader],
    data: LoaderData,
    places: list[Place],
    checkpoint: int | None,
    state: Any = None,
) -> list[Phase]:
    """An epoch on every rank: in this process one rank after another, or all at once in their own."""
    if reader_class.own_process:
        return run_tasks("epoch", reader_class, data, places, checkpoint=checkpoint, state=state)
    return [read_epoch(reader_class, data, place, checkpoint, state) for place in places]


def measure_elastic(reader_class: type[Reader], data: LoaderData, settings: Settings) -> dict:
    """Duplicated and missed samples across a checkpoint on 2 ranks at half an epoch and a resume on 1."""
    batch, workers, seed = settings.batch_size, settings.elastic_workers, settings.seed
    two = [Place(rank, 2, batch, workers, seed) for rank in range(2)]
    one = [Place(0, 1, 2 * batch, workers, seed)]
    checkpoint = data.spec.images // (2 * batch) // 2
    started = time.perf_counter()
    epoch = run_ranks(reader_class, data, two, checkpoint, None)
    errors = [f"on 2 ranks: {phase.error}" for phase in epoch if phase.error]
    if not errors:
        resumed = run_ranks(reader_class, data, one, None, epoch[0].state)[0]
        errors += [f"resume on 1 rank: {resumed.error}"] if resumed.error else []
    result: dict[str, Any] = {
        "checkpoint_step": checkpoint,
        "global_batch": 2 * batch,
        "workers": workers,
        "seconds": time.perf_counter() - started,
    }
    if errors:
        return result | {"error": errors[0]}
    expected = Counter(i for phase in epoch for i in phase.ids)
    before = [i for phase in epoch for i in phase.ids[: phase.read_before_checkpoint]]
    seen = Counter(before + resumed.ids)
    return result | {
        "images": data.spec.images,
        "epoch_samples": sum(expected.values()),
        "epoch_distinct": len(expected),
        "read_before_checkpoint": len(before),
        "read_after_resume": len(resumed.ids),
        "duplicated": sum((seen - expected).values()),
        "missed": sum((expected - seen).values()),
    }
