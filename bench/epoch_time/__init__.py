"""Time per epoch of real training runs: batch size, validation, augmentation, data source, workers.

Reproduce (from the repository root):

    # the CPU sweep of bench/EPOCH_TIME.md (small_cnn on digits; about 11 minutes on 2 cores)
    python scripts/make_shards.py digits data/digits
    .venv/bin/python -m bench.epoch_time --batch-sizes 32 64 128 256 --epochs 4 --cold-warm 128
    # the seed experiment on one TPU VM host (see bench/EPOCH_TIME.md for the full command)
    python -m bench.epoch_time --batch-sizes 8 16 32 64 128 256 512 --epochs 5 -- \\
        model=wrn_seed data=cifar100 data.root=gs://BUCKET/cifar100 accelerator=tpu precision=bf16
    # print the plan and the commands, run nothing
    .venv/bin/python -m bench.epoch_time --batch-sizes 32 64 --dry-run -- model=small_cnn
    # or sweep with Hydra's multirun and report the finished runs the same way
    python train.py -m batch_size=32,64,128 eval_every=1,0 epochs=4 hydra.sweep.dir=multirun/bs
    .venv/bin/python -m bench.epoch_time --collect multirun/bs

Every run is `python train.py <overrides>`, the command users run, in its own
process: the overrides after `--` (any Hydra override of conf/), then
`epochs=`, `batch_size=`, the settings of the run's switches, the compile
cache key, and `output_dir=<run folder> resume=null hydra.run.dir=<run folder>`.
The harness is the sweep: do not pass `-m`/`--multirun`, and do not set the keys
it sets itself (it refuses, naming the key). Every run's overrides are composed
with Hydra before the first run starts, so a typo costs a second, not a sweep.
--collect DIR instead reports runs that train.py made elsewhere (a Hydra
multirun, runs on a TPU host): every folder below DIR with .hydra/config.yaml,
labelled by the switches whose settings differ between them.

Switches (a run is the base overrides + a batch size + one combination):

    validation     on: eval_every=1                          off: eval_every=0
    augmentation   on: data.crop_padding=4 data.hflip=true   off: data.crop_padding=0 data.hflip=false
    source         shards: data.in_memory=false              memory: data.in_memory=true
    workers        4: data.num_workers=4                     1: data.num_workers=1

The first setting of each is the baseline. By default each batch size gets the
baseline and one run per switch flipped; --full runs the whole cross product.
--switches limits the switches; those left out are not set at all (the config
and the overrides decide). Sweep runs set the compile cache key to null (the
tpu accelerator config enables a persistent cache, which would make every run
after the first one with the same graphs start warm). --cold-warm B runs the
baseline at batch size B twice more with a fresh cache folder: cold, then warm.

What is measured, from <run folder>/metrics.jsonl (one line per epoch):

    epoch time     epoch_seconds (training + validation of the epoch), or, when
                   train.py does not write it, train_seconds + val_seconds.
    set-up         setup_seconds (train.py: process start to the first training
                   step); else the first line's wall_time minus its epoch time
                   minus the moment the harness started the process ("wall_time");
                   else process wall time minus all epoch times ("process").
                   The column setup_method says which.
    epoch 1        the first epoch: it compiles the train (and eval) graphs.
    mean, std      over epochs 2+ (std with n-1; NaN with fewer than 2 such epochs).
    samples/s      training samples per training second over epochs 2+ (all replicas).
    compilations   the master replica's XLA compile count after the last epoch
                   (compilations_epoch1: after the first).
    total N        the seed's projection: set-up + epoch 1 + mean * (N - 1).
    overhead       process wall time - set-up - all epochs: checkpoints, teardown.
    other load     CPU cores that programs other than this run used meanwhile
                   (on a shared machine, anything above ~0.1 slows the run down).

Outputs in --out (default bench/results/epoch_time/<model>-<data>-<device>):
runs.csv (one row per run), table.md (the seed's layout), epoch_time.png
(epoch time vs batch size, linear and log), ratios.png (switched / baseline
per switch vs batch size), sweep.json (command, environment, settings) and
runs/<run>/ (stdout.log, stderr.log, Hydra's logs, metrics.jsonl; checkpoints
are deleted unless --keep-checkpoints). A failed run is reported with its
command and the tail of its stderr; the sweep goes on and exits 1 at the end.

Modules: plan (the switches and the runs of a sweep, checked with Hydra),
run (one train.py run, measured), collect (a run's summary from its
metrics.jsonl, and finished runs found below a folder), report (runs.csv,
table.md, the plots, sweep.json), __main__ (the command line).
"""
