"""Checks before spawning: each bad input is one clear error, and nothing is spawned."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_train
from tpustream.checkpoint.local_tier import local_checkpoint_url
from tpustream.errors import ConfigError
from tpustream.launch import prepare


@pytest.fixture
def prepared(compose_config, digits_root):
    def run(*overrides: str):
        return prepare(compose_config(f"data.root={digits_root}", "resume=null", *overrides))

    return run


def test_a_good_config_prepares_a_plan(prepared):
    plan = prepared()
    assert plan.train.num_samples == 1438 and plan.val.num_samples == 359
    assert plan.cfg.data.train_shards.endswith("/train") and plan.resume_url is None


TRIVIAL = ("augment.trivialaugment=true",)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["accelerator.num_devices=2"], r"XLA:CPU collectives deadlock.*pytorch/xla/issues/9089"),
        (["accelerator=tpu", "accelerator.num_devices=4"], "TPU_VISIBLE_CHIPS"),
        (["batch_size=2000"], r"batch_size=2000 is larger than a replica's share.*1438 samples"),
        (["data.last_batch=drop", "batch_size=1438", "epochs=1"], None),
        (
            ["data.mean=[0.5]", "data.std=[0.5]"],
            r"data.mean and data.std have 1 values, images have 3 channel\(s\) \(the data's\)",
        ),
        # Both must change, and the message says so with the values to give.
        (
            ["data.channels=1"],
            r"data.mean and data.std have 3 values, images have 1 channel\(s\) \(data.channels=1\): give "
            r"both one value per channel, e.g. data.mean=\[0.5\] data.std=\[0.25\]$",
        ),
        # The fill's channels, before spawning, as its range is.
        (
            ["data.channels=1", "data.mean=[0.5]", "data.std=[0.25]", "augment.fill=[1,2,3]", *TRIVIAL],
            r"augment.fill has 3 values, images have 1 channel\(s\) \(data.channels=1\): .*fill=\[128\]",
        ),
        (["data.channels=1", "data.mean=[0.5]", "data.std=[0.25]", "augment.fill=[7]", *TRIVIAL], None),
        # Settings that would do nothing.
        (["augment.mix_prob=0.5"], r"augment.mix_prob=0.5 acts only with augment.mixup_alpha or augment"),
        (["augment.mix_prob=0.5", "augment.cutmix_alpha=1.0"], None),
        (["augment.mix_mode=elem"], r"augment.mix_mode=elem acts only with augment.mixup_alpha or augment"),
        (["augment.cutmix_alpha=1", "augment.switch_prob=0.2"], r"switch_prob=0.2 acts only with both augm"),
        (["augment.cutmix_alpha=1", "augment.mixup_alpha=0.2", "augment.switch_prob=0.2"], None),
        (["augment.erase_count=2"], r"augment.erase_count=2 acts only with augment.erase_prob, which is off"),
        (["augment.fill=[9,9,9]"], r"augment.fill=\[9.0, 9.0, 9.0\] acts only with augment.randaugment or"),
        (["augment.trivialaugment=true", "augment.interpolation=nearest"], None),
        (["ema.decay=0.9", "ema.warmup_power=0.75"], r"ema.warmup_power=0.75 acts only with ema.warmup=true"),
        (["ema.warmup=true"], r"ema.warmup=true ramps the average's decay up to ema.decay, which is 0"),
        (["ema.warmup=true", "ema.decay=0.99"], None),
        (["model.name=vit"], "model.name='vit' is not a known model"),
        (["epochs=0"], "epochs must be at least 1"),
        (
            ["+model.options.depth=3"],
            "model.options for small_cnn: got an unexpected keyword argument 'depth'",
        ),
        (["data.num_workers=-1"], "num_workers"),
        (["resume=/nonexistent/last.pt"], "resume=/nonexistent/last.pt: no checkpoint"),
        (["micro_batches=3"], r"micro_batches=3 must divide batch_size=64"),
        (["micro_batches=0"], "micro_batches must be at least 1"),
        (["eval_every=-1"], "eval_every must be >= 0"),
        (["eval_every=0", "early_stop_patience=2"], "early_stop_patience needs validation"),
        (["optim.reference_batch_size=0"], "optim.reference_batch_size must be at least 1"),
        (["strategy=fsdp"], r"strategy=fsdp is PyTorch's FSDP2, on the native runtime .* strategy=spmd_fsdp"),
        (["accelerator=cpu_pod", "strategy=fsdp"], r"strategy=fsdp is PyTorch's FSDP2"),
        # N virtual CPU devices: one GSPMD process (spmd, spmd_fsdp), never N ddp processes.
        (["strategy=spmd", "accelerator.num_devices=4"], None),
        (["accelerator.num_devices=4", "strategy=ddp"], r"strategy=ddp.*use 1, strategy=spmd or spmd_fsdp"),
        (["accelerator=cpu_pod", "strategy=spmd_fsdp"], "the simulated pod .* runs strategy=ddp only"),
        (
            ["strategy=spmd", "accelerator.num_devices=0"],
            r"accelerator.num_devices must be at least 1 \(or null: every device\), got 0",
        ),
        # Not the XLA:CPU collectives message, which cannot help here.
        (["accelerator.num_devices=0"], r"accelerator.num_devices must be at least 1"),
        (["checkpoint.every_n_steps=-5"], r"checkpoint.every_n_steps must be >= 0"),
        (["optim.momentum=1.5"], r"optim.momentum must be in \[0, 1\), got 1.5"),
        (["early_stop_patience=-1"], "early_stop_patience must be >= 0"),
        (["fsdp_wrap_min_params=-1"], "fsdp_wrap_min_params must be >= 0"),
        (["checkpoint.stop_check_every=0"], "checkpoint.stop_check_every must be at least 1"),
        (["data.crop_padding=40"], r"data.crop_padding=40 on 32-pixel images: .* use less than 32"),
        (["model.options.width=0"], r"model small_cnn: model.options.width must be a whole number >= 1"),
        (["model.options.norm=layer"], r"model.options.norm='layer' is not one of batch, group"),
        (["model=wrn_seed", "model.options.k=0"], r"model wrn_seed: model.options.k must be a whole number"),
        (
            ["accelerator=tpu", "strategy=spmd", "accelerator.num_devices=4"],
            "drives every device of the host",
        ),
        (["strategy=spmd", "debug.check_sync_every=5"], "strategy=spmd runs one program with one model"),
        # The mesh (mesh.*): the GSPMD strategies', fitting the devices, before anything is spawned.
        (["mesh.fsdp=2"], r"mesh.fsdp lays out the device mesh of strategy=spmd / spmd_fsdp; strategy=ddp"),
        (
            ["strategy=spmd", "accelerator.num_devices=4", "mesh.fsdp=3"],
            r"mesh: mesh.data=null x mesh.fsdp=3 x mesh.tensor=1 does not divide a slice's 4 devices",
        ),
        (
            ["strategy=spmd", "accelerator.num_devices=4", "mesh.data=-1", "mesh.fsdp=-1"],
            "only one mesh axis",
        ),
        (["strategy=spmd", "accelerator.num_devices=4", "mesh.slices=2"], "multislice joins TPU slices"),
        (["strategy=spmd", "mesh.rules=[[x,[model]]]"], r"'model' in the spec of 'x' is not a mesh axis"),
        (["strategy=spmd_fsdp", "accelerator.num_devices=4", "mesh.fsdp=2", "mesh.tensor=2"], None),
        (
            [
                "strategy=spmd",
                "accelerator.num_devices=4",
                "mesh.tensor=2",
                "model=timm",
                "model.name=vit_tiny_patch16_224",
                "+model.options.img_size=32",
                "+model.options.patch_size=4",
                "+model.options.embed_dim=48",
                "+model.options.num_heads=3",
            ],
            r"mesh.tensor=2 does not divide the 3 heads of blocks.0.attn",
        ),
        (["model.remat=true"], r"model.remat=true: small_cnn has no blocks to recompute"),
        (["model=resnet18", "model.remat=true"], None),
        # A replica (this host) loads batch_size per device: 4 x 400 is more than the 1438 samples.
        (
            ["strategy=spmd_fsdp", "accelerator.num_devices=4", "batch_size=400"],
            r"batch_size=400 x 4 devices",
        ),
        (
            ["accelerator=cpu_eager", "strategy=fsdp", "debug.check_sync_every=1"],
            "every replica holds a different shard",
        ),
        (["debug.profiler_port=70000"], "debug.profiler_port must be a TCP port"),
        (["debug.profile_steps=[5,5]"], r"debug.profile_steps is \[START, END\] with 1 <= START < END"),
        (["augment.randaugment=rand-m9-q2"], r"augment.randaugment='rand-m9-q2': unknown section 'q2'"),
        (["xla_cache_dir=gs://bkt/cache"], "the compile cache must be a local folder"),
        (["data.label_key=json:"], "needs a JSON field after 'json:'"),
        (["data.image_key='jpg;'"], "has an empty alternative"),
        (["data.channels=2"], "data.channels must be 1 or 3"),
        (["data.num_classes=5"], "data.num_classes=5, but the manifest of .* lists 10 classes"),
        (["data.image_size=64"], "data.image_size=64, but the manifest of .* says its images are 32x32"),
        (["data.stages=[nowhere.module:stage]"], r"data.stages entry 'nowhere.module:stage': cannot import"),
        (["data.stages=[tests.user_stages:missing]"], "has no callable 'missing'"),
        (["data.eval_crop_ratio=0"], r"data.eval_crop_ratio must be in \(0, 1\], got 0.0"),
        (["optim.lr=-0.1"], r"optim.lr must be a positive number, got -0.1"),
        (["optim.decay_factor=0"], r"optim.decay_factor in \(0, 1\], got 30.0 and 0.0"),
        (["seed=-1"], "seed must be >= 0"),
        (["data.prefetch_factor=0"], "data.prefetch_factor must be at least 1, got 0"),
        (["optim.label_smoothing=1.5"], r"optim.label_smoothing must be in \[0, 1\), got 1.5"),
        (["data.root=???"], r"data.root has no value: set it, or pick a config group option that does"),
        (["+optim.lrr=0.1"], r"unknown config key optim.lrr \(known here: lr\)"),
        (["accelerator=tpu"], "accelerator=tpu, but this machine has no TPU chips"),
        (["accelerator=cuda"], r"accelerator=cuda, but PyTorch sees no GPU here"),
        (["accelerator=cpu_pod", "accelerator.num_devices=null"], "simulated pod .* needs accelerator.num"),
        (["accelerator=cpu_pod", "strategy=spmd"], "the simulated pod .* runs strategy=ddp only"),
        (["accelerator=cpu_eager", "strategy=spmd"], "strategy=spmd is torch_xla's GSPMD"),
        (["accelerator=cpu_eager", "strategy=fsdp", "accelerator.channels_last=true"], "FSDP2 .* contiguous"),
        (["accelerator=cpu_eager", "strategy=fsdp", "optim=lamb"], "optim=lamb takes a norm of every whole"),
        (["accelerator=cpu_eager", "accelerator.num_devices=2", "strategy=fsdp"], None),
        (["accelerator=cpu_eager", "debug.metrics=true"], "debug.metrics reads torch_xla's"),
        (["data.num_workers=two"], r"data.num_workers must be a whole number >= 0 or auto, got 'two'"),
        (["output_dir=/dev/null/run"], r"output_dir: /dev/null/run: cannot write here"),
    ],
)
def test_bad_config_is_a_config_error(prepared, overrides, message):
    if message is None:
        prepared(*overrides)  # exactly one global batch: allowed
        return
    with pytest.raises(ConfigError, match=message):
        prepared(*overrides)


def test_crops_far_larger_than_the_stored_images_are_named_in_a_warning(prepared, caplog):
    """+experiment=deit_small on 32 px data upsamples every crop 7x; a warning, not an
    error, since fine-tuning a 224 px model on upsampled small images is common practice."""
    deit = (
        "+experiment=deit_small",
        "data.val_shards=${data.root}/test",
        "precision=fp32",
        "data.num_workers=0",
    )
    with caplog.at_level(logging.WARNING, logger="tpustream.launch.checks"):
        prepared(*deit)
    assert (
        "data.image_size=224: model=timm deit_small_patch16_224 is trained on 224x224 crops of images stored "
        "at 32x32 at most, each upsampled 7x or more; to train at the data's size, set data.image_size=32"
    ) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tpustream.launch.checks"):
        prepared(*deit, "data.image_size=48", "+model.options.img_size=48")  # 1.5x: no warning
    assert "upsampled" not in caplog.text


def test_missing_data_is_named(compose_config, digits_root, tmp_path, gcs_emulator):
    with pytest.raises(ConfigError, match=f"{tmp_path}/nothing/train: cannot list the shards"):
        prepare(compose_config(f"data.root={tmp_path}/nothing"))
    with pytest.raises(ConfigError, match="bucket gs://missing-bucket-abc does not exist"):
        prepare(compose_config("data.root=gs://missing-bucket-abc/digits"))


def test_empty_manifest_and_mismatched_splits(compose_config, digits_root, write_split, tmp_path):
    root = tmp_path / "data"
    shutil.copytree(f"{digits_root}/train", root / "train")
    write_split("test", [[]], root=str(root), image_size=32)
    with pytest.raises(ConfigError, match="has no samples"):
        prepare(compose_config(f"data.root={root}"))
    from tests.conftest import numbered_samples

    write_split("test", [numbered_samples(0, 3, 8)], root=str(root), image_size=8)
    with pytest.raises(ConfigError, match="train images are 3x\\(32, 32\\), validation images 3x\\(8, 8\\)"):
        prepare(compose_config(f"data.root={root}"))


def test_train_py_reports_bad_input_in_one_line_without_spawning(tmp_path):
    result = run_train(f"data.root={tmp_path}/absent", f"hydra.run.dir={tmp_path}/h", timeout=120)
    assert result.returncode == 2
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and f"{tmp_path}/absent/train: cannot list the shards" in errors[0]
    assert "Traceback" not in output and "launching" not in output


class FakeRuntime:
    """What check_same_counts needs of a runtime: the values every replica passes to a host gather."""

    def __init__(self, others: list[str]):
        self.others = others

    def all_gather_host(self, tag: str, value):
        return [value, *self.others]


def test_replicas_that_planned_from_different_counts_stop_before_the_first_step(prepared):
    from tpustream.launch.replica import check_same_counts, counts_fingerprint

    plan = prepared()
    mine = counts_fingerprint(plan.train, plan.val)
    check_same_counts(FakeRuntime([mine, mine]), plan.train, plan.val)
    with pytest.raises(ConfigError, match=f"different shard counts \\(this host {mine}, others 0123"):
        check_same_counts(FakeRuntime([mine, "0123"]), plan.train, plan.val)


def test_a_bad_environment_setting_is_one_line_before_spawning(prepared, monkeypatch):
    monkeypatch.setenv("TPUSTREAM_GCS_RETRY_SECONDS", "abc")
    with pytest.raises(ConfigError, match="TPUSTREAM_GCS_RETRY_SECONDS='abc': expected a positive number"):
        prepared()


@pytest.mark.parametrize(
    ("accelerator", "user_flags", "expected"),
    [
        ("cpu", None, "--xla_backend_optimization_level=1"),
        ("cpu", "--xla_dump_to=/tmp/d", "--xla_dump_to=/tmp/d --xla_backend_optimization_level=1"),
        ("cpu", "--xla_backend_optimization_level=3", "--xla_backend_optimization_level=3"),  # the user's
        ("tpu", "--xla_dump_to=/tmp/d", "--xla_dump_to=/tmp/d"),  # TPU code is not LLVM -O anything
    ],
)
def test_the_xla_cpu_device_compiles_at_o1_unless_the_user_chose(
    compose_config, monkeypatch, accelerator, user_flags, expected
):
    from tpustream.launch import resolve_config
    from tpustream.launch.spawn import configure_device_environment

    for name in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    if user_flags is not None:
        monkeypatch.setenv("XLA_FLAGS", user_flags)
    configure_device_environment(resolve_config(compose_config(f"accelerator={accelerator}"))[0])
    assert os.environ.get("XLA_FLAGS") == expected


def test_an_xla_run_without_torch_xla_installed_is_one_line_naming_the_extra(prepared, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec

    def find_spec(name, *args):
        return None if name == "torch_xla" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError, match=r"needs torch_xla, which is not installed: pip install"):
        prepared("accelerator=cpu")
    from tpustream.config import RuntimeKind

    assert prepared("accelerator=cpu_eager").cfg.accelerator.runtime == RuntimeKind.native  # no torch_xla


def test_output_dir_in_a_missing_bucket_fails_before_training(prepared, gcs_emulator):
    with pytest.raises(ConfigError, match="output_dir: gs://no-such-bucket-tps/run: cannot write here"):
        prepared("output_dir=gs://no-such-bucket-tps/run")


def checkpoint_bytes(
    weights: dict, config: dict | None = None, data_plan: dict | None = None, **position
) -> bytes:
    """A checkpoint as the trainer writes one: these weights, config, data plan and TrainState fields."""
    from tpustream.checkpoint import encode_checkpoint
    from tpustream.training.state import TrainState

    content = TrainState(**position).to_checkpoint(
        model=weights, optimizer={}, strategy="ddp", rng={}, data_plan=data_plan or {}, config=config or {}
    )
    return encode_checkpoint({**content, "config": config})


def test_resuming_another_model_is_one_line_naming_the_tensor(prepared, tmp_path):
    from tpustream import storage
    from tpustream.models import create_model

    out = str(tmp_path / "run")
    weights = create_model("small_cnn", num_classes=10, image_size=32, channels=3, width=8).state_dict()
    storage.write_bytes(f"{out}/checkpoints/last.pt", checkpoint_bytes(weights))
    prepared(f"output_dir={out}", "resume=auto", "model.options.width=8")  # the same model: fine
    with pytest.raises(
        ConfigError, match=r"holds another model than model.name=small_cnn with 10 classes \(.* differ"
    ):
        prepared(f"output_dir={out}", "resume=auto")


def test_a_checkpoint_of_another_model_is_advised_by_what_the_run_wants_of_it(prepared, tmp_path):
    """Evaluating or starting from it needs its model (model=), not another output_dir."""
    from tpustream import storage
    from tpustream.models import create_model

    weights = create_model("resnet18", num_classes=10, image_size=32, channels=3).state_dict()
    saved = {"model": {"library": "tpustream", "name": "resnet18", "options": {}}}
    url = f"{tmp_path}/run/checkpoints/last.pt"
    storage.write_bytes(url, checkpoint_bytes(weights, saved))
    other = f"output_dir={tmp_path}/other"
    with pytest.raises(
        ConfigError,
        match=r"holds another model than model.name=small_cnn .*\); to evaluate it, use model=resnet18 as it "
        r"was saved with, or name another checkpoint in resume$",
    ):
        prepared(other, f"resume={url}", "eval_only=true")
    with pytest.raises(ConfigError, match=r"; to train on from it, use model=resnet18 as it was saved with"):
        prepared(other, f"resume={url}")
    with pytest.raises(
        ConfigError,
        match=r"; to continue it, use model=resnet18 as it was saved with; else use another output_dir, or "
        r"resume=overwrite to delete",
    ):
        prepared(f"output_dir={tmp_path}/run", "resume=auto")
    # The same model with other options: those options are what to set.
    storage.write_bytes(
        url,
        checkpoint_bytes(
            create_model("small_cnn", num_classes=10, image_size=32, channels=3, width=8).state_dict(),
            {"model": {"name": "small_cnn", "options": {"width": 8}}},
        ),
    )
    with pytest.raises(
        ConfigError, match=r"to evaluate it, use model.options \{'width': 8\} as it was saved"
    ):
        prepared(other, f"resume={url}", "eval_only=true")


@pytest.mark.slow
def test_one_bad_job_of_a_multirun_does_not_stop_the_others(digits_root, tmp_path):
    result = run_train(
        "-m", f"data.root={digits_root}", "seed=-1,-2", f"hydra.sweep.dir={tmp_path}/sweep", "log_dir=null"
    )
    assert result.returncode == 2
    output = result.stdout + result.stderr
    assert output.count("seed must be >= 0") >= 2  # the second job ran after the first failed
    assert "2 job(s) of the multirun failed: job 0: seed must be >= 0" in result.stderr


def test_a_run_folder_continued_under_another_config_is_refused_naming_the_keys(prepared, tmp_path, caplog):
    from tpustream import storage
    from tpustream.models import create_model

    out = str(tmp_path / "run")
    made = prepared(f"output_dir={out}", "optim.lr=0.05")
    weights = create_model("small_cnn", num_classes=10, image_size=32, channels=3).state_dict()
    storage.write_bytes(f"{out}/checkpoints/last.pt", checkpoint_bytes(weights, made.config_dict))
    # Where and on what it runs, and longer (saying what the schedule does): the same run, continued.
    longer = ("epochs=30", "optim.on_epochs_change=restart")
    prepared(f"output_dir={out}", "resume=auto", "optim.lr=0.05", *longer, "data.num_workers=0")
    with pytest.raises(
        ConfigError,
        match=r"holds a run made with another config \(batch_size: 64 -> 32; "
        r"optim.lr: 0.05 -> 0.1\): choose another output_dir, set resume=force to continue that run",
    ):
        prepared(f"output_dir={out}", "resume=auto", "batch_size=32")
    assert prepared(f"output_dir={out}", "resume=force").resume_url.endswith("/checkpoints/last.pt")
    caplog.clear()
    prepared(f"output_dir={tmp_path}/new", f"resume={out}/checkpoints/last.pt")  # named: fine-tuning
    assert "written with another config (optim.lr: 0.05 -> 0.1)" in caplog.text


def test_a_run_with_canonical_streams_continues_on_another_shape_with_its_global_batch(prepared, tmp_path):
    """batch_size may change with the shape; what cannot continue is one line before spawning."""
    from tpustream import storage
    from tpustream.models import create_model

    out = str(tmp_path / "run")
    made = prepared(
        f"output_dir={out}", "accelerator=cpu_eager", "accelerator.num_devices=2", "batch_size=32"
    )
    weights = create_model("small_cnn", num_classes=10, image_size=32, channels=3).state_dict()
    # Stopped at step 5 of epoch 0 on 2 replicas x 32 x 2 workers, with 4 canonical streams.
    plan = {"world_size": 2, "batch_size": 32, "num_workers": 2, "steps_per_epoch": 23, "seed": 0}
    plan.update(streams=4, stream_buffer=1000, global_batch=64)
    written = checkpoint_bytes(weights, made.config_dict, plan, step=5, global_step=5)
    storage.write_bytes(f"{out}/checkpoints/last.pt", written)
    eager = ("accelerator=cpu_eager", f"output_dir={out}", "resume=auto")
    for shape in (("accelerator.num_devices=4", "batch_size=16", "data.num_workers=1"), ("batch_size=64",)):
        resumed = prepared(*eager, *shape)
        assert resumed.partition(resumed.cfg.accelerator.num_devices, resumed.cfg.batch_size).streams == 4
    with pytest.raises(
        ConfigError, match=r"global batch of 64 .*: set batch_size=64 to continue it on 1 replica"
    ):
        prepared(*eager, "batch_size=32", "accelerator.num_devices=1")
    with pytest.raises(
        ConfigError, match=r"8 replica\(s\) cannot share the run's 4 canonical streams evenly: .* 1, 2, 4 rep"
    ):
        prepared(*eager, "accelerator.num_devices=8", "batch_size=8")
    with pytest.raises(ConfigError, match=r"data.num_workers=3 is more than the 1 canonical stream"):
        prepared(*eager, "accelerator.num_devices=4", "batch_size=16", "data.num_workers=3")
    # A checkpoint named by resume=URL (fine-tuning in another folder) may have another global batch.
    named = prepared(
        *eager[:1],
        f"output_dir={tmp_path}/tuned",
        f"resume={out}/checkpoints/last.pt",
        "batch_size=16",
        "data.streams=2",
    )
    assert named.partition(1, 16).streams == 2  # its own partition: the epoch restarts under it
    # Under a per-reader plan (an older run) batch_size stays part of the run's config.
    storage.write_bytes(
        f"{out}/checkpoints/last.pt",
        checkpoint_bytes(weights, made.config_dict, plan | {"streams": 0}, step=5),
    )
    with pytest.raises(ConfigError, match=r"another config \(batch_size: 32 -> 16"):
        prepared(*eager, "accelerator.num_devices=4", "batch_size=16")
    older = prepared(*eager, "accelerator.num_devices=2", "batch_size=32")
    assert older.partition(2, 32) is None  # and keeps it: the epoch resumes only on the same shape


def test_a_run_without_canonical_streams_continues_mid_epoch_on_its_own_shape_only(prepared, tmp_path):
    """Its order is cut for replicas x batch x workers; another shape would retrain steps."""
    from tpustream import storage
    from tpustream.models import create_model

    out = str(tmp_path / "run")
    made = prepared(f"output_dir={out}", "accelerator=cpu_eager", "data.streams=0")
    weights = create_model("small_cnn", num_classes=10, image_size=32, channels=3).state_dict()
    # Stopped at step 5 of epoch 1 on 1 replica x 64 x 2 workers, without canonical streams.
    plan = {"world_size": 1, "batch_size": 64, "num_workers": 2, "steps_per_epoch": 23, "seed": 0}
    written = checkpoint_bytes(weights, made.config_dict, plan, epoch=1, step=5, global_step=28)
    storage.write_bytes(f"{out}/checkpoints/last.pt", written)
    eager = ("accelerator=cpu_eager", f"output_dir={out}", "resume=auto", "data.streams=0")
    assert prepared(*eager).partition(1, 64) is None  # its own shape: it continues at step 5
    assert prepared(*eager, "data.num_workers=auto").cfg.data.num_workers == 2  # resolved to its count
    with pytest.raises(
        ConfigError,
        match=r"last.pt stopped at step 5 of epoch 1 in an order cut for its shape .*data.streams=0.*"
        r"\(2 worker\(s\) -> 4 worker\(s\)\): resume it with data.num_workers=2 to finish the epoch .*"
        r"or set resume=force to restart epoch 1 from its first batch \(the samples of its first 5 step",
    ):
        prepared(*eager, "data.num_workers=4")
    with pytest.raises(ConfigError, match=r"\(1 replica\(s\) -> 2 replica\(s\)\): resume it on 1 replica"):
        prepared(*eager, "accelerator.num_devices=2")
    assert prepared(*eager, "data.num_workers=4", "resume=force").partition(1, 64) is None
    # Named by resume=URL (fine-tuning in another folder): the epoch restarts, as under resume=force.
    named = (f"output_dir={tmp_path}/tuned", f"resume={out}/checkpoints/last.pt", "data.num_workers=4")
    assert prepared(*eager[:1], *named, "data.streams=0").partition(1, 64) is None


def finished_run(out: str, epochs: int = 3, best_epoch: int = 1) -> bytes:
    """A run folder as a run of small_cnn leaves it after `epochs` evaluated epochs: checkpoints, metrics."""
    from tpustream import storage
    from tpustream.checkpoint import write_metrics
    from tpustream.models import create_model

    history = [
        {"epoch": e, "val_accuracy": 0.9248 if e == best_epoch else 0.5, "val_correct": 1, "val_samples": 2}
        for e in range(epochs)
    ]
    weights = create_model("small_cnn", num_classes=10, image_size=32, channels=3).state_dict()
    data = checkpoint_bytes(weights, None, epoch=epochs, history=history, best_epoch=best_epoch)
    for name in ("best.pt", "last.pt"):
        storage.write_bytes(f"{out}/checkpoints/{name}", data)
    write_metrics(out, history)
    return data


def test_a_fresh_start_never_overwrites_a_run_without_resume_overwrite(prepared, tmp_path, caplog):
    """resume=null on a finished run refused, naming what it would lose; overwrite deletes."""
    from tpustream.checkpoint import read_metrics

    out = str(tmp_path / "run")
    finished_run(out)
    with pytest.raises(
        ConfigError,
        match=r"holds a run \(3 epoch\(s\), best validation accuracy 92.48% at epoch 1\) that resume=null "
        r"would overwrite \(checkpoints/best.pt, checkpoints/last.pt, metrics.jsonl\).*resume=overwrite",
    ):
        prepared(f"output_dir={out}")  # the fixture says resume=null
    assert len(read_metrics(out)) == 3  # nothing was touched
    # The model-mismatch error's advice points at resume=overwrite, not at the refused resume=null.
    with pytest.raises(ConfigError, match=r"holds another model.*resume=overwrite to delete the run there"):
        prepared(f"output_dir={out}", "resume=auto", "model.options.width=8")
    plan = prepared(f"output_dir={out}", "resume=overwrite")
    assert plan.resume_url is None and not (tmp_path / "run" / "checkpoints" / "last.pt").exists()
    assert read_metrics(out) == [] and "deleted the earlier run" in caplog.text


def test_the_run_folders_own_checkpoint_wins_over_the_one_that_started_it(prepared, tmp_path, caplog):
    """resume=URL (fine-tuning) started the run; rerun, it continues from its own last.pt."""
    from tpustream import storage
    from tpustream.models import create_model

    weights = create_model("small_cnn", num_classes=10, image_size=32, channels=3).state_dict()
    start = str(tmp_path / "pretrained.pt")
    storage.write_bytes(start, checkpoint_bytes(weights, None))
    out = str(tmp_path / "run")
    assert prepared(f"output_dir={out}", f"resume={start}").resume_url == start
    made = prepared(f"output_dir={tmp_path}/other", "resume=null")  # this config, as the run saved it
    storage.write_bytes(f"{out}/checkpoints/last.pt", checkpoint_bytes(weights, made.config_dict, epoch=1))
    plan = prepared(f"output_dir={out}", f"resume={start}")
    assert plan.resume_url == f"{out}/checkpoints/last.pt"
    assert f"resume={start} started this run; {out} has a checkpoint of its own now" in caplog.text
    # Its own checkpoint under another config: refused as resume=auto would be.
    with pytest.raises(ConfigError, match=r"holds a run made with another config \(batch_size: 64 -> 32\)"):
        prepared(f"output_dir={out}", f"resume={start}", "batch_size=32")


def test_more_epochs_under_a_cosine_schedule_are_refused_until_the_schedule_is_chosen(prepared, tmp_path):
    """Recomputing the cosine over a changed horizon would jump the lr (seen: 0.00047 -> 0.027)."""
    from tpustream import storage
    from tpustream.models import create_model

    out = str(tmp_path / "run")
    made = prepared(f"output_dir={out}", "epochs=2")
    weights = create_model("small_cnn", num_classes=10, image_size=32, channels=3).state_dict()
    plan = {"steps_per_epoch": 10}
    storage.write_bytes(
        f"{out}/checkpoints/last.pt", checkpoint_bytes(weights, made.config_dict, plan, epoch=2)
    )
    with pytest.raises(
        ConfigError,
        match=r"^resume from .*last.pt: epochs=4 continues a run whose cosine schedule was drawn over epochs "
        r"0-2 \(epochs=2\), at epoch 2 now: set optim.on_epochs_change=keep .*, restart .*, or stretch .*$",
    ):
        prepared(f"output_dir={out}", "resume=auto", "epochs=4")
    for choice in ("keep", "restart", "stretch"):
        assert prepared(f"output_dir={out}", "resume=auto", "epochs=4", f"optim.on_epochs_change={choice}")
    # A schedule without a horizon, evaluating it, or the same epochs: nothing to decide.
    constant = ("optim.schedule=constant", "resume=force")
    assert prepared(f"output_dir={out}", "epochs=4", *constant).finished is None
    assert prepared(f"output_dir={out}", "resume=auto", "epochs=4", "eval_only=true")
    # Mid-epoch (step 5 of 10 in epoch 1) it names where the run is.
    mid = checkpoint_bytes(weights, made.config_dict, plan, epoch=1, step=5)
    storage.write_bytes(f"{out}/checkpoints/last.pt", mid)
    with pytest.raises(ConfigError, match=r"at epoch 1.5 now: .* restart \(a new phase over epochs 1.5-3:"):
        prepared(f"output_dir={out}", "resume=auto", "epochs=3")


def test_a_finished_or_early_stopped_run_is_not_trained_again(prepared, tmp_path):
    """Nothing is spawned for a finished folder; a finished named checkpoint is an error."""
    from tpustream.launch import describe_result, launch

    out = str(tmp_path / "run")
    finished_run(out, epochs=4, best_epoch=1)
    plan = prepared(f"output_dir={out}", "resume=auto", "epochs=10", "early_stop_patience=2")
    assert "stopped early after epoch 3: no better validation accuracy for 2 epoch(s)" in plan.finished
    result = launch(plan)  # no replica: a device would take seconds, and the test would hang without one
    assert describe_result(result, out).startswith("best validation accuracy 92.48% (1/2) at epoch 1")
    # More patience, or more epochs than a run without early stopping did: it trains on.
    assert prepared(f"output_dir={out}", "resume=auto", "epochs=10", "early_stop_patience=3").finished is None
    done = prepared(f"output_dir={out}", "resume=auto", "epochs=4").finished
    assert done.startswith("it already finished 4")
    with pytest.raises(
        ConfigError,
        match=r"resume=.*last.pt: nothing to train, it already finished 4 epoch\(s\) \(epochs=4\); raise",
    ):
        prepared(f"output_dir={tmp_path}/new", f"resume={out}/checkpoints/last.pt", "epochs=4")


def test_a_run_folder_hydra_cannot_create_is_one_line(tmp_path):
    """Not Hydra's traceback; exit 2 before anything starts."""
    from tpustream.launch.checks import check_run_dir

    afile = tmp_path / "afile"
    afile.write_text("")
    assert check_run_dir([f"hydra.run.dir={tmp_path}/new/run"]) is None
    assert check_run_dir(["hydra.run.dir=${oc.env:HOME}/x"]) is None  # interpolations are Hydra's
    assert "is a file, not a folder" in check_run_dir([f"++hydra.run.dir='{afile}/run'"])
    result = run_train(f"hydra.run.dir={afile}/run", timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: hydra.run.dir={afile}/run: {afile} is a file, not a folder; " + (
        "choose another hydra.run.dir"
    )


