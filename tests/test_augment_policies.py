"""augment.policies: timm's RandAugment strings, and draws distributed as timm's and torchvision's.

The libraries draw from Python's, numpy's and torch's global generators and
we from each sample's own, so draws are compared as distributions: thousands
of draws from each side at fixed seeds, a two-sample test per quantity
(deterministic: the seeds are fixed, the thresholds are loose).
"""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from tpustream.augment.draws import BatchDraws
from tpustream.augment.policies import RAND_INCREASING_TRANSFORMS, RandAugment, TrivialAugment, build_policy
from tpustream.config import AugmentConfig
from tpustream.errors import ConfigError

DRAWS = 6000


def test_timms_strings_are_read_as_timm_reads_them():
    spec = RandAugment.parse("rand-m9-mstd0.5-inc1")
    assert (spec.magnitude, spec.layers, spec.prob, spec.magnitude_std) == (9, 2, 0.5, 0.5)
    assert spec.transforms == RAND_INCREASING_TRANSFORMS and spec.weights is None
    spec = RandAugment.parse("rand-n3-m15-mmax20-mstd101-p0.8-tweights")
    assert (spec.layers, spec.magnitude, spec.magnitude_max, spec.prob) == (3, 15, 20, 0.8)
    assert (
        spec.magnitude_std == math.inf and spec.weights is not None and sum(spec.weights) == pytest.approx(1)
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("rnd-m9", "start with 'rand-'"),
        ("rand-m9-x3", r"unknown section 'x3'"),
        ("rand-m9-mstd", r"section 'mstd' has no number"),
        ("rand-m9-t3a", r"transform set '3a' is not built"),
        ("rand-n0", "n >= 1"),
    ],
)
def test_a_string_timm_would_not_read_is_one_line_naming_its_section(text, message):
    with pytest.raises(ConfigError, match=message) as error:
        build_policy(AugmentConfig(randaugment=text))
    assert "augment.randaugment" in str(error.value) and "\n" not in str(error.value)


def test_one_policy_at_a_time_and_fill_in_range():
    with pytest.raises(ConfigError, match="choose one"):
        AugmentConfig(randaugment="rand-m9", trivialaugment=True).check()
    with pytest.raises(ConfigError, match=r"augment.fill is 0..255"):
        AugmentConfig(trivialaugment=True, fill=[300.0, 0.0, 0.0]).check()


def record_torchvision_trivialaugment(count: int) -> list[tuple[str, float]]:
    from torchvision.transforms import v2

    transform = v2.TrivialAugmentWide()
    drawn: list[tuple[str, float]] = []

    def record(image, transform_id, magnitude, interpolation, fill):
        drawn.append((transform_id, magnitude))
        return image

    transform._apply_image_or_video_transform = record
    torch.manual_seed(0)
    image = torch.zeros(3, 4, 4, dtype=torch.uint8)
    for _ in range(count):
        transform(image)
    return drawn


def ours(policy, count: int) -> list:
    """One layer list per sample id, as the host draws them (epoch 0, seed 7)."""
    from tpustream.augment.draws import POLICY_STREAM, sample_generator

    return [policy.draw(sample_generator(7, 0, sample, POLICY_STREAM)) for sample in range(count)]


def assert_same_categories(a: list, b: list, what: str) -> None:
    """Chi-square test of homogeneity: both samples from one categorical distribution."""
    categories = sorted(set(a) | set(b), key=str)
    table = np.array([[Counter(a)[c] for c in categories], [Counter(b)[c] for c in categories]])
    p_value = stats.chi2_contingency(table)[1] if len(categories) > 1 else 1.0
    assert p_value > 1e-3, f"{what}: p = {p_value:.2g}"


