"""Input-pipeline throughput: stock PyTorch/WebDataset loading against tpustream's ShardStream.

Reproduce (from the repository root):

    .venv/bin/python -m bench.pipeline                      # CIFAR-like, 20000 images -> bench/results/
    .venv/bin/python -m bench.pipeline --quick              # ~3000 images -> bench/results/quick/
    .venv/bin/python -m bench.pipeline --profile ours-local # cProfile one config, w=0
    .venv/bin/python -m bench.pipeline --dataset imagenet   # ImageNet-like JPEGs, 224 crops

--dataset selects the data and its configurations: cifar (the default,
bench.pipeline.cifar: 32x32 digit PNGs, crop + flip + normalise) or imagenet
(bench.pipeline.imagenet: 3072 photo-like JPEGs of ImageNet's sizes,
random-resized and centre crops to 224, decode limit, DCT scaling on and off
-> bench/results/imagenet/); each module's docstring describes its rows. Both
are timed, load-accounted, tabled and charted by the same harness
(bench.pipeline.harness, bench.pipeline.report): a row's samples/s counts the
samples after a pass's first batch over the seconds from that batch on, after
an untimed warm-up, until --min-seconds are measured; "other load" is the CPU
other programs used meanwhile.
"""