def test_an_override_of_a_key_the_schema_lacks_is_one_line_naming_its_neighbours():
    """Hydra's answer is several lines suggesting +key, which the schema refuses next."""
    from tpustream.launch.checks import check_override_keys

    assert check_override_keys(["optim.lrr=0.1"]) == "unknown config key optim.lrr (known here: lr)"
    retired = check_override_keys(["accelerator.runtime=native"])
    assert retired.startswith("unknown config key accelerator.runtime: the accelerator option's name decides")
    assert "accelerator=cpu, tpu, cpu_pod, cuda, cpu_eager" in retired
    # Known keys, free-form options, group choices, additions and Hydra's keys pass.
    fine = ["optim.lr=0.2", "model.options.width=8", "data=cifar10", "+optim.x=1", "hydra.job.chdir=false"]
    assert check_override_keys([*fine, "-m", "epochs=3"]) is None


# Raw weights peaking at epoch 1, their average (which best.pt follows) at epoch 2: the rules differ.
EMA_HISTORY = [
    {
        "epoch": number,
        "val_accuracy": raw / 359,
        "val_correct": raw,
        "val_samples": 359,
        "ema_val_accuracy": ema / 359,
        "ema_val_correct": ema,
    }
    for number, (raw, ema) in enumerate([(20, 10), (35, 100), (30, 231)])
]


