"""The recipe's sections of the config: model, optimizer and schedule, weight average, augmentation.

What an experiment file (conf/experiment/) sets, apart from where the data is
and what runs it (``schema``). Each section checks its own fields; the model's
name, options and weights are the model code's to judge (models.check_model_config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from omegaconf import MISSING

from tpustream.config.choices import (
    BestOf,
    EpochsChange,
    EraseMode,
    Interpolation,
    MixMode,
    ModelLibrary,
    OptimizerName,
    Schedule,
)
from tpustream.config.facts import OnResume, setting
from tpustream.errors import ConfigError


@dataclass
class ModelConfig:
    """A model: its library, its name there, and the keyword options its constructor takes."""

    library: ModelLibrary = setting(
        ModelLibrary.tpustream,
        "tpustream (built-in families), timm (model=timm) or torchvision (model=torchvision).",
    )
    name: str = setting(
        MISSING,
        "The model's name in its library: small_cnn, resnet18, resnet50, wrn_seed (tpustream), any timm or "
        "torchvision classifier (docs/models.md).",
    )
    options: dict[str, Any] = setting(
        factory=dict,
        doc="Keyword options of the model's constructor (model.options.width=8, drop_path_rate=0.1, ...).",
        free_form=True,
    )
    pretrained: str | None = setting(
        None,
        "Start a fresh run from pretrained weights, read once per host before spawning: true = the "
        "library's own for model.name (timm: from the Hugging Face hub, the name may carry a tag, "
        "resnet18.a1_in1k; torchvision: DEFAULT, or a name: IMAGENET1K_V2); or a file (path, gs://, "
        "http(s)://; safetensors or torch; timm's, torchvision's or our key layout). A head of another "
        "class count starts fresh. null or false = none.",
    )

    remat: bool = setting(
        False,
        "Rematerialisation (activation checkpointing): keep only each block's input in the forward pass "
        "and recompute the block in the backward pass: less activation memory for about a third more "
        "compute, the same losses. A model's blocks are the modules of each innermost Sequential or "
        "ModuleList of 2+ modules of one class (a ViT's blocks, a ResNet's residual blocks); on XLA "
        "torch_xla's checkpoint (its optimisation barrier keeps XLA from undoing it), on the native "
        "runtime torch.utils.checkpoint, non-reentrant.",
        resume=OnResume.change,
    )

    def wants_pretrained(self) -> bool:
        """model.pretrained names weights: not null, not false (Hydra hands this field false as "False")."""
        return self.pretrained is not None and self.pretrained.lower() != "false"


@dataclass
class OptimConfig:
    name: OptimizerName = setting(
        OptimizerName.sgd,
        "sgd (momentum, Nesterov by default), adamw, lars (SGD with a per-tensor trust ratio: MLPerf "
        "ResNet-50's) or lamb (Adam with a per-tensor trust ratio).",
    )
    lr: float = setting(
        0.1,
        "Peak learning rate: for the global batch (batch_size x replicas), or for reference_batch_size "
        "when that is set.",
    )
    reference_batch_size: int | None = setting(
        None,
        "Linear scaling rule (Goyal et al. 2017): the peak becomes lr x global batch / "
        "reference_batch_size, reached after the warmup. null = no scaling.",
    )
    momentum: float = setting(0.9, "name=sgd and lars: the momentum of the update.")
    nesterov: bool = setting(True, "name=sgd: Nesterov's momentum.")
    weight_decay: float = setting(
        5e-4, "L2 weight decay (decoupled for adamw); norm weights and biases get none under lars and lamb."
    )
    label_smoothing: float = setting(0.0, "Label smoothing of the cross-entropy loss, in [0, 1).")
    schedule: Schedule = setting(
        Schedule.cosine,
        "After a linear warmup: cosine decay to min_lr_ratio x lr, constant, step (x decay_factor every "
        "decay_every_epochs) or poly ((1 - progress) ** poly_power).",
    )
    warmup_epochs: float = setting(
        1.0, "Epochs of the linear warmup from 0 to the peak lr (fractions allowed)."
    )
    min_lr_ratio: float = setting(0.0, "The schedule's floor as a fraction of the peak lr.")
    decay_every_epochs: float = setting(
        30.0,
        "schedule=step: multiply the learning rate by decay_factor every decay_every_epochs, counted from"
        " the first step (warmup included).",
    )
    decay_factor: float = setting(0.1, "schedule=step: the factor applied every decay_every_epochs.")
    poly_power: float = setting(
        2.0,
        "schedule=poly: after the warmup, lr x (1 - progress) ** poly_power, not below min_lr_ratio x lr "
        "(2 in MLPerf ResNet-50's LARS recipe).",
    )
    on_epochs_change: EpochsChange = setting(
        EpochsChange.refuse,
        "A run continued with another `epochs` under a cosine or poly schedule (whose curve is drawn over"
        " epochs): refuse (say what each choice does), keep (the old horizon), restart (a new warmup and "
        "decay from the resume point to the new epochs) or stretch (redrawn over the new epochs).",
        resume=OnResume.change,
    )
    clip_grad_norm: float = setting(
        0.0,
        "Before every step, scale all gradients so that their global L2 norm (over every parameter, after"
        " the replicas' gradients are averaged) is at most this, on the device "
        "(torch.nn.utils.clip_grad_norm_'s rule); 0 = off.",
    )
    lars_eta: float = setting(
        0.001,
        "name=lars: the trust coefficient eta (You et al. 2017): each weight tensor's step is scaled by "
        "eta x |w| / (|g| + weight_decay x |w| + eps). Norm weights and biases get neither this nor "
        "weight decay.",
    )
    betas: list[float] = setting(
        factory=lambda: [0.9, 0.999],
        doc="name=adamw and lamb: the decay rates of Adam's first and second moments.",
    )
    eps: float = setting(
        1e-8,
        "Added to denominators: Adam's and LAMB's sqrt(second moment) (the LAMB paper uses 1e-6), LARS's "
        "trust-ratio denominator (MLPerf: 0).",
    )
    layer_decay: float = setting(
        0.0,
        "Layer-wise lr decay for fine-tuning ViT-style timm models (BEiT; timm's layer_decay): layer i of"
        " n (timm's group_matcher, embeddings first, head last) trains at lr x layer_decay ** (n - 1 - "
        "i). 0 or 1 = off. Needs a model with layer groups (model=timm).",
    )

    def layer_decay_on(self) -> bool:
        return 0 < self.layer_decay < 1

    def check(self) -> None:
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ConfigError(f"optim.lr must be a positive number, got {self.lr}")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"optim.label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"optim.momentum must be in [0, 1), got {self.momentum}")
        if self.warmup_epochs < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("optim.warmup_epochs must be >= 0 and optim.min_lr_ratio in [0, 1]")
        if not self.decay_every_epochs > 0 or not 0 < self.decay_factor <= 1:
            raise ConfigError(
                f"optim.decay_every_epochs must be > 0 and optim.decay_factor in (0, 1], got "
                f"{self.decay_every_epochs} and {self.decay_factor}"
            )
        if self.reference_batch_size is not None and self.reference_batch_size < 1:
            raise ConfigError(
                f"optim.reference_batch_size must be at least 1, got {self.reference_batch_size}"
            )
        if not 0 <= self.layer_decay <= 1:  # NaN fails too
            raise ConfigError(f"optim.layer_decay must be in (0, 1] (0 or 1 = off), got {self.layer_decay}")
        self.check_large_batch_fields()

    def check_large_batch_fields(self) -> None:
        """The fields of the lars and lamb recipes: poly schedule, clipping, trust coefficient, Adam's."""
        for name in ("poly_power", "lars_eta"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"optim.{name} must be a positive number, got {value}")
        if not math.isfinite(self.clip_grad_norm) or self.clip_grad_norm < 0:
            raise ConfigError(f"optim.clip_grad_norm must be >= 0 (0 = off), got {self.clip_grad_norm}")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(self.betas)}")
        if not math.isfinite(self.eps) or self.eps < 0:
            raise ConfigError(f"optim.eps must be >= 0, got {self.eps}")
        if self.eps == 0 and self.name in (OptimizerName.adamw, OptimizerName.lamb):
            raise ConfigError(
                f"optim.eps must be > 0 for optim.name={OptimizerName(self.name).value}: "
                "it keeps sqrt(second moment) + eps from being 0"
            )


