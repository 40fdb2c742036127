"""One bench.loaders measurement in a fresh process, its imports done before any clock starts.

    python -m bench.loaders.task rate --library tpustream --data DIR --place '{"rank": 0, ...}' \
        --inputs INPUTS.pickle --out RESULT.pickle

Started by bench.loaders.measure.run_tasks, which pickles the inputs
(settings, checkpoint, state) and reads the result back:

    rate    measure.read_rate: first batch, images/s, the state at step k
    resume  measure.read_resumed: seconds from a new reader and the state to its first batch
    epoch   measure.read_epoch: one rank's epoch (RANK, WORLD_SIZE, ... set by the parent)

Each runs in a new process as it would after a preemption: a library's
start-up (a fork server, spawned workers) is paid again, as it would be.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.loaders.data import DataSpec, LoaderData, read_record
from bench.loaders.libraries import READERS, Place
from bench.loaders.measure import read_epoch, read_rate, read_resumed

TASKS = ("rate", "resume", "epoch")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loaders.task", description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=TASKS)
    parser.add_argument("--library", choices=sorted(READERS), required=True)
    parser.add_argument("--data", type=Path, required=True, help="a folder bench.loaders.data made")
    parser.add_argument("--place", type=json.loads, required=True, help="libraries.Place as JSON")
    parser.add_argument("--inputs", type=Path, required=True, help="the task's inputs, pickled")
    parser.add_argument("--out", type=Path, required=True, help="its result, pickled")
    args = parser.parse_args(argv)
    record = read_record(args.data)
    if record is None:
        parser.error(f"{args.data}: no bench.loaders data there")
    data = LoaderData(args.data, DataSpec(**record["spec"]))
    reader_class, place = READERS[args.library], Place(**args.place)
    inputs = pickle.loads(args.inputs.read_bytes())
    reader_class.prepare()
    if args.task == "rate":
        result = read_rate(reader_class, data, place, inputs["settings"])
    elif args.task == "resume":
        result = read_resumed(reader_class, data, place, inputs["state"])
    else:
        result = read_epoch(reader_class, data, place, inputs["checkpoint"], inputs["state"])
    args.out.write_bytes(pickle.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
