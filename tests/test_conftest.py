"""The suite's own set-up (tests/conftest.py): tests sharing a module fixture run on one xdist worker."""

from __future__ import annotations

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
