"""Feeding a GPU: the accelerator's own rate, a stock input pipeline and tpustream, side by side.

    python -m bench.feed                                  # one H100 with 16 vCPUs: ~5 minutes
    python -m bench.feed --workers 8,15 --stock-workers 15 --epochs 3 --data /tmp/feed --out DIR
    python -m bench.feed --quick --accelerator cpu_eager  # the script on 2 CPU cores, under 2 minutes
    python -m bench.feed --dry-run                        # the commands, nothing run

The issue's headline: ResNet-50 at 224, batch 256, bf16, channels_last, on
one H100 with 16 vCPUs, tpustream at 0.95 or more of data.synthetic's rate
and 1.7x or more of the stock pipeline's on the same shards.

Data (bench.feed.data): --num-images (13,000) ImageNet-like JPEGs, about
465x360 on average with some spread, quality 95, ~66 KB, cut from
scikit-learn's two sample photographs, labels index % 1000, as tar shards
of 500 samples with a tpustream manifest in --data/train (and 500 more in
--data/val), built by a Pool over every CPU (seconds on 16 vCPUs). A
folder made for the same settings is reused. The default --data is under
/tmp, outside the repository: a GPU run copies the working tree.
train.py's last.pt is deleted after each row (nothing reads it).

Rows, each its own process under its own --row-timeout (one failing leaves
the others' numbers), in this order:

    synthetic       train.py ... data.synthetic=true: the same step on one
                    batch kept on the GPU, no input pipeline: the
                    accelerator's own rate for this model, batch and precision.
    tpustream w=K   train.py data=imagenet data.root=DATA data.num_workers=K,
                    for each K in --workers (8,15).
    tpustream device w=K
                    the same with data.decode=device (nvJPEG on the GPU; the
                    workers only read bytes and draw crops), for each K in
                    --device-workers (4).
    stock w=K       bench.feed.stock with K WebLoader workers, for each K in
                    --stock-workers (15): webdataset WebDataset + .decode("pil")
                    + torchvision RandomResizedCrop(224) + RandomHorizontalFlip
                    + PILToTensor, batched in the workers, normalised on the
                    GPU, the same model and step (that module's docstring).

train.py's rows share accelerator=cuda model=resnet50 data.image_size=224
batch_size=256 precision=bf16 accelerator.channels_last=true eval_every=0
epochs=3 (the optimizer is data=imagenet's, SGD with momentum 0.9, as the
stock loop's). A row's rate is the mean images/s of its epochs after the
first (epoch 0 holds cuDNN's autotuning and the workers' start), from its
metrics.jsonl's global_rate; "of synthetic" divides it by synthetic's rate,
"of stock" by the fastest stock row's. input-bound is the run's own
input_bound_fraction (the GPU idle waiting for input, from CUDA events;
train.py only) and host wait its input_wait_fraction (the loop's wait for
a batch), both over the same epochs; "of it making" is its
input_making_share, the part of the loader's waits spent on batches whose
last piece the workers had not made yet (the rest came after: receiving,
the copy out of shared memory, decoding on the GPU). One difference in the clocks: train.py's
epoch ends when the CUDA event before its last step has passed
(observe.idle), the stock loop's after torch.cuda.synchronize(), so a
stock epoch also pays for its last step (under 2% at 51 steps an epoch).

--quick: 320 images of 10 classes, small_cnn at 64 px, batch 32, 2 epochs,
one worker a row. Outputs: the table printed, and results.json (every
number, the commands, the machine: os.cpu_count(), the affinity, the GPU,
library versions) with each row's run folder (metrics.jsonl, output.log)
under --out (default bench/results/feed/<time>).
"""
