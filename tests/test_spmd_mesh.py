"""A ViT on named 2-D meshes and the GPipe recipe's twin: train.py on 4 virtual XLA CPU devices.

Apart from tests/test_spmd.py, whose runs share module fixtures (and so one
test worker): these share none, so the scheduler may put them beside those.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import assert_same_run, run_train
from tests.test_spmd import STOPPED, WEIGHT_TOLERANCE, assert_close_weights, last, step_losses
from tpustream.checkpoint import read_metrics

pytestmark = pytest.mark.slow


# A tiny timm ViT (2 heads, hidden 32) on one shard of the digits: 8 steps of a global batch
# of 32 on 4 devices. The 2-D runs recompute their blocks (model.remat) too.
VIT_STEPS = 8
VIT_STOP = 3
VIT = (
    "model=timm",
    "model.name=vit_tiny_patch16_224",
    "+model.options.img_size=32",
    "+model.options.patch_size=4",
    "+model.options.embed_dim=32",
    "+model.options.depth=2",
    "+model.options.num_heads=2",
    "accelerator.num_devices=4",
    "batch_size=8",
)
TWO_D = ("strategy=spmd", "mesh.fsdp=2", "mesh.tensor=2", "model.remat=true")


def vit_train(root: str, run: str, *overrides: str, code: int = 0) -> str:
    result = run_train(
        f"data.root={root}",
        f"data.train_shards='{root}/train/train-000000.tar'",
        f"output_dir={run}",
        f"hydra.run.dir={run}-hydra",
        "data.num_workers=0",
        "log_steps=1",
        "epochs=1",
        "accelerator.in_process=true",
        *VIT,
        *overrides,
    )
    assert result.returncode == code, result.stderr[-3000:]
    return result.stderr


def test_a_vit_on_a_2d_mesh_follows_fsdp_and_resumes_bitwise(digits_root, tmp_path):
    """(fsdp=2, tensor=2) with remat against fsdp=4: the same steps to float rounding; stopped and
    resumed bit for bit; checkpoints under the plain model's keys and shapes, as fsdp=4's."""
    stop = (f"debug.stop_at_step={VIT_STOP}",)
    fsdp_log = vit_train(digits_root, str(tmp_path / "fsdp"), "strategy=spmd_fsdp", *stop, code=STOPPED)
    straight_log = vit_train(digits_root, str(tmp_path / "2d"), *TWO_D)
    assert "mesh of data=1 x fsdp=2 x tensor=2" in straight_log
    assert "mesh.tensor=2 splits 12 parameter(s)" in straight_log
    assert "model.remat: 2 blocks of vit_tiny_patch16_224" in straight_log
    fsdp, straight = step_losses(fsdp_log), step_losses(straight_log)
    for step in range(VIT_STOP):
        assert straight[0, step] == pytest.approx(fsdp[0, step], abs=2e-5), step

    stopped = str(tmp_path / "2d-stopped")
    vit_train(digits_root, stopped, *TWO_D, *stop, code=STOPPED)
    import timm

    plain = timm.create_model(
        VIT[1].split("=")[1], img_size=32, patch_size=4, embed_dim=32, depth=2, num_heads=2
    )
    assert last(stopped)["model"].keys() == plain.state_dict().keys()  # no wrapper or remat names
    assert_close_weights(last(stopped)["model"], last(str(tmp_path / "fsdp"))["model"], WEIGHT_TOLERANCE)
    vit_train(digits_root, stopped, *TWO_D)
    assert_same_run(stopped, str(tmp_path / "2d"), steps=VIT_STEPS)

    # fsdp=4's checkpoint has the 2-D run's layout, whole tensors under the plain keys, so either
    # continues the other (loaded before the mesh wraps the model, as ddp's on the mesh in
    # tests/test_spmd.py's test_checkpoints_cross_between_ddp_and_spmd).
    fsdp_state, two_d_state = last(str(tmp_path / "fsdp"))["model"], last(stopped)["model"]
    assert {k: v.shape for k, v in fsdp_state.items()} == {k: v.shape for k, v in two_d_state.items()}


# conf/experiment/gpipe_vit_h480.yaml's scaled-down twin, as its header writes it.
GPIPE_TWIN = (
    "+experiment=gpipe_vit_h480",
    "data=digits",
    "data.image_size=32",
    "model.options.img_size=32",
    "model.options.patch_size=4",
    "+model.options.embed_dim=32",
    "+model.options.depth=2",
    "+model.options.num_heads=2",
)


def test_the_gpipe_recipes_twin_trains_on_the_4_device_mesh(digits_root, tmp_path):
    """The recipe itself (spmd, fsdp over every device, remat, bf16, AdamW, drop path) at toy size."""
    run = str(tmp_path / "run")
    result = run_train(
        *GPIPE_TWIN,
        f"data.root={digits_root}",
        f"data.train_shards='{digits_root}/train/train-000000.tar'",
        "accelerator.num_devices=4",
        "accelerator.in_process=true",
        "data.num_workers=0",
        "epochs=1",
        f"output_dir={run}",
        f"hydra.run.dir={tmp_path}/hydra",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mesh of data=1 x fsdp=4 x tensor=1" in result.stderr
    assert "model.remat: 2 blocks of vit_huge_patch14_224" in result.stderr
    (record,) = read_metrics(run)
    assert record["train_samples"] == 256 and record["val_samples"] == 359
    assert np.isfinite(record["train_loss"])
    saved = last(run)
    assert saved["config"]["model"]["remat"] and saved["config"]["precision"] == "bf16"
