"""The cost of tpustream's on-device augmentation (issue 21): host images/s on and off, device step time.

Reproduce (from the repository root; 2 cores, no accelerator, XLA on the CPU):

    .venv/bin/python -m bench.augment           # ~10-12 min -> bench/results/augment/results.json
    .venv/bin/python -m bench.augment --quick   # ~3.5 min idle -> bench/results/augment/quick/results.json
    .venv/bin/python -m bench.augment --skip host --models vit_small_patch16_224 --steps 3
    # the device rows on a TPU VM (what the CPU rows cannot say; see below)
    python -m bench.augment --skip host --no-eager --pjrt-device TPU --device-batch 128

"On" is timm's ImageNet recipe (bench.augment.recipe.AUGMENT_ON): RandAugment
"rand-m9-mstd0.5-inc1", mixup 0.8 and cutmix 1.0 per element, random erasing
0.25 with per-pixel noise. tpustream draws all of it on the host per (seed,
epoch, sample) (tpustream.augment.draws) and applies it inside the compiled
step (tpustream.augment.transform.DeviceAugment); "off" is the Normalizer alone.

Data: bench.pipeline.imagenet_data's ImageNet-like JPEGs (2048; quick 512)
as local tar shards, read as the trainer reads them.

Host rows (one process, one torch thread: one core, like a DataLoader worker):

    augment off / on   ours-local training (bench.pipeline.imagenet_configs.ours:
                       ShardStream(train_crop="random_resized", hflip, shuffle 1000),
                       0 workers, batches of 128) without and with augment=AUGMENT_ON,
                       which adds the draws to each batch and nothing else. Timed as
                       bench.pipeline times a row; off and on alternate for --rounds
                       rounds and each form pools its rounds. "x of off" is on / off.
    our draws: ...     BatchDraws(config)(epoch, ids) for batches of 128, per image:
                       everything on, then each part alone.
    torchvision / timm the libraries' host augmentation on the same crops (the first
                       --crops of our pipeline), one image at a time as a per-sample
                       stage applies it: v2.RandAugment() and v2.TrivialAugmentWide()
                       on (3, 224, 224) uint8 tensors, timm's
                       rand_augment_transform("rand-m9-mstd0.5-inc1", {"img_mean":
                       (124, 116, 104)}) on PIL images (magnitude capped at 9.99, see
                       recipe.TIMM_MAGNITUDE_MAX).
    ms/image, images/s the cost on one core; "our pipeline with it added" is the
                       off rate with that cost added to every image,
                       1 / (1 / rate + cost): what the host would deliver if it
                       augmented instead of the device.

Device rows (bench.augment.device, one process per model and backend; see
bench.augment.steps for how they share the machine): a training step
(forward, backward, AdamW with primed state, label smoothing 0.1) of
torchvision's resnet50 and timm's vit_small_patch16_224 at 224x224 on
batches of --device-batch (8) of our crops with their draws, off (Normalizer
+ cross-entropy) and on (DeviceAugment + its soft-target loss), after every
graph has compiled once; off and on alternate, each step on other crops and
other draws. A step's time runs from tracing to torch_xla.sync() and
wait_device_ops() returning (tracing included: nothing overlaps it here).

    step off / on      median ms per step; on/off their ratio.
    aug alone          median ms per batch of DeviceAugment's output alone, minus
                       the Normalizer's (what "on" adds before the model);
                       ms/image divides it by the batch; "of step" by step off.
    recompiles         XLA compilations while timing (0: every draw took the
                       warmed-up graphs).
    graphs             graphs run per step, off/on: 1 is one compiled step; more
                       means something read a tensor back to the host mid-step.
    other load         CPU cores used by other programs meanwhile (shared machine).
    by part            the augmentation alone with only RandAugment's, erasing's or
                       mixing's draws in the batch (DeviceAugment applies the
                       parts whose draws a batch carries), minus the Normalizer's.
    eager rows         (full mode, or --eager) the same steps on eager CPU with one
                       torch thread, at most 3 of each: XLA:CPU's speed against
                       PyTorch's own CPU kernels. XLA:CPU uses its own thread pool
                       (results.json: own_cores, the cores it kept busy).

Reading the numbers (this 2-core VM, 2026-11-25, with about one core's worth
of other programs running: every row says how much). The host rows transfer
as they are: the draws cost about 0.1 ms an image, some 5% of a core's time
per image of the pipeline (on/off measured 0.91; 0.89-0.95 over runs, the
pipeline's pass-to-pass spread here being +-10%), where the libraries' host
RandAugment costs 0.9-1.7 ms an image and would cut the pipeline to
0.53-0.70 of its rate. The device rows are not the TPU's. The augmentation
computes every operation of both RandAugment layers for every sample and
selects (no draw changes the graph), and hashes noise for every pixel when
erasing: about 80 ms of XLA:CPU time per image (50-100 over runs), 45-90
times the host libraries' work, which is 7% of a ResNet-50 step and 14% of a
ViT-S step here (steps on/off 1.13 and 1.14; 20% and 27% against one-thread
eager, whose steps were 2.2x and 1.4x faster than XLA:CPU's, so XLA:CPU
inflates the model's share only moderately). On a TPU the step's
convolutions and matmuls move to the matrix units, which speed them up far
more than the augmentation's elementwise passes, gathers (the affine warp)
and transcendentals (the erasing noise) on the vector units: the CPU share
is likely a floor for the TPU's, not an estimate, and the few percent the
issue expects has to be timed there (command above). The graphs column keeps
the step honest: posterize's torch.exp2, which torch_xla 2.9 cannot lower,
ran on the host and split the augmented step into 3 graphs until commit
6d6b906.
"""
