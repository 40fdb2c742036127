"""Quick: tpustream ShardStream (canonical partition, as the trainer) -> consumer (join+pin) scaling."""
import os, sys, time, resource, dataclasses, json
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.environ.get("SRC", os.path.join(REPO, "src")); sys.path.insert(0, REPO); sys.path.insert(0, SRC)
import numpy as np, torch
import webdataset as wds
from bench.pipeline.imagenet_data import make_photos, SPLIT_OPTIONS
from tpustream.config import DataConfig
from tpustream.data.resolve.split import load_split
from tpustream.data.read.stream import ShardStream
from tpustream.data.read.loader import make_loader
try:
    from tpustream.data.read.plan import choose_partition
except ImportError:
    from tpustream.data.read.partition import choose_partition

def main():
    N = int(os.environ.get("N", 2048)); B = int(os.environ.get("B", 128))
    root = f"/tmp/exp/data{N}"
    if not os.environ.get("ROOT") and not os.path.exists(root):
        photos = make_photos(N, 0)
        os.makedirs(root)
        with wds.ShardWriter(os.path.join(root, "t-%06d.tar"), maxcount=128, verbose=0) as sink:
            for i, p in enumerate(photos):
                sink.write({"__key__": f"{i:07d}", "jpg": p.data, "cls": i % 10})
    if os.environ.get("ROOT"):
        from tpustream.data.resolve.options import SplitOptions
        split = load_split(os.environ["ROOT"], "train", SplitOptions(image_size=224, crop=True, label_key="cls", progress=False))
    else:
        split = load_split(root, "train", SPLIT_OPTIONS)

    global cpu
    def cpu(pid="self"):
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")

    for W in [int(w) for w in sys.argv[1:]]:
        data = dataclasses.replace(DataConfig(), num_workers=W, shuffle_buffer=1000, last_batch="drop", hflip=True,
                                   train_crop="random_resized", image_size=224)
        try:
            from tpustream.data.read.partition import choose_partition as choose
        except ImportError:
            choose = choose_partition
        part = choose("auto", 1, B, W, len(split.shards), 1000)
        stream = ShardStream(split, data, batch_size=B, rank=0, world_size=1, train=True, seed=0, partition=part)
        loader = make_loader(stream, W)
        loader.start_workers()
        for epoch in range(int(os.environ.get("E", 2))):
            loader.set_epoch(epoch)
            it = iter(loader); first = next(it)
            t0 = time.perf_counter(); c0 = cpu(); n = 0; dst = None
            for batch in it:
                if "old" in SRC: dst = torch.empty_like(batch["image"]) if dst is None else dst; dst.copy_(batch["image"])
                n += len(batch["label"])
            dt = time.perf_counter() - t0; dc = cpu() - c0
        print(f"W={W} streams={part.streams if part else None} {n/dt:.0f} img/s, per worker {n/dt/max(W,1):.0f}, main cpu {dc/dt:.2f} cores, {1000*dc/(n/B):.1f} ms/batch", flush=True)
        loader.close()

if __name__ == '__main__':
    main(); os._exit(0)
