"""bench.feed's stock row: the same model and step fed by the stock webdataset + torchvision pipeline.

    python -m bench.feed.stock --shards DIR/train --out RUN [--workers 15] [--epochs 3] \
        [--model resnet50] [--image-size 224] [--batch-size 256] [--accelerator cuda]

The pipeline (what the issue measured tpustream against):
WebDataset(shards, shardshuffle=100) .shuffle(1000) .decode("pil")
.to_tuple("jpg", "cls") .map_tuple(Compose([RandomResizedCrop(size),
RandomHorizontalFlip(), PILToTensor()]), int) .batched(batch) in each
worker (a worker's last batch of an epoch is partial: every image is
trained), wds.WebLoader(batch_size=None, num_workers=N, pin_memory on a GPU,
persistent workers, prefetch_factor 4 as tpustream's data.prefetch_factor).
The uint8 batch is copied to the device (non_blocking) and normalised there
((x / 255 - mean) / std, ImageNet's), as tpustream's trainer does.

The step is train.py's with precision=bf16 and accelerator.channels_last=true:
the model from tpustream's registry (torchvision's ResNet-50 for resnet50),
channels_last weights and batches, bf16 autocast, cross-entropy, SGD with
momentum 0.9 and weight decay 1e-4, zero_grad(set_to_none=True).
cudnn.benchmark on, as accelerator.deterministic=false sets it.

RUN/metrics.jsonl gets one record an epoch with train.py's names:
global_rate (images trained / seconds, from asking for the first batch to
the device finishing the last step), train_seconds, train_samples and
input_wait_fraction (the share of those seconds the loop waited for a batch).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

# ImageNet's, as conf/data/imagenet.yaml.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
SHARD_SHUFFLE = 100
SHUFFLE_BUFFER = 1000
PREFETCH_FACTOR = 4
LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 1e-4


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.feed.stock", description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, required=True, help="the training split's folder (its *.tar)")
    parser.add_argument("--out", type=Path, required=True, help="run folder: metrics.jsonl goes here")
    parser.add_argument("--workers", type=int, default=15, help="WebLoader num_workers (default 15)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--model", default="resnet50", help="a tpustream model name (default resnet50)")
    parser.add_argument("--image-size", type=int, default=224, help="RandomResizedCrop's size")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--no-channels-last", dest="channels_last", action="store_false")
    parser.add_argument("--accelerator", choices=("cuda", "cpu_eager"), default="cuda")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1 (the batches are built in the workers)")
    return args


def make_loader(shards: list[str], args: argparse.Namespace, pin_memory: bool):
    """The stock chain (the module docstring), batches built in the workers."""
    import webdataset as wds
    from torchvision import transforms

    if args.workers > len(shards):
        raise SystemExit(f"--workers {args.workers}: only {len(shards)} shards, one worker would get none")
    transform = transforms.Compose(
        [
            transforms.RandomResizedCrop(args.image_size),
            transforms.RandomHorizontalFlip(),
            transforms.PILToTensor(),
        ]
    )
    dataset = (
        wds.WebDataset(shards, shardshuffle=SHARD_SHUFFLE)
        .shuffle(SHUFFLE_BUFFER)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(transform, int)
        .batched(args.batch_size, partial=True)
    )
    return wds.WebLoader(
        dataset,
        batch_size=None,
        num_workers=args.workers,
        pin_memory=pin_memory,
        persistent_workers=True,
        prefetch_factor=PREFETCH_FACTOR,
    )


def make_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from tpustream.models import create_model

    model = create_model(args.model, num_classes=args.num_classes, image_size=args.image_size, channels=3)
    model = model.to(device)
    return model.to(memory_format=torch.channels_last) if args.channels_last else model


class Step:
    """One training step on a uint8 batch already on the device."""

    def __init__(self, model: torch.nn.Module, args: argparse.Namespace, device: torch.device):
        self.model, self.device, self.channels_last = model, device, args.channels_last
        self.optimizer = torch.optim.SGD(
            model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY
        )
        self.bf16 = args.precision == "bf16"
        self.scale = (1.0 / (255.0 * torch.tensor(STD))).view(1, 3, 1, 1).to(device)
        self.bias = (-torch.tensor(MEAN) / torch.tensor(STD)).view(1, 3, 1, 1).to(device)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            logits = self.model(torch.addcmul(self.bias, images.float(), self.scale))
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        self.optimizer.step()
        return loss.detach()


def train_epoch(loader, step: Step, device: torch.device) -> dict:
    """One pass over the loader: its rate, as train.py's metrics.jsonl names it."""
    step.model.train()
    started = time.perf_counter()
    waited, samples, loss_sum = 0.0, 0, torch.zeros((), device=device)
    batches = iter(loader)
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        waited += time.perf_counter() - asked
        if batch is None:
            break
        images, labels = batch
        images = images.to(device, non_blocking=True)
        labels = torch.as_tensor(labels, dtype=torch.long).to(device, non_blocking=True)
        loss_sum += step(images, labels) * labels.shape[0]
        samples += int(labels.shape[0])
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the last steps' work counts in the epoch's time
    seconds = time.perf_counter() - started
    return {
        "global_rate": samples / seconds,
        "train_seconds": seconds,
        "train_samples": samples,
        "train_loss": loss_sum.item() / max(samples, 1),
        "input_wait_fraction": waited / seconds,
        "input_wait_seconds": waited,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    shards = sorted(str(path) for path in args.shards.glob("*.tar"))
    if not shards:
        raise SystemExit(f"{args.shards}: no *.tar shards")
    device = torch.device("cuda" if args.accelerator == "cuda" else "cpu")
    torch.backends.cudnn.benchmark = True
    loader = make_loader(shards, args, pin_memory=device.type == "cuda")
    step = Step(make_model(args, device), args, device)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "metrics.jsonl", "w") as metrics:
        for epoch in range(args.epochs):
            record = {"epoch": epoch, "stock": True, **train_epoch(loader, step, device)}
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            print(
                f"stock epoch {epoch}: {record['global_rate']:.1f} images/s, "
                f"{record['train_seconds']:.1f} s, waited {100 * record['input_wait_fraction']:.0f}%",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
