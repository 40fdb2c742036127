"""The suite's own set-up (tests/conftest.py): xdist groups, and the workers' shares of the cores."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def module_value() -> object:
    return object()


def test_tests_sharing_a_module_fixture_are_one_xdist_group(request, module_value):
    """Else each worker makes a module's reference training runs again (measured: pytest 9.2)."""
    group = request.node.get_closest_marker("xdist_group")
    assert group is not None and group.args == ("tests.test_conftest",)
    if getattr(request.config.option, "loadgroup", False):  # an xdist worker of --dist loadgroup
        # The mark reached the node id that xdist's scheduler groups by.
        assert request.node.nodeid.endswith("@tests.test_conftest"), request.node.nodeid


def test_each_xdist_worker_takes_its_share_of_the_cores_for_openmp(monkeypatch):
    import torch

    from tests import conftest
    from tpustream.observe import advice

    before = torch.get_num_threads()
    monkeypatch.setattr(advice, "usable_cpus", lambda: 8)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        conftest.share_cores_among_workers()
        assert os.environ["OMP_NUM_THREADS"] == "4" and torch.get_num_threads() == 4  # what processes inherit
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the caller's: kept
        conftest.share_cores_among_workers()
        assert os.environ["OMP_NUM_THREADS"] == "3"
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "1")
        monkeypatch.delenv("OMP_NUM_THREADS")
        conftest.share_cores_among_workers()  # one process has the machine to itself
        assert "OMP_NUM_THREADS" not in os.environ
    finally:
        torch.set_num_threads(before)