def test_the_last_line_names_the_epoch_best_pt_holds_with_both_accuracies(tmp_path):
    """Under ema.select_best=ema, the average's best epoch and figures, the raw ones beside."""
    from tpustream.checkpoint import write_metrics
    from tpustream.launch.plan import describe_result, read_final_metrics

    out = str(tmp_path / "run")
    write_metrics(out, EMA_HISTORY)
    assert describe_result(read_final_metrics(out, "ema"), out) == (
        "best validation accuracy 64.35% (231/359) at epoch 2 of the weight average, which best.pt follows "
        f"(ema.select_best=ema); raw weights 8.36% (30/359); checkpoints in {out}"
    )
    assert describe_result(read_final_metrics(out, "raw"), out).startswith(
        "best validation accuracy 9.75% (35/359) at epoch 1 of the raw weights, which best.pt follows"
    )


def test_a_fresh_start_names_the_earlier_runs_best_epoch_as_its_best_pt_holds_it(tmp_path):
    """The earlier run's own ema.select_best (config.yaml) chose its best.pt, not this run's."""
    from tpustream.checkpoint import write_config, write_metrics
    from tpustream.config import DataConfig, TrainConfig
    from tpustream.launch.resume_checks import check_fresh_start

    out = str(tmp_path / "run")
    write_metrics(out, EMA_HISTORY)
    write_config(out, {"ema": {"decay": 0.99, "select_best": "ema"}})
    with pytest.raises(
        ConfigError,
        match=r"holds a run \(3 epoch\(s\), best validation accuracy 64.35% at epoch 2 of the weight "
        r"average, which best.pt follows \(ema.select_best=ema\); raw weights 8.36%\) that resume=null would",
    ):
        check_fresh_start(TrainConfig(output_dir=out, resume=None, data=DataConfig()))  # select_best: raw