@dataclass
class EmaConfig:
    """An exponential moving average of the weights, updated on the device in every train step.

    timm's ModelEmaV3 semantics (timm/utils/model_ema.py): parameters and
    floating buffers (BatchNorm's statistics) move as ema += (1 - d) (w - ema)
    after every optimizer step; the first update copies the weights (d = 0);
    with warmup, d = 1 - (1 + n / warmup_gamma) ** -warmup_power after n
    updates, at most `decay`. Evaluated at every evaluation beside the raw weights.
    """

    decay: float = setting(0.0, "0 = off; e.g. 0.9998 (timm's ImageNet recipes), 0.99996 (DeiT).")
    warmup: bool = setting(
        False,
        "Ramp the decay up from 0 (timm's use_warmup; off by default, as there). 2/3 reaches 0.999 after "
        "31.6k updates and 0.9999 after 1M; 3/4 after 10k and 215k.",
    )
    warmup_gamma: float = setting(1.0, "ema.warmup: gamma of d = 1 - (1 + n / gamma) ** -power.")
    warmup_power: float = setting(2 / 3, "ema.warmup: power of d = 1 - (1 + n / gamma) ** -power.")
    select_best: BestOf = setting(BestOf.raw, "Which accuracy best.pt and early stopping follow: raw or ema.")

    def check(self) -> None:
        if not (math.isfinite(self.decay) and 0 <= self.decay < 1):
            raise ConfigError(f"ema.decay must be in [0, 1) (0 = off), got {self.decay}")
        for name in ("warmup_gamma", "warmup_power"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"ema.{name} must be a positive number, got {value}")
        if self.select_best == BestOf.ema and self.decay == 0:
            raise ConfigError("ema.select_best=ema needs an average: set ema.decay (e.g. 0.9998)")
        # A setting that would do nothing is refused, not silently ignored.
        if self.warmup and self.decay == 0:
            raise ConfigError(
                "ema.warmup=true ramps the average's decay up to ema.decay, which is 0 (no average): "
                "set ema.decay (e.g. 0.9998), or leave ema.warmup out"
            )
        refuse_idle_settings(self, "ema", ("warmup_gamma", "warmup_power", self.warmup, "ema.warmup=true"))


