"""observe.flops, chips and timing: FLOPs against published figures, MFU, where a loop's time goes."""

from __future__ import annotations

import pytest

from tests.fake_runtime import tiny_config
from tpustream.checkpoint import read_metrics
from tpustream.observe.chips import CHIPS, Chip, chip_from_accelerator_type, mfu
from tpustream.observe.flops import forward_flops_per_sample, training_flops_per_sample
from tpustream.observe.timing import BatchWaits, Breakdown, LoopTimer, reduce_breakdowns


def test_resnet50_at_224_is_the_published_4_1_g_multiply_adds():
    """8.18 GFLOPs forward (a multiply-add is two), counted on the meta device; training is 3x that."""
    import torchvision

    build = torchvision.models.resnet50
    forward = forward_flops_per_sample(build, (3, 224, 224))
    assert forward == pytest.approx(8.18e9, rel=0.002)
    assert training_flops_per_sample(build, (3, 224, 224)) == 3 * forward


def test_flops_follow_the_image_size_and_count_attention():
    """A ViT's count includes its attention matmuls: 4 times the tokens, more than 4 times the FLOPs."""
    import timm

    def vit(size):
        return lambda: timm.create_model("vit_tiny_patch16_224", img_size=size, num_classes=10)

    small, large = (forward_flops_per_sample(vit(size), (3, size, size)) for size in (112, 224))
    assert large > 4 * small


def test_mfu_is_model_flops_per_second_over_the_chips_peak():
    chip = Chip("test", peak_flops=100e12, devices_per_chip=2, source="test")
    # 8 devices = 4 chips = 400 TFLOP/s peak; 1e9 FLOPs x 100,000 samples/s = 100 TFLOP/s.
    assert mfu(1e9, 100_000, devices=8, chip=chip) == pytest.approx(0.25)
    assert chip_from_accelerator_type("v4") is CHIPS["v4"]
    assert chip_from_accelerator_type("v5litepod-16") is CHIPS["v5e"]
    assert chip_from_accelerator_type("v3-32").devices_per_chip == 2
    assert chip_from_accelerator_type("v9") is None and chip_from_accelerator_type(None) is None
    # GPUs by CUDA's device names: whole words, the PCIe card apart from the SXM one.
    assert chip_from_accelerator_type("NVIDIA H200").peak_flops == 989e12
    assert chip_from_accelerator_type("NVIDIA H100 80GB HBM3").name == "H100 SXM"
    assert chip_from_accelerator_type("NVIDIA H100 PCIe").name == "H100 PCIe"
    assert chip_from_accelerator_type("NVIDIA A100-SXM4-80GB").name == "A100"
    assert (
        chip_from_accelerator_type("NVIDIA L40S") is None
        and chip_from_accelerator_type("NVIDIA H100 NVL") is None
    )


def test_a_run_records_its_flops_and_on_a_tpu_its_mfu(fake_job, tmp_path):
    off_tpu, on_tpu = str(tmp_path / "cpu"), str(tmp_path / "tpu")
    fake_job(tiny_config(off_tpu, epochs=1), model_flops=3_000_000)
    record = read_metrics(off_tpu)[0]
    assert record["model_flops_per_sample"] == 3_000_000 and "mfu" not in record  # no chip: no MFU invented
    fake_job(tiny_config(on_tpu, epochs=1), world_size=2, model_flops=3_000_000, accelerator_type="v3")
    record = read_metrics(on_tpu)[0]
    # Two replicas are two v3 TensorCores: one chip.
    assert record["mfu"] == pytest.approx(3e6 * record["global_rate"] / 123e12)


def test_a_starved_loop_reports_its_input_wait_and_a_fed_one_does_not(fake_job, tmp_path):
    """The share of the training loop spent waiting for batches, per replica and the worst one."""
    fed, starved = str(tmp_path / "fed"), str(tmp_path / "starved")
    fake_job(tiny_config(fed, epochs=1), world_size=2)
    # 50 ms per batch against steps of a few ms: the loop mostly waits.
    fake_job(tiny_config(starved, epochs=1), world_size=2, input_delay=0.05)
    fed_record, starved_record = read_metrics(fed)[0], read_metrics(starved)[0]
    assert starved_record["input_wait_fraction"] > 0.5
    assert starved_record["input_wait_seconds"] >= 12 * 0.05  # 12 batches per replica
    assert fed_record["input_wait_fraction"] < starved_record["input_wait_fraction"] / 2
    for record in (fed_record, starved_record):
        assert record["input_wait_fraction"] <= record["input_wait_fraction_worst"] <= 1
        assert record["step_seconds"] >= 0 and record["compile_seconds"] == 0  # eager: no compiles


