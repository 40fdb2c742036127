"""runtime.staging: a checkpoint's host copy goes into the previous copy's buffers."""

from __future__ import annotations

import torch

from tpustream.runtime.staging import HostStaging


def test_each_copy_reuses_the_previous_ones_buffers_and_holds_the_values_of_its_moment():
    staging = HostStaging()
    weights = torch.randn(4, 3, 5, 5).contiguous(memory_format=torch.channels_last)
    state = {"model": {"w": weights, "step": torch.tensor(3)}, "history": [{"loss": 0.5}], "epoch": 2}
    first = staging.copy(state)
    assert first["model"]["w"] is not weights and torch.equal(first["model"]["w"], weights)
    assert first["model"]["w"].is_contiguous(memory_format=torch.channels_last)  # the bytes .cpu() gives
    assert first["history"] == [{"loss": 0.5}] and first["history"] is not state["history"]
    address = first["model"]["w"].data_ptr()
    weights += 1  # training goes on: the copy keeps the values it was taken with
    assert not torch.equal(first["model"]["w"], weights)
    second = staging.copy(state)
    assert second["model"]["w"].data_ptr() == address and torch.equal(second["model"]["w"], weights)
    assert staging.nbytes == weights.numel() * 4 + 8


def test_a_place_whose_tensor_changed_gets_a_new_buffer_and_a_place_gone_frees_its():
    staging = HostStaging()
    staging.copy({"a": torch.zeros(3), "b": torch.zeros(10)})
    copied = staging.copy({"a": torch.ones(4, dtype=torch.float64)})
    assert torch.equal(copied["a"], torch.ones(4, dtype=torch.float64))
    assert staging.nbytes == 4 * 8  # "b" is gone, "a" was replaced
    staging.release()
    assert staging.nbytes == 0


def test_an_xla_runtimes_host_copy_clones_cpu_tensors_only_for_a_copy_that_outlives_the_step():
    """An XLA run's optimizer keeps step counts on the CPU: a background save must not alias them."""
    from tpustream.runtime.device import to_host

    step = torch.tensor(7.0)
    assert to_host({"step": step})["step"].data_ptr() == step.data_ptr()  # synchronous: no second copy
    copied = to_host({"step": step}, clone_cpu=True)["step"]
    step += 1
    assert copied.item() == 7.0


def test_tensor_bytes_counts_every_tensor_of_a_nested_state():
    from tpustream.runtime.device import tensor_bytes

    state = {
        "model": {"w": torch.zeros(4, 8), "b": torch.zeros(8, dtype=torch.bfloat16)},
        "steps": [torch.ones(3)],
    }
    assert tensor_bytes({**state, "epoch": 3, "name": "x"}) == 4 * 8 * 4 + 8 * 2 + 3 * 4
