"""The closed choices of the config: each enum is the set of values one key accepts."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple


class LastBatch(str, Enum):
    """What to do with training samples that cannot fill a whole global batch."""

    pad = "pad"  # wrap around to the epoch's first samples; they weigh zero in the loss
    drop = "drop"  # leave them out of this epoch (a different tail each epoch)


# What to do with a corrupt or incomplete sample or shard. skip: log it
# (bounded), count it and fill its place, so the step count never changes;
# raise: stop the run naming the shard and sample. The functional form lets a
# member be called "raise", which is what users type (data.on_error=raise).
OnError = Enum("OnError", {"skip": "skip", "raise": "raise"}, type=str)


class TrainCrop(str, Enum):
    """How a training image becomes the model's input."""

    # Zero-pad by data.crop_padding and crop back at a random offset (the
    # CIFAR recipe): for small images all of one size.
    pad_crop = "pad_crop"
    # torchvision's RandomResizedCrop to data.image_size (the ImageNet
    # recipe), for images of any size; evaluation then resizes the shorter
    # side to image_size / eval_crop_ratio and takes the centre square.
    random_resized = "random_resized"


class Decode(str, Enum):
    """Where the JPEGs of data.train_crop=random_resized are decoded."""

    # In the DataLoader workers (libjpeg-turbo, at the DCT scale the crop allows).
    host = "host"
    # On the replica's device (nvJPEG on a GPU, through torchvision.io.decode_jpeg):
    # the workers read the bytes and draw the crops; the native runtime only.
    device = "device"


class IndexMode(str, Enum):
    """What to do when no sample count is recorded for a shard."""

    auto = "auto"  # count the shards at start (once per job) and save an index for the next run
    never = "never"  # a missing count is an error: run `tpustream-index` first


class Device(str, Enum):
    CPU = "CPU"
    TPU = "TPU"
    CUDA = "CUDA"  # NVIDIA GPUs, on the native runtime only (accelerator=cuda)


class RuntimeKind(str, Enum):
    """What runs the replicas' tensors: torch_xla, or PyTorch itself."""

    xla = "xla"  # an XLA device per replica (TPU core, XLA CPU device) or a GSPMD mesh
    native = "native"  # PyTorch without torch_xla: a process per GPU (CUDA) or per CPU replica


class Collectives(str, Enum):
    xla = "xla"  # torch_xla collectives across the XLA devices of an xmp.spawn job (TPU, one CPU device)
    # torch.distributed over gloo: the simulated pod (runtime=xla: each process its own
    # XLA CPU device) or CPU replicas of runtime=native.
    gloo = "gloo"
    nccl = "nccl"  # torch.distributed over NCCL between GPUs (runtime=native, device=CUDA)


class Accelerator(str, Enum):
    """What runs a job: the accelerator group's options (conf/accelerator/), each one platform."""

    cpu = "cpu"  # one XLA CPU device (N virtual ones as a GSPMD mesh)
    tpu = "tpu"  # every TPU core of the host through torch_xla
    cpu_pod = "cpu_pod"  # a pod simulated on one machine: XLA CPU processes reducing over gloo
    cuda = "cuda"  # every GPU of the host in PyTorch itself, over NCCL
    cpu_eager = "cpu_eager"  # CPU processes in PyTorch itself (no XLA), over gloo


class Platform(NamedTuple):
    """The device type, runtime and collectives an accelerator implies."""

    device: Device
    runtime: RuntimeKind
    collectives: Collectives


# Adding an accelerator: an Accelerator member, its row here, and conf/accelerator/<name>.yaml.
PLATFORMS = {
    Accelerator.cpu: Platform(Device.CPU, RuntimeKind.xla, Collectives.xla),
    Accelerator.tpu: Platform(Device.TPU, RuntimeKind.xla, Collectives.xla),
    Accelerator.cpu_pod: Platform(Device.CPU, RuntimeKind.xla, Collectives.gloo),
    Accelerator.cuda: Platform(Device.CUDA, RuntimeKind.native, Collectives.nccl),
    Accelerator.cpu_eager: Platform(Device.CPU, RuntimeKind.native, Collectives.gloo),
}


class Precision(str, Enum):
    fp32 = "fp32"
    # Convolutions and matmuls in bfloat16 under torch.autocast on the XLA
    # device; weights, optimizer state, loss and metrics stay float32.
    # (XLA_USE_BF16, the old mechanism, is deprecated upstream.)
    bf16 = "bf16"