def records(waits, compilations=(3, 3, 3), saving=0.0, writing=0.0, saving_key="checkpoint_stall_seconds"):
    return [
        {
            "epoch": epoch,
            "input_wait_fraction": wait,
            "input_wait_fraction_worst": min(1.0, wait + 0.05),
            "compilations": compiled,
            saving_key: saving,
            "checkpoint_write_seconds": writing,
            "epoch_seconds": 10.0,
        }
        for epoch, (wait, compiled) in enumerate(zip(waits, compilations, strict=True))
    ]


def test_advice_names_what_to_change_only_when_it_applies():
    from tpustream.observe.advice import advise, suggested_workers

    assert advise(records([0.6, 0.05, 0.04]), num_workers=2, cpus=8) == []  # epoch 0's wait is start-up
    (finding,) = advise(records([0.6, 0.5, 0.5]), num_workers=2, cpus=8)
    # Waiting half the time: the input gives half what the device takes; twice the workers, and a margin.
    assert finding.startswith("input-bound: the training thread waited for batches 50% of the time")
    assert "raise data.num_workers from 2 to about 5 (this host has 8 vCPUs)" in finding
    assert suggested_workers(0, 0.9) >= 10 and suggested_workers(4, 0.1) == 6
    assert "shard" not in finding
    # More workers than a replica has shards would split shards by sample ranges: write shards first.
    (finding,) = advise(records([0.6, 0.5, 0.5]), num_workers=2, cpus=8, shards_per_replica=3)
    assert finding.endswith(
        "a replica has 3 shard(s) for 5 workers: write at least 5 shards per replica first"
    )
    (finding,) = advise(records([0.6, 0.5, 0.5]), num_workers=2, cpus=8, shards_per_replica=8)
    assert "shard" not in finding
    # A replica reads only so many canonical streams: never advise more workers than that.
    (finding,) = advise(records([0.6, 0.5, 0.5]), num_workers=2, cpus=8, max_workers=4)
    assert "from 2 to 4 (this host has 8 vCPUs); at most 4, the canonical streams each" in finding
    (finding,) = advise(records([0.6, 0.5, 0.5]), num_workers=4, cpus=8, max_workers=4)
    assert "data.num_workers=4 is the most the run's canonical streams allow a replica: start" in finding
    (finding,) = advise(records([0.1, 0.0, 0.0], compilations=(3, 3, 5)))
    assert finding.startswith("compile-bound: 2 graph(s) compiled after epoch 0 (by epoch 2)")
    (finding,) = advise(records([0.1, 0.0, 0.0], saving=2.0))
    assert finding.startswith("host-bound: training waited for checkpoints up to 20% of an epoch")
    # Older records name the stall checkpoint_seconds.
    (finding,) = advise(records([0.1, 0.0, 0.0], saving=2.0, saving_key="checkpoint_seconds"))
    assert finding.startswith("host-bound: training waited for checkpoints up to 20% of an epoch")
    # Writing in the background while training goes on is not host-bound: only the stall counts.
    assert advise(records([0.1, 0.0, 0.0], saving=0.05, writing=8.0)) == []


def test_a_wait_is_for_the_making_until_the_batch_was_made_and_for_its_delivery_after():
    waits = BatchWaits()
    assert waits.making_share() is None  # nothing waited: nothing to split
    waits.add(asked=10.0, got=10.5, made=10.2)  # 0.2 s of making, then 0.3 s of delivery
    waits.add(asked=11.0, got=11.1, made=9.0)  # made before it was asked for: all delivery
    waits.add(asked=12.0, got=12.4, made=12.4)  # made as it arrived (no workers): all making
    waits.add(asked=13.0, got=13.2, made=None)  # a batch without a stamp: left out
    assert waits.seconds == pytest.approx(1.0) and waits.making_seconds == pytest.approx(0.6)
    assert waits.making_share() == pytest.approx(0.6)
    waits.add(asked=14.0, got=14.1, made=15.0)  # a stamp past the arrival counts the wait, no more
    assert waits.making_share() == pytest.approx(0.7 / 1.1)