def test_a_run_that_never_evaluates_starts_no_validation_workers():
    """eval_every=0: the validation loader is never read; its workers and /dev/shm ring would idle all run."""
    from tests.fake_runtime import tiny_config
    from tpustream.launch.replica import validation_data

    cfg = tiny_config("unused", eval_every=0, **{"data.num_workers": 3})
    assert validation_data(cfg).num_workers == 0 and cfg.data.num_workers == 3
    assert validation_data(tiny_config("unused", eval_every=2, **{"data.num_workers": 3})).num_workers == 3
    evaluating = tiny_config("unused", eval_every=0, eval_only=True, **{"data.num_workers": 3})
    assert validation_data(evaluating).num_workers == 3


def test_a_run_deletes_what_saves_killed_mid_write_left_and_nothing_else(prepared, tmp_path, caplog):
    """A SIGKILL between a save's temporary write and its rename leaves the temporary (up to a
    checkpoint's size): the next start in the folder deletes it, in checkpoint.local_dir's copy too."""
    out, local = tmp_path / "run", tmp_path / "local"
    stale = [out / "checkpoints" / ".last.pt.0123456789ab.tmp", out / ".metrics.jsonl.00112233aabb.tmp"]
    mirror = Path(local_checkpoint_url(str(local), str(out))).parent
    stale.append(mirror / ".last.pt.a1b2c3d4e5f6.tmp")
    kept = [out / "checkpoints" / "notes.tmp", mirror / "last.pt.bak"]
    for path in stale + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    prepared(f"output_dir={out}", f"checkpoint.local_dir={local}")
    assert not any(path.exists() for path in stale) and all(path.exists() for path in kept)
    assert caplog.text.count("which a write killed before it finished left behind") == 3


def test_replica_processes_share_the_hosts_cpus_for_torchs_threads(monkeypatch):
    import torch

    from tpustream.launch import spawn

    before = torch.get_num_threads()
    monkeypatch.setattr(spawn, "usable_cpus", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert spawn.share_host_threads(3) == 2 and torch.get_num_threads() == 2  # 8 vCPUs, 3 replicas
        assert spawn.share_host_threads(16) == 1  # more replicas than vCPUs: one thread each
        torch.set_num_threads(before)
        assert spawn.share_host_threads(1) is None and torch.get_num_threads() == before  # a host's only one
        monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's choice
        assert spawn.share_host_threads(3) is None and torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)
