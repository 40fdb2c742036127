"""tpustream's ShardLoader beside webdataset, Mosaic streaming, torchdata and Grain, on the same JPEGs.

    .venv/bin/python -m bench.loaders            # 3,072 images, 1 and 2 workers: ~7 minutes on 2 cores
    .venv/bin/python -m bench.loaders --quick    # 256 images, a few batches: the script works (~3 minutes)
    .venv/bin/python -m bench.loaders --workers 1,2,4 --images 6144 --data /tmp/loaders --out results.json

The other libraries are the `loaders` extra, less Mosaic streaming, whose
pins (numpy<2.2, transformers<5, google-cloud-storage<3.3) would move this
environment: it goes in without them, beside the extra's modules it imports:

    pip install -e '.[loaders]'
    pip install --no-deps 'mosaicml-streaming==0.13.0'

A library that does not import is a "not installed" row; the others still run.

Data (bench.loaders.data): --images (3,072) ImageNet-size JPEGs
(bench.pipeline.imagenet_data's photos: median long side ~380 px, ~110 KB),
labels index % 1000, written once as JPEG files (torchdata, Grain), tar
shards of 256 with a tpustream manifest (tpustream, webdataset) and MDS
(Mosaic) under --data (default /tmp/tpustream-loaders/<images>-images,
outside the repository), reused when made for the same settings.

Measured per library (bench.loaders.measure; each library's reader, used as
its documentation shows, in bench.loaders.libraries):

- images/s, and per worker, for each --workers count (1,2), one rank,
  RandomResizedCrop 224 + flip to uint8 batches of --batch-size (32), over
  --measured (40) batches after --warmup (8); tpustream with its own pipeline
  (ShardLoader(crop="random_resized")), the others PIL +
  torchvision.transforms.v2 (the stock way). "First batch": the seconds from
  building the loader to its first batch;
- the state at step k = warmup + measured (half an epoch at the defaults):
  its bytes as JSON (or pickle where it is not JSON-serialisable; which, is
  said), and the seconds from building a new loader and loading it to the
  first batch (webdataset has no state: it reads and drops k batches).
  Each row and each resume runs in a process of its own, started for it
  with its imports done before the clock starts, as a run after a
  preemption: a library's own start-up (tpustream's fork server, Grain's
  spawned workers) is in its first batch and in its resume;
- across a checkpoint at half an epoch on 2 ranks (--batch-size a rank) and
  a resume on 1 (twice that: the global batch kept), --elastic-workers (2) a
  rank, the samples duplicated and missed against one uninterrupted epoch on
  2 ranks. Ranks are readers in one process, one after the other; Mosaic
  streaming's are processes of their own, all at once (its workers meet at
  shared-memory barriers), with RANK / WORLD_SIZE / LOCAL_WORLD_SIZE set as
  torchrun sets them on one machine. Where a library refuses a state of
  another world size the cell says how.

Output: the table printed (report.format_table) and --out
(bench/results/loaders.json): every number, the settings, the command, the
data's record and the machine (CPU model, usable CPUs, Python, versions).
"""
