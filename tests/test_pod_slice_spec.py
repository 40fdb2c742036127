"""tpustream.pod.slice_spec: how a pod was made, read from describe and kept in a record."""

from __future__ import annotations

import pytest

from tpustream.errors import ConfigError, TpustreamError
from tpustream.pod.slice_spec import SliceSpec, load_record, record_path, save_record, spec_from_describe

# As `gcloud compute tpus tpu-vm describe --format=json` shows a spot v6e (fields it uses).
DESCRIBED = {
    "name": "projects/p/locations/us-east5-b/nodes/pod1",
    "acceleratorType": "v6e-16",
    "runtimeVersion": "v2-alpha-tpuv6e",
    "state": "PREEMPTED",
    "schedulingConfig": {"spot": True, "preemptible": True},
    "networkConfig": {
        "network": "projects/p/global/networks/tpu-net",
        "subnetwork": "projects/p/regions/us-east5/subnetworks/tpu-sub",
        "enableExternalIps": True,
    },
    "serviceAccount": {"email": "trainer@p.iam.gserviceaccount.com", "scope": ["https://x"]},
}


def test_spec_from_describe_keeps_what_recreating_needs():
    spec = spec_from_describe(DESCRIBED, "pod1", "us-east5-b", "p")
    assert spec == SliceSpec(
        name="pod1",
        zone="us-east5-b",
        project="p",
        accelerator_type="v6e-16",
        runtime_version="v2-alpha-tpuv6e",
        provisioning="spot",  # spot wins: a spot VM is also marked preemptible
        network="tpu-net",
        subnetwork="tpu-sub",
        service_account="trainer@p.iam.gserviceaccount.com",
    )
    plain = spec_from_describe({"acceleratorType": "v4-8", "runtimeVersion": "r"}, "pod2", "z", None)
    assert (plain.provisioning, plain.network, plain.service_account) == ("on-demand", None, None)
    with pytest.raises(TpustreamError, match="no acceleratorType or runtimeVersion"):
        spec_from_describe({"state": "READY"}, "pod3", "z", None)


def test_the_record_round_trips_and_a_bad_one_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    spec = spec_from_describe(DESCRIBED, "pod1", "us-east5-b", "p")
    assert load_record("pod1", "us-east5-b", "p") is None
    path = save_record(spec)
    assert path == record_path("pod1", "us-east5-b", "p") and path.is_relative_to(
        tmp_path / ".tpustream/pods"
    )
    assert load_record("pod1", "us-east5-b", "p", gcloud="/opt/gcloud") == SliceSpec(
        **{**spec.__dict__, "gcloud": "/opt/gcloud"}
    )
    path.write_text("{not json")
    with pytest.raises(TpustreamError, match="not a pod record"):
        load_record("pod1", "us-east5-b", "p")
    with pytest.raises(ConfigError, match="provisioning 'cheap'"):
        SliceSpec(name="a", zone="z", accelerator_type="v4-8", runtime_version="r", provisioning="cheap")