def test_trivialaugment_draws_ops_magnitudes_and_signs_as_torchvision():
    theirs = record_torchvision_trivialaugment(DRAWS)
    mine = [layers[0] for layers in ours(TrivialAugment(), DRAWS)]
    assert_same_categories([name for name, _ in mine], [name for name, _ in theirs], "op")
    # Each (op, signed magnitude) is one of torchvision's 14 ops x 31 bins (x 2 signs where signed).
    from torchvision.transforms import v2

    space = set()
    for op, (magnitudes_fn, signed) in v2.TrivialAugmentWide._AUGMENTATION_SPACE.items():
        magnitudes = magnitudes_fn(31, 4, 4)
        values = [0.0] if magnitudes is None else [float(m) for m in magnitudes]
        space |= {(op, sign * value) for value in values for sign in ((1, -1) if signed else (1,))}
    assert set(mine) <= space and len(set(mine)) > 0.95 * len(space)
    assert_same_categories(
        [magnitude > 0 for _, magnitude in mine if magnitude], [m > 0 for _, m in theirs if m], "sign"
    )
    assert_same_categories(
        [(name, magnitude > 0) for name, magnitude in mine],
        [(name, magnitude > 0) for name, magnitude in theirs],
        "sign per op",
    )
    assert_same_categories(
        [round(abs(m), 4) for _, m in mine], [round(abs(m), 4) for _, m in theirs], "magnitude bins"
    )


def record_timm_randaugment(text: str, count: int) -> list[list[tuple[str, tuple] | None]]:
    """Each image's layers as timm applies them: (op, level args), None where its probability skipped."""
    from timm.data.auto_augment import rand_augment_transform

    transform = rand_augment_transform(text, {"img_mean": (124, 116, 104)})
    images: list[list] = []
    for op in transform.ops:

        def record(image, *args, name=op.name, **kwargs):
            images[-1].append((name, args))
            return image

        op.aug_fn = record
    random.seed(0)
    np.random.seed(0)
    for _ in range(count):
        images.append([])
        transform(None)
        images[-1] += [None] * (transform.num_layers - len(images[-1]))
    return images


@pytest.mark.parametrize(
    "text", ["rand-m9-mstd0.5-inc1", "rand-m7-n3-mstd101-mmax12-p0.7", "rand-m10-n2-tweights"]
)
def test_randaugment_draws_ops_and_level_args_as_timm(text):
    theirs = record_timm_randaugment(text, DRAWS)
    mine = ours(RandAugment.parse(text), DRAWS)
    flat = [layer for layers in mine for layer in layers]
    flat_theirs = [layer for layers in theirs for layer in layers]
    name = lambda layer: "skipped" if layer is None else layer[0]  # noqa: E731
    assert_same_categories([name(x) for x in flat], [name(x) for x in flat_theirs], f"{text}: ops")
    if "tweights" in text:  # without replacement: never the same op twice in an image
        assert all(len({name(x) for x in layers if x}) == len([x for x in layers if x]) for layers in mine)
    # The level arguments of each op: continuous ones by a Kolmogorov-Smirnov test.
    for op in sorted({name(x) for x in flat} - {"skipped"}):
        args = [x[1][0] for x in flat if name(x) == op and x[1]]
        args_theirs = [x[1][0] for x in flat_theirs if name(x) == op and x[1]]
        if not args:
            continue
        if len(set(args_theirs)) > 20:
            p_value = stats.ks_2samp(args, args_theirs).pvalue
            assert p_value > 1e-3, f"{text}: {op} arguments p = {p_value:.2g}"
        else:
            assert_same_categories(args, args_theirs, f"{text}: {op} arguments")


def test_a_samples_operations_follow_the_sample_not_the_batch():
    """Drawn per (seed, epoch, sample id) apart from mixing: alike whatever the batch or the other options."""
    alone = BatchDraws(AugmentConfig(trivialaugment=True), (16, 16), 3, 4, seed=3)
    mixed = BatchDraws(AugmentConfig(trivialaugment=True, mixup_alpha=0.8), (16, 16), 3, 2, seed=3)
    first = alone(2, np.array([5, 9, 11, 40]))
    second = mixed(2, np.array([40, 11]))
    for key in ("aug_op", "aug_matrix", "aug_value", "aug_rest"):
        assert torch.equal(first[key][[3, 2]], second[key])
    assert not torch.equal(alone(3, np.array([5, 9, 11, 40]))["aug_op"], first["aug_op"])  # another epoch