def refuse_idle_settings(section: Any, prefix: str, *rules: tuple[str, str | None, Any, str]) -> None:
    """Settings changed from their defaults where nothing they act on is on: ConfigError naming them.

    Each rule is (name, another name or None, whether what they act on is on,
    what turns it on). Left at its default, a setting says nothing and passes.
    """
    for *names, on, needs in rules:
        for name in filter(None, names):
            value = getattr(section, name)
            if not on and value != getattr(type(section), name):
                shown = value.value if isinstance(value, Enum) else value
                raise ConfigError(
                    f"{prefix}.{name}={shown} acts only with {needs}, which is off here: set it, "
                    f"or leave {prefix}.{name} out"
                )


@dataclass
class AugmentConfig:
    """Augmentation on the device, inside the compiled train step (tpustream.augment); all off by default.

    timm's semantics (timm/data/mixup.py Mixup, timm/data/random_erasing.py
    RandomErasing); every draw is made on the host per (seed, epoch, sample)
    and shipped with the batch. Crops and flips stay on the host (data.*).
    Mixing pairs sample i with sample B-1-i of the same device's batch.
    """

    mixup_alpha: float = setting(
        0.0,
        "Mixup: images and targets mixed with lambda ~ Beta(mixup_alpha, mixup_alpha); 0 = off.",
    )
    cutmix_alpha: float = setting(
        0.0,
        "CutMix: a box of area 1 - lambda, lambda ~ Beta(cutmix_alpha, cutmix_alpha); 0 = off.",
    )
    cutmix_minmax: list[float] | None = setting(
        None,
        "CutMix box sides as fractions of the image, drawn in [min, max) instead of from alpha.",
    )
    mix_prob: float = setting(
        1.0,
        "Probability of mixing a batch (pair, sample, per augment.mix_mode).",
    )
    switch_prob: float = setting(0.5, "Probability of cutmix rather than mixup when both are on.")
    mix_mode: MixMode = setting(
        MixMode.batch,
        "How mixing parameters are drawn within each device's batch: one for the batch, one per pair of "
        "samples i and B-1-i, or one per sample (elem).",
    )
    erase_prob: float = setting(
        0.0,
        "Random erasing: each sample with this probability gets erase_count rectangles (2% to 1/3 of the "
        "image together, aspect 0.3 to 3.3), filled per erase_mode; 0 = off.",
    )
    erase_mode: EraseMode = setting(
        EraseMode.const,
        "What erased rectangles hold, in normalised units: const = 0 (the mean colour), rand = one "
        "standard-normal colour per rectangle, pixel = standard-normal noise per pixel.",
    )
    erase_count: int = setting(1, "Rectangles erased in a sample that random erasing picks.")
    randaugment: str | None = setting(
        None,
        'RandAugment as timm\'s config string ("rand-m9-mstd0.5-inc1": magnitude 9 of 10, its noise, the '
        "increasing op set; n layers, p per op, mmax, tweights); null = off.",
    )
    trivialaugment: bool = setting(
        False,
        "torchvision's TrivialAugmentWide: one of 14 operations at one of 31 magnitudes.",
    )
    interpolation: Interpolation = setting(
        Interpolation.bilinear,
        "How RandAugment's and TrivialAugment's geometric operations resample.",
    )
    fill: list[float] | None = setting(
        None,
        "What RandAugment's and TrivialAugment's geometric operations fill with, 0..255 per channel; "
        "null = the data's mean colour, round(255 * data.mean), as timm fills with img_mean.",
    )

    def mixing(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0 or self.cutmix_minmax is not None

    def policy_on(self) -> bool:
        return bool(self.randaugment) or self.trivialaugment

    def active(self) -> bool:
        return self.mixing() or self.erase_prob > 0 or self.policy_on()

    def check(self) -> None:
        for name in ("mixup_alpha", "cutmix_alpha"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"augment.{name} must be >= 0 (0 = off), got {value}")
        for name in ("mix_prob", "switch_prob", "erase_prob"):
            value = getattr(self, name)
            if not 0 <= value <= 1:  # NaN fails too
                raise ConfigError(f"augment.{name} must be a probability in [0, 1], got {value}")
        if self.cutmix_minmax is not None:
            low_high = list(self.cutmix_minmax)
            if len(low_high) != 2 or not 0 < low_high[0] < low_high[1] <= 1:
                raise ConfigError(
                    f"augment.cutmix_minmax must be [min, max] with 0 < min < max <= 1, got {low_high}"
                )
        if self.erase_count < 1:
            raise ConfigError(f"augment.erase_count must be at least 1, got {self.erase_count}")
        mixup, cutmix = self.mixup_alpha > 0, self.cutmix_alpha > 0 or self.cutmix_minmax is not None
        refuse_idle_settings(
            self,
            "augment",
            ("mix_prob", "mix_mode", self.mixing(), "augment.mixup_alpha or augment.cutmix_alpha"),
            ("switch_prob", None, mixup and cutmix, "both augment.mixup_alpha and augment.cutmix_alpha"),
            ("erase_mode", "erase_count", self.erase_prob > 0, "augment.erase_prob"),
            ("interpolation", "fill", self.policy_on(), "augment.randaugment or augment.trivialaugment"),
        )
        if self.randaugment and self.trivialaugment:
            raise ConfigError("augment.randaugment and augment.trivialaugment are two policies: choose one")
        if self.fill is not None and not all(0 <= value <= 255 for value in self.fill):
            raise ConfigError(
                f"augment.fill is 0..255 per channel (or null: the mean colour), got {list(self.fill)}"
            )
