"""The user's own stages (data.stages): loaded by name, run on decoded samples, and held to the plan.

A stage may change pixels and labels or drop samples, never the image shape
nor the number of samples: every replica must run the same steps.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from tpustream.data.format.decode import SampleError, check_label
from tpustream.data.read.stages import SHARD_ID_SHIFT, DecodedSample, ErrorPolicy
from tpustream.errors import ConfigError

UserStage = Callable[[Iterator[dict]], Iterable[dict]]


def load_user_stage(path: str) -> UserStage:
    """The callable named by a data.stages entry ("package.module:function" or "package.module.function")."""
    module_name, _, attribute = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attribute:
        raise ConfigError(f"data.stages entry {path!r}: expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"data.stages entry {path!r}: cannot import {module_name} ({exc})") from None
    stage = getattr(module, attribute, None)
    if not callable(stage):
        raise ConfigError(f"data.stages entry {path!r}: {module_name} has no callable {attribute!r}")
    return stage


def apply_user_stages(
    samples: Iterable[DecodedSample],
    paths: Sequence[str],
    shape: Sequence[int],
    num_classes: int,
    shard_urls: Sequence[str],
    on_error: ErrorPolicy,
) -> Iterator[DecodedSample]:
    """Run the configured webdataset stages on decoded samples, as dicts, and check what comes out.

    A stage sees {"image": uint8 (C, H, W) array, "label": int, "__real__",
    "__id__"} and yields such dicts (the "__" keys kept). It may change pixels
    and labels or drop samples; dropped real ones are counted like bad data
    (their places are filled, so steps stay equal). It may not change the
    image shape (the step is compiled for one shape: a ConfigError), nor add
    samples: each worker's stream must stay within the plan (what a stage
    yields beyond what it was given is dropped and counted as bad data). A
    label outside the classes makes the sample bad, as it does in a shard.
    """
    given_real = 0

    def as_dicts() -> Iterator[dict]:
        nonlocal given_real
        for sample in samples:
            given_real += sample.real
            yield {
                "image": sample.image,
                "label": sample.label,
                "__real__": sample.real,
                "__id__": sample.sample_id,
                "__key__": sample.key,
            }

    stream: Iterable[dict] = as_dicts()
    for path in paths:
        stream = drop_surplus(load_user_stage(path), path, stream, on_error)
    expected = tuple(shape)
    accounted_real = 0  # real samples yielded, or found bad here
    for item in stream:
        image = np.asarray(item["image"])
        if image.shape != expected or image.dtype != np.uint8:
            raise ConfigError(
                f"data.stages {list(paths)} yielded an image of {image.dtype} {image.shape}; "
                f"it must stay uint8 {expected}"
            )
        if "__real__" not in item:
            # Without it padding would count as data (and a bad padding sample twice).
            raise ConfigError(
                f"data.stages {list(paths)} yielded a sample without its '__real__' key; "
                "change the sample dict a stage is given (or copy its '__' keys into a new one)"
            )
        real, sample_id = bool(item["__real__"]), int(item.get("__id__", -1))
        accounted_real += real
        try:
            label = check_label(item.get("label"), num_classes)
        except SampleError as exc:
            if real:  # padding: reported and counted where it was read as a real sample
                shard, index = sample_id >> SHARD_ID_SHIFT, sample_id & ((1 << SHARD_ID_SHIFT) - 1)
                if sample_id >= 0 and shard < len(shard_urls):
                    on_error(shard_urls[shard], f"#{index}", f"{exc} after data.stages {list(paths)}")
                else:
                    on_error(f"data.stages {list(paths)}", None, str(exc))
                on_error.count_lost()
            continue
        yield DecodedSample(image, label, real, sample_id, str(item.get("__key__", "")))
    # Only reached when the stream fell short of the plan, which dropped samples make it.
    on_error.count_lost(max(0, given_real - accounted_real))


def drop_surplus(
    stage: UserStage, path: str, inputs: Iterable[dict], on_error: ErrorPolicy
) -> Iterator[dict]:
    """A user stage's output, less what it yields beyond the samples it has been given so far.

    Surplus would make this worker's stream longer than its share of the
    plan; the batching stage would then take it in place of the samples that
    come after it, and never read those.
    """
    given = 0

    def counted() -> Iterator[dict]:
        nonlocal given
        for item in inputs:
            given += 1
            yield item

    yielded = 0
    for item in stage(counted()):
        if yielded < given:
            yielded += 1
            yield item
            continue
        on_error.stage_surplus(path)
        if item.get("__real__", True):
            on_error.count_lost()