def test_an_epoch_takes_its_sources_split_and_replicas_report_it_only_when_all_have_one():
    class Source:
        waits = BatchWaits(seconds=2.0, making_seconds=0.5)

    assert LoopTimer(lambda: 0.0, Source()).breakdown(0.0, 0.0).input_waits is Source.waits
    assert LoopTimer(lambda: 0.0, object()).breakdown(0.0, 0.0).input_waits is None

    def replica(waits: BatchWaits | None) -> Breakdown:
        return Breakdown(10.0, 3.0, 0.0, 0.0, input_waits=waits)

    # Weighted by the waits: 0.2 s of making in 1 s, and 3 s of 3 s.
    both = [replica(BatchWaits(1.0, 0.2)), replica(BatchWaits(3.0, 3.0))]
    assert reduce_breakdowns(both)["input_making_share"] == pytest.approx(0.8)
    assert reduce_breakdowns([replica(BatchWaits(1.0, 0.2)), replica(BatchWaits())])[
        "input_making_share"
    ] == pytest.approx(0.2)  # a replica that never waited adds nothing
    assert "input_making_share" not in reduce_breakdowns([replica(BatchWaits()), replica(BatchWaits())])
    assert "input_making_share" not in reduce_breakdowns([replica(BatchWaits(1.0, 0.2)), replica(None)])


def test_a_run_whose_workers_were_ahead_is_not_told_to_add_workers():
    from tpustream.observe.advice import advise

    late = [{**record, "input_making_share": 0.1} for record in records([0.6, 0.5, 0.5])]
    (finding,) = advise(late, num_workers=2, cpus=8)
    assert finding.startswith("input-bound: the training thread waited for batches 50% of the time")
    assert "the workers were not what it waited for: 90% of the loader's waits came after" in finding
    assert "num_workers" not in finding and "debug.profile_steps" in finding and "decode" not in finding
    (finding,) = advise(late, num_workers=2, cpus=8, gpu_decodes=True)
    assert "with data.decode=device that process decodes every JPEG: data.decode=host leaves" in finding
    slow = [{**record, "input_making_share": 0.9} for record in records([0.6, 0.5, 0.5])]
    (finding,) = advise(slow, num_workers=2, cpus=8)
    assert "raise data.num_workers from 2 to about 5" in finding


def test_a_starved_run_is_told_to_raise_num_workers(fake_job, tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="tpustream"):
        fake_job(tiny_config(str(tmp_path / "run"), epochs=2), input_delay=0.05)
    assert "advice: input-bound" in caplog.text and "raise data.num_workers from" in caplog.text


def test_a_model_the_counter_cannot_run_gets_no_flops_and_the_run_goes_on(caplog):
    def broken():
        raise RuntimeError("no meta kernel for this op")

    assert training_flops_per_sample(broken, (3, 8, 8)) is None
    assert "model FLOPs not counted (RuntimeError: no meta kernel for this op)" in caplog.text


def test_the_saving_stalls_parts_are_the_slowest_replicas_and_the_loop_names_its_process():
    from tpustream.observe.timing import process_token

    def replica(copy: float, writer_wait: float) -> Breakdown:
        return Breakdown(
            10.0, 0.0, 0.0, 1.0, 0.5, checkpoint_copy_seconds=copy, checkpoint_writer_wait_seconds=writer_wait
        )

    # The master copies and waits for its writer; every replica waits for it at the save's barrier.
    fields = reduce_breakdowns([replica(0.8, 0.1), replica(0.01, 0.0)])
    assert (fields["checkpoint_copy_seconds"], fields["checkpoint_writer_wait_seconds"]) == (0.8, 0.1)
    assert fields["train_process"] == process_token()
    # What training.saving's take_seconds gives, in the order breakdown takes it.
    breakdown = LoopTimer(lambda: 0.0).breakdown(*(1.0, 0.5, 0.7, 0.2))
    assert (breakdown.checkpoint_copy_seconds, breakdown.checkpoint_writer_wait_seconds) == (0.7, 0.2)
