"""bench.shuffle: the orders it measures are the pipeline's, and its measures mean what they say."""

from __future__ import annotations

import numpy as np

from bench.shuffle import canonical_order, layout, mixing, per_reader_order, random_order, run
from tpustream.data.read.layout import CanonicalPartition


def test_the_simulated_orders_cover_the_epoch_and_the_measures_rank_them():
    shards, classes = layout(4 * 64 * 12, 32)  # 12 steps of a global batch of 256
    shard_of = np.repeat(np.arange(32), [s.samples for s in shards])
    for order in (
        per_reader_order(shards, 2, 16, 256),
        canonical_order(shards, CanonicalPartition(16, 8), 256),
        random_order(len(classes), 256),
    ):
        assert order.shape == (12, 256) and sorted(order.ravel()) == list(range(len(classes)))
    # A random permutation is the best mixed; shard order without a buffer the worst.
    best = mixing(random_order(len(classes), 256), shard_of, classes)
    worst = mixing(np.arange(len(classes)).reshape(12, 256), shard_of, classes)
    assert best["classes_per_batch"] > worst["classes_per_batch"]
    assert best["class_distance"] < worst["class_distance"]
    assert abs(best["nearby_correlation"]) < 0.2


def test_a_quick_run_reports_every_order_for_each_shape(tmp_path):
    results = run(32, 32 * 48, [2], 16, [1, 4], global_batch=256)
    names = [row["order"] for row in results["rows"]]
    assert names == [
        "random permutation",
        "per-reader",
        "canonical, 1 a reader",
        "canonical, 4 a reader (auto)",
        "webdataset",
    ]
    canonical = results["rows"][3]
    assert canonical["streams"] == 32 and canonical["stream_buffer"] == 4  # 16 a reader over 4 streams