class Strategy(str, Enum):
    # Every replica holds the whole model; gradients averaged by xm.optimizer_step.
    ddp = "ddp"
    # PyTorch's FSDP2 on the native runtime (GPUs): parameters, gradients and
    # optimizer state sharded over the replicas. On XLA devices spmd_fsdp does
    # this (launch refuses fsdp there).
    fsdp = "fsdp"
    # One process per host drives all of its devices as one GSPMD program:
    # data parallel over the device mesh, the model replicated.
    spmd = "spmd"
    # GSPMD with FSDPv2: parameters, gradients and optimizer state sharded
    # along the mesh; the answer for models that do not fit one core.
    spmd_fsdp = "spmd_fsdp"


# The strategies that run one GSPMD program per host instead of a process per device.
SPMD_STRATEGIES = (Strategy.spmd, Strategy.spmd_fsdp)

# The GSPMD mesh's axes, outermost first (mesh.*): slices over the data-centre
# network, then a slice's devices. FSDPv2 requires the name "fsdp".
MESH_AXES = ("slices", "data", "fsdp", "tensor")
# The axes a batch is split over; the tensor axis sees the same samples.
BATCH_AXES = ("slices", "data", "fsdp")


class ModelLibrary(str, Enum):
    """Where model.name is looked up."""

    tpustream = "tpustream"  # the built-in families (small_cnn, resnet18, resnet50, wrn_seed)
    timm = "timm"  # any timm image classifier: timm.create_model(name, num_classes, in_chans, **options)
    torchvision = "torchvision"  # torchvision.models.get_model(name, num_classes, **options)


class OptimizerName(str, Enum):
    sgd = "sgd"
    adamw = "adamw"
    # SGD with momentum and a per-tensor trust ratio (You et al. 2017); the
    # MLPerf ResNet-50 optimizer for global batches up to 32k and more.
    lars = "lars"
    # Adam with a per-tensor trust ratio (You et al. 2019).
    lamb = "lamb"


class Schedule(str, Enum):
    cosine = "cosine"  # linear warmup, then cosine decay to min_lr_ratio * lr
    constant = "constant"  # linear warmup, then constant
    # linear warmup, then lr x decay_factor ** (epochs done // decay_every_epochs),
    # not below min_lr_ratio * lr (pytorch/xla's WarmupAndExponentialDecayScheduler)
    step = "step"
    # linear warmup, then lr x (1 - progress) ** poly_power, not below
    # min_lr_ratio * lr (MLPerf ResNet-50's LARS schedule, power 2)
    poly = "poly"


class EpochsChange(str, Enum):
    """What a cosine or poly schedule does when a run is continued with other `epochs` (training.schedule)."""

    refuse = "refuse"  # stop before spawning and say what each choice would do to the lr
    keep = "keep"  # the schedule keeps the horizon it was drawn over (its floor after it)
    restart = "restart"  # a new phase from where the run is to the new epochs: warmup, then the decay
    stretch = "stretch"  # redrawn over the new epochs, as if they had been asked from the start


class BestOf(str, Enum):
    """Which weights' validation accuracy best.pt and early stopping follow."""

    raw = "raw"  # the weights the optimizer trains
    ema = "ema"  # their exponential moving average (ema.decay > 0)


class MixMode(str, Enum):
    """How mixup/cutmix parameters are drawn (timm's Mixup modes), within each device's batch."""

    batch = "batch"  # one lambda (and box) for the whole batch
    pair = "pair"  # one per pair of samples i and B-1-i
    elem = "elem"  # one per sample


class Interpolation(str, Enum):
    """How RandAugment's and TrivialAugment's geometric operations resample (torchvision's tensor modes)."""

    nearest = "nearest"  # torchvision's TrivialAugmentWide default
    bilinear = "bilinear"  # timm's RandAugment draws bilinear or bicubic; bicubic is not built


class EraseMode(str, Enum):
    """What random erasing fills its rectangles with (timm's RandomErasing modes), in normalised units."""

    const = "const"  # 0: the mean colour
    rand = "rand"  # one standard-normal colour per rectangle
    pixel = "pixel"  # standard-normal noise per pixel (hashed on the device from a key per sample)
