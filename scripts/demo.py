"""The main job on the embedded default, against a local GCS emulator.

    bash scripts/bootstrap.sh && .venv/bin/python scripts/demo.py

1. starts fake-gcs-server on 127.0.0.1 and creates the bucket gs://tpustream-demo,
2. writes the digits shards into it (tpustream-make-shards digits gs://tpustream-demo/digits),
3. runs train.py on the XLA CPU device, streaming the shards from the bucket and
   writing checkpoints/best.pt, checkpoints/last.pt, config.yaml and metrics.jsonl
   to gs://tpustream-demo/runs/demo,
4. reads best.pt back from the bucket and prints its validation accuracy.

The emulator keeps the bucket in memory; it is gone when the demo ends.
Extra arguments are passed to train.py as Hydra overrides (e.g. epochs=5).
"""

import os
import subprocess
import sys
import time

from tpustream import storage
from tpustream.checkpoint import BEST, checkpoint_url, load_checkpoint
from tpustream.data.write.command import main as make_shards_main
from tpustream.testing.emulator import GcsEmulator
from tpustream.training.epoch_report import EpochRecord

BUCKET = "tpustream-demo"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    started = time.time()
    with GcsEmulator() as server:  # sets STORAGE_EMULATOR_HOST for us and train.py
        print(f"GCS emulator at {server.url}; creating gs://{BUCKET}", flush=True)
        storage.make_container(f"gs://{BUCKET}")
        if make_shards_main(["digits", f"gs://{BUCKET}/digits", "--no-progress"]) != 0:
            return 1
        run = f"gs://{BUCKET}/runs/demo"
        command = [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            f"data.root=gs://{BUCKET}/digits",
            f"output_dir={run}",
            f"hydra.run.dir={os.path.join(ROOT, 'outputs', 'demo', time.strftime('%Y-%m-%d_%H-%M-%S'))}",
            *sys.argv[1:],
        ]
        print("$ " + " ".join(command[1:]), flush=True)
        if subprocess.call(command) != 0:
            return 1
        print(f"\nobjects in {run}:")
        for folder in (run, storage.join(run, "checkpoints"), storage.join(run, "tensorboard")):
            for name in storage.list_names(folder):
                url = storage.join(folder, name)
                print(f"  {url}  ({len(storage.read_bytes(url)):,} bytes)")
        best_url = checkpoint_url(run, BEST)
        best = load_checkpoint(best_url)
        history = {r.epoch: r for r in map(EpochRecord.from_dict, best["history"])}
        record = history[best["epoch"]]
        print(
            f"\n{best_url}: epoch {best['epoch']}, test accuracy "
            f"{100 * best['best_accuracy']:.2f}% ({record.val_correct}/{record.val_samples} "
            f"digits images); demo took {time.time() - started:.0f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
