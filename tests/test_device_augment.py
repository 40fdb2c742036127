"""augment.*: the host's draws, the device's mixing and erasing against timm's, and the trainer with them.

In process on the CPU; the XLA side (one graph whatever is drawn) is the slow
test at the end, in a process of its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.fake_runtime import tiny_config
from tpustream.augment.draws import BatchDraws
from tpustream.augment.erasing import erase
from tpustream.augment.mixing import mix_images, mix_targets, partners
from tpustream.augment.transform import DeviceAugment
from tpustream.checkpoint import LAST, checkpoint_url, load_checkpoint, read_metrics
from tpustream.config import AugmentConfig, MixMode
from tpustream.errors import ConfigError

timm_mixup = pytest.importorskip("timm.data.mixup")


def draws_for(cfg: AugmentConfig, ids, group=None, size=(16, 12), epoch=0) -> dict[str, torch.Tensor]:
    ids = np.asarray(ids, np.int64)
    return BatchDraws(cfg, size, 3, group or len(ids), seed=7)(epoch, ids)


def images(batch: int, size=(16, 12)) -> torch.Tensor:
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(batch))


@pytest.mark.parametrize("cut", [False, True], ids=["mixup", "cutmix"])
def test_batch_mode_equals_timms_mixup_for_the_same_lambda_and_box(monkeypatch, cut):
    cfg = AugmentConfig(mixup_alpha=0 if cut else 0.8, cutmix_alpha=1.0 if cut else 0)
    draws = draws_for(cfg, range(8))
    x, labels = images(8), torch.arange(8) % 5
    lam = float(draws["mix_lam"][0])
    box = tuple(int(v) for v in draws["mix_box"][0])
    mixup = timm_mixup.Mixup(
        mixup_alpha=cfg.mixup_alpha, cutmix_alpha=cfg.cutmix_alpha, label_smoothing=0.1, num_classes=5
    )
    # timm with our draw: its lambda (before correction) and box.
    monkeypatch.setattr(mixup, "_params_per_batch", lambda: (0.3 if cut else lam, cut))
    monkeypatch.setattr(timm_mixup, "cutmix_bbox_and_lam", lambda *a, **k: (box, lam))
    want_x, want_y = mixup(x.clone(), labels)
    assert bool(draws["mix_cut"].all()) == cut and lam != 1.0
    got_x = mix_images(x, draws, group=8)
    got_y = mix_targets(labels, partners(labels, 8), draws["mix_lam"], draws["mix_rest"], 5, 0.1)
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_y, want_y, rtol=0, atol=1e-6)


def test_elem_mode_equals_timms_per_sample_mixing(monkeypatch):
    cfg = AugmentConfig(mixup_alpha=0.8, cutmix_alpha=1.0, mix_mode=MixMode.elem, mix_prob=0.8)
    draws = draws_for(cfg, range(10))
    x, labels = images(10), torch.arange(10) % 4
    lam, cut = draws["mix_lam"].numpy().copy(), draws["mix_cut"].numpy()
    assert cut.any() and (~cut & (lam < 1)).any()  # both kinds in this batch
    boxes = iter([(tuple(int(v) for v in draws["mix_box"][i]), float(lam[i])) for i in range(10) if cut[i]])
    mixup = timm_mixup.Mixup(
        mixup_alpha=0.8, cutmix_alpha=1.0, mode="elem", label_smoothing=0.0, num_classes=4
    )
    raw = np.where(cut, 0.5, lam).astype(np.float32)  # timm corrects a cutmix lambda from the box
    monkeypatch.setattr(mixup, "_params_per_elem", lambda size: (raw.copy(), cut))
    monkeypatch.setattr(timm_mixup, "cutmix_bbox_and_lam", lambda *a, **k: next(boxes))
    want_x, want_y = mixup(x.clone(), labels)
    got_x = mix_images(x, draws, group=10)
    got_y = mix_targets(labels, partners(labels, 10), draws["mix_lam"], draws["mix_rest"], 4, 0.0)
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=1e-6)
    torch.testing.assert_close(got_y, want_y, rtol=0, atol=1e-6)


def test_draws_belong_to_samples_and_pairs_and_groups_share_theirs():
    elem = AugmentConfig(mixup_alpha=0.8, cutmix_alpha=1.0, mix_mode=MixMode.elem)
    ids = np.array([5, 9, 2, 7])
    one, other = draws_for(elem, ids), draws_for(elem, ids[::-1].copy())
    for key in one:  # a sample's draws follow it wherever it is in a batch
        assert torch.equal(one[key], other[key].flip(0)), key
    assert not torch.equal(draws_for(elem, ids, epoch=1)["mix_lam"], one["mix_lam"])
    pair = draws_for(AugmentConfig(mixup_alpha=0.8, mix_mode=MixMode.pair), range(8), group=4)
    assert torch.equal(pair["mix_lam"], partners(pair["mix_lam"], 4))  # i and B-1-i of each group
    batch = draws_for(AugmentConfig(cutmix_alpha=1.0), range(8), group=4)
    assert len(set(batch["mix_lam"][:4].tolist())) == 1 and len(set(batch["mix_lam"][4:].tolist())) == 1
    assert batch["mix_lam"][0] != batch["mix_lam"][4]  # two devices' batches, two draws


def test_draw_distributions_follow_timms():
    """Lambda ~ Beta(alpha, alpha) (cutmix's corrected by the box), switch_prob, mix_prob, erasing's areas."""
    cfg = AugmentConfig(
        mixup_alpha=0.8, cutmix_alpha=1.0, mix_mode=MixMode.elem, mix_prob=0.7, switch_prob=0.4
    )
    draws = draws_for(cfg, range(4000), size=(64, 64))
    lam, cut = draws["mix_lam"].numpy(), draws["mix_cut"].numpy()
    mixed = lam < 1
    assert abs(mixed.mean() - 0.7) < 0.03
    assert abs(cut[mixed].mean() - 0.4) < 0.03
    # Mixup's lambda: Beta(0.8, 0.8) has mean 1/2 and variance 1 / (4 x 2.6).
    mixup = lam[mixed & ~cut]
    assert abs(mixup.mean() - 0.5) < 0.02 and abs(mixup.var() - 1 / 10.4) < 0.01
    # Cutmix's corrected lambda against timm's own function over the same Beta(1, 1) draws.
    np.random.seed(0)
    theirs = [
        timm_mixup.cutmix_bbox_and_lam((64, 64), np.random.beta(1, 1))[1] for _ in range(int(cut.sum()))
    ]
    assert abs(np.mean(theirs) - lam[cut].mean()) < 0.03
    erase_cfg = AugmentConfig(erase_prob=0.25, erase_count=3)
    boxes = draws_for(erase_cfg, range(4000), size=(64, 64))["erase_box"].numpy()
    areas = (boxes[..., 1] - boxes[..., 0]) * (boxes[..., 3] - boxes[..., 2])
    erased = areas.sum(1) > 0
    assert abs(erased.mean() - 0.25) < 0.03
    assert (areas[erased].sum(1) <= 64 * 64 / 3 * 1.2).all() and (areas[erased].max(1) >= 1).all()


def test_erasing_fills_only_its_rectangles():
    x = images(6)
    for mode in ("const", "rand"):
        draws = draws_for(AugmentConfig(erase_prob=1.0, erase_count=2, erase_mode=mode), range(6))
        out = erase(x, draws["erase_box"], draws["erase_value"])
        mask = torch.zeros_like(x, dtype=torch.bool)
        for b in range(6):
            for k in range(2):
                top, bottom, left, right = draws["erase_box"][b, k].tolist()
                mask[b, :, top:bottom, left:right] = True
                if bottom > top and k == 1:  # the last rectangle is on top
                    want = draws["erase_value"][b, k].view(3, 1, 1).expand(3, bottom - top, right - left)
                    assert torch.equal(out[b, :, top:bottom, left:right], want)
        assert mask.any() and torch.equal(out[~mask], x[~mask])
        assert (mode == "const") == bool((draws["erase_value"] == 0).all())


def test_pixel_erasing_fills_with_standard_normal_noise_keyed_by_sample():
    """timm's "pixel" mode: per-pixel N(0, 1) inside the rectangles, a function of the sample's key."""
    from tpustream.augment.erasing import pixel_noise

    cfg = AugmentConfig(erase_prob=1.0, erase_mode="pixel")
    draws = draws_for(cfg, range(6))
    x = images(6)
    out = erase(x, draws["erase_box"], draws["erase_value"], draws["erase_key"])
    noise = pixel_noise(draws["erase_key"], (3, 16, 12))
    for b in range(6):
        top, bottom, left, right = draws["erase_box"][b, 0].tolist()
        assert torch.equal(out[b, :, top:bottom, left:right], noise[b, :, top:bottom, left:right])
        outside = torch.ones(16, 12, dtype=torch.bool)
        outside[top:bottom, left:right] = False
        assert torch.equal(out[b][:, outside], x[b][:, outside])
    # Another sample's key is other noise; the same key, the same noise (on any device: integer hashing).
    assert torch.equal(pixel_noise(draws["erase_key"][:2], (3, 16, 12)), noise[:2])
    assert not torch.equal(noise[0], noise[1])
    big = pixel_noise(torch.tensor([1, -7, 2**31 - 1], dtype=torch.int32), (3, 64, 64)).flatten()
    assert abs(float(big.mean())) < 0.02 and abs(float(big.std()) - 1) < 0.02
    assert stats_normal_pvalue(big) > 1e-3
    pairs = big.view(-1, 2)  # neighbours do not follow each other
    assert abs(float(torch.corrcoef(pairs.T)[0, 1])) < 0.03


def stats_normal_pvalue(values: torch.Tensor) -> float:
    from scipy import stats

    return float(stats.kstest(values.numpy(), "norm").pvalue)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"mixup_alpha": -1.0}, "augment.mixup_alpha must be >= 0"),
        ({"mix_prob": 1.5}, "augment.mix_prob must be a probability"),
        ({"cutmix_minmax": [0.5, 0.2]}, "augment.cutmix_minmax must be [min, max]"),
        ({"erase_count": 0}, "augment.erase_count must be at least 1"),
    ],
)
def test_augment_fields_are_checked(changes, message):
    import re

    with pytest.raises(ConfigError, match=re.escape(message)):
        AugmentConfig(**changes).check()


def test_mixing_needs_an_even_batch():
    cfg = tiny_config("/tmp/unused", batch_size=5, **{"augment.mixup_alpha": 0.2, "model.name": "small_cnn"})
    with pytest.raises(ConfigError, match="batch_size must be even"):
        cfg.check()


def test_the_loss_takes_soft_targets_and_without_mixing_is_plain_cross_entropy():
    logits, labels = torch.randn(4, 3), torch.tensor([0, 2, 1, 1])
    augment = DeviceAugment(AugmentConfig(erase_prob=0.5), lambda x: x.float(), 0.1, group=4)
    want = torch.nn.functional.cross_entropy(logits, labels, reduction="none", label_smoothing=0.1)
    torch.testing.assert_close(augment.loss(logits, {"label": labels}), want)
    ones = {
        "label": labels,
        "mix_label": labels.flip(0),
        "mix_lam": torch.ones(4),
        "mix_rest": torch.zeros(4),
    }
    torch.testing.assert_close(augment.loss(logits, ones), want)


def config_with_augment(run: str, **changes):
    options = {
        "augment.mixup_alpha": 0.8,
        "augment.cutmix_alpha": 1.0,
        "augment.mix_mode": MixMode.elem,
        "augment.erase_prob": 0.5,
        "augment.erase_mode": "pixel",
        "augment.randaugment": "rand-m9-mstd0.5-inc1",
        "optim.label_smoothing": 0.1,
    }
    return tiny_config(run, **{**options, **changes})


def test_the_trainer_augments_on_the_device_and_resumes_bit_for_bit(fake_job, tmp_path):
    straight = str(tmp_path / "straight")
    fake_job(config_with_augment(straight), world_size=2)
    plain = str(tmp_path / "plain")
    fake_job(tiny_config(plain), world_size=2)
    assert read_metrics(straight)[0]["train_loss"] != read_metrics(plain)[0]["train_loss"]
    run = str(tmp_path / "run")
    fake_job(config_with_augment(run), world_size=2, stop_at=(1, "train", 1, 3))
    state = load_checkpoint(checkpoint_url(run, LAST))
    assert state["position"] == {"epoch": 1, "step": 4}
    fake_job(config_with_augment(run), world_size=2, resume_from=(state, checkpoint_url(run, LAST)))
    got, want = load_checkpoint(checkpoint_url(run, LAST)), load_checkpoint(checkpoint_url(straight, LAST))
    for name, tensor in want["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert read_metrics(run)[-1]["train_loss"] == pytest.approx(
        read_metrics(straight)[-1]["train_loss"], rel=1e-6
    )


def test_micro_batches_mix_the_whole_step_batch_alike(fake_job, tmp_path):
    """Pairs and targets are made before micro-batches cut the batch: K=2 is the update of K=1."""
    runs = {}
    for count in (1, 2):
        runs[count] = str(tmp_path / f"k{count}")
        fake_job(config_with_augment(runs[count], epochs=1, micro_batches=count))
    one, two = (load_checkpoint(checkpoint_url(runs[k], LAST))["model"] for k in (1, 2))
    for name, tensor in one.items():
        torch.testing.assert_close(two[name], tensor, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_digits_learn_with_every_augmentation_on_the_device_compiling_in_epoch_0_only(digits_root, tmp_path):
    """RandAugment, mixup and cutmix per sample, random erasing with pixel noise, label smoothing:
    on XLA, one train graph whatever is drawn, and the CNN still learns the digits."""
    from tests.conftest import run_train
    from tpustream.checkpoint import read_metrics

    run = str(tmp_path / "run")
    result = run_train(
        f"data.root={digits_root}",
        "epochs=2",
        "augment.randaugment=rand-m9-mstd0.5-inc1",
        "augment.mixup_alpha=0.2",
        "augment.cutmix_alpha=1.0",
        "augment.mix_mode=elem",
        "augment.erase_prob=0.25",
        "augment.erase_mode=pixel",
        "optim.label_smoothing=0.1",
        "log_steps=1000",
        "debug.metrics=true",
        "data.num_workers=0",
        "accelerator.in_process=true",
        f"output_dir={run}",
        f"hydra.run.dir={tmp_path}/h",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(run)
    assert len({r["compilations"] for r in records}) == 1  # all in epoch 0
    # Every op has an XLA lowering: nothing cuts the step's graph to run on the CPU (torch.exp2
    # did, in posterize, until the host sent the step 2 ** (8 - bits) instead of the bits).
    assert result.stderr.count("CPU fallbacks: none") == 2
    # Measured: 40.1% after 2 epochs (47.6% after 3, 62.4% after 4: everything at once
    # regularises a small CNN hard); chance is 10%. Two keep the suite's time: the ops cost
    # a CPU more than a TPU (9 s of steps an epoch here).
    assert max(r["val_accuracy"] for r in records) > 0.3
