"""data.read.assemble: the shared ring of batches, its pieces joined, and the receiving thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tpustream.data.read.assemble import (
    SPARE_SLOTS,
    BatchSlots,
    HostBatches,
    SlotBatches,
    SlotWriter,
    in_background,
    join_pieces,
    portable,
    ring_slots,
)
from tpustream.errors import ConfigError


def piece(slot: int, labels: list[int], filled: int = 0, bad: tuple[str, ...] = ()) -> dict:
    return {
        "slot": slot,
        "label": np.array(labels, np.int64),
        "real": np.ones(len(labels), np.float32),
        "filled": filled,
        "bad_shards": list(bad),
    }


def test_a_writer_waits_for_the_slot_until_the_replica_releases_the_batch_that_used_it():
    slots = BatchSlots(2, 4, (1, 2, 2))
    generation = slots.begin_pass()
    slots.region(generation, 0, 0, 4)[...] = 1  # batches 0 and 1 have slots of their own
    slots.region(generation, 1, 0, 4)[...] = 2
    written = threading.Event()

    def write_batch_2() -> None:
        slots.region(generation, 2, 2, 2)[...] = 3  # slot 0 again: waits for batch 0's release
        written.set()

    writer = threading.Thread(target=write_batch_2)
    writer.start()
    time.sleep(0.05)
    assert not written.is_set()
    assert slots.batch(0).flatten().tolist() == [1] * 16
    slots.release(0)
    writer.join(timeout=5)
    assert written.is_set()
    assert slots.batch(2)[:, 0, 0, 0].tolist() == [1, 1, 3, 3]  # only its own samples written


def test_a_writer_of_an_abandoned_pass_stops_waiting():
    slots = BatchSlots(1, 2, (1, 1, 1))
    generation = slots.begin_pass()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (slots.region(generation, 5, 0, 2), done.set()))
    thread.start()
    time.sleep(0.05)
    assert not done.is_set()
    slots.abandon()
    thread.join(timeout=5)
    assert done.is_set()
    assert slots.begin_pass() != generation


def test_a_writer_places_every_step_th_batch_of_its_stage():
    slots = BatchSlots(4, 6, (1, 1, 1))
    slots.images.zero_()  # the ring starts uninitialised: every place is written before it is read
    writer = SlotWriter(slots, slots.begin_pass(), first=1, step=3, start=2, count=2)
    assert [writer.batch_number(i) for i in range(3)] == [1, 4, 7]
    writer.region(0)[...] = 9
    assert slots.batch(1)[:, 0, 0, 0].tolist() == [0, 0, 9, 9, 0, 0]


def test_pieces_join_in_worker_order_and_travel_as_numpy():
    joined = join_pieces([piece(0, [1, 2], filled=1, bad=("a",)), piece(0, [3], filled=2, bad=("a", "b"))])
    assert joined["label"].tolist() == [1, 2, 3] and joined["label"].dtype == torch.int64
    assert int(joined["filled"]) == 3 and joined["bad_shards"] == ["a", "b"]
    assert "slot" not in joined
    sent = portable({"draw": torch.arange(3), "filled": 4})
    assert isinstance(sent["draw"], np.ndarray) and sent["filled"] == 4


def test_slot_batches_copy_each_batch_out_and_release_its_slot():
    slots = BatchSlots(2, 3, (1, 1, 1))
    generation = slots.begin_pass()
    for batch in range(2):
        slots.region(generation, batch, 0, 3)[...] = batch + 5
    items = iter([piece(0, [0]), piece(0, [1, 2]), piece(1, [3]), piece(1, [4, 5])])
    batches = list(SlotBatches(slots, 2)(items))
    assert [b["image"].flatten().tolist() for b in batches] == [[5, 5, 5], [6, 6, 6]]
    assert [b["label"].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5]]
    slots.images.zero_()  # the batches are copies, not views of the ring
    assert batches[0]["image"].sum() == 15
    assert slots.region(generation, 3, 0, 3).shape == (3, 1, 1, 1)  # released: no wait


def test_slot_batches_refuse_pieces_of_another_batch():
    slots = BatchSlots(2, 2, (1, 1, 1))
    slots.begin_pass()
    with pytest.raises(RuntimeError, match="batch 0: expected 2 pieces"):
        list(SlotBatches(slots, 2)(iter([piece(0, [0]), piece(1, [1])])))


def test_in_background_yields_in_order_and_raises_the_producers_error():
    def produce():
        yield from range(5)
        raise ValueError("bad shard")

    received = []
    with pytest.raises(ValueError, match="bad shard"):
        for item in in_background(produce, 2, lambda: None):
            received.append(item)
    assert received == [0, 1, 2, 3, 4]


def test_in_background_closed_early_stops_the_producer_through_on_stop():
    release = threading.Event()
    produced = []

    def produce():
        for item in range(1000):
            if item == 3:
                release.wait(timeout=10)  # blocked until on_stop, as a worker waiting for a slot
            produced.append(item)
            yield item

    batches = in_background(produce, 1, release.set)
    assert next(batches) == 0
    batches.close()
    assert release.is_set()
    assert len(produced) < 10
    assert not any(t.name == "tpustream-batches" and t.is_alive() for t in threading.enumerate())


def test_host_batches_are_reused_only_once_nothing_else_refers_to_them():
    host = HostBatches(3)
    shape = torch.Size([4, 2])
    first = host.take(shape)
    assert host.take(shape) is not first  # the caller still holds it
    first_id = id(first)
    del first
    again = host.take(shape)
    assert id(again) == first_id  # released: reused, no new memory
    view = again[1:]
    del again
    assert id(host.take(shape)) != first_id  # a view of it keeps it
    del view
    kept = {"image": host.take(shape)}
    assert host.take(shape) is not kept["image"]  # held in a batch dict
    assert len(host.buffers) <= 3


def test_a_ring_without_room_in_shared_memory_is_one_line_saying_how_to_make_room(monkeypatch):
    def full(self):
        raise RuntimeError(
            "unable to allocate shared memory(shm) for file </torch_1_2>: No space left on device"
        )

    monkeypatch.setattr(torch.Tensor, "share_memory_", full)
    with pytest.raises(
        ConfigError, match=r"7 shared batches of 256 x \[3, 224, 224\] need 257 MiB.*--shm-size"
    ):
        BatchSlots(7, 256, (3, 224, 224))


def test_the_ring_holds_prefetch_batches_of_pieces_or_two_whole_batches_a_worker():
    assert ring_slots(4, 15, pieces=True) == 4 + SPARE_SLOTS  # every worker writes every batch
    assert ring_slots(4, 15, pieces=False) == 30 + SPARE_SLOTS  # each worker makes whole batches
