"""How a TPU VM pod was asked for (type, runtime, spot or not, network, account), and where that is kept.

A spot or preemptible pod does not come back after a preemption: --recreate asks
for the same one again, so it must know how the pod was made. ``tpustream-pod
create`` records that in ``~/.tpustream/pods/`` on this machine; a launch reads
it from the pod itself (``describe``) while it still exists, and records it too,
so a pod made by other means can be recreated after it is gone.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from tpustream.errors import ConfigError, TpustreamError
from tpustream.pod.multislice import node_names
from tpustream.pod.types import slice_type

# How the capacity is paid for. Queued resources take --spot and --reserved; on-demand is
# neither. Preemptible TPU VMs predate spot ones and exist only through tpu-vm create --preemptible.
PROVISIONING = ("on-demand", "spot", "preemptible", "reserved")
RECORDS_DIR = ".tpustream/pods"


@dataclass(frozen=True)
class SliceSpec:
    """A pod as gcloud creates it: one queued resource named ``name`` and its TPU VM node(s).

    One slice: the node is ``name`` too. Several (multislice): the nodes are
    NAME-0 .. NAME-(slices-1), each a slice of ``accelerator_type``.
    """

    name: str
    zone: str
    accelerator_type: str
    runtime_version: str
    provisioning: str = "on-demand"
    slices: int = 1
    project: str | None = None
    network: str | None = None
    subnetwork: str | None = None
    service_account: str | None = None
    gcloud: str = "gcloud"

    def __post_init__(self) -> None:
        if not self.name or not self.zone:
            raise ConfigError("a TPU pod needs a name and a --zone")
        if self.provisioning not in PROVISIONING:
            known = ", ".join(PROVISIONING)
            raise ConfigError(f"provisioning {self.provisioning!r}: expected one of {known}")
        if self.slices < 1:
            raise ConfigError(f"--num-slices must be at least 1, got {self.slices}")
        if self.slices > 1 and not self.queued:
            raise ConfigError(
                "--num-slices with --preemptible: the slices are asked for as one queued resource, and "
                "preemptible TPU VMs have none; use --spot"
            )

    @property
    def queued(self) -> bool:
        """Whether it is asked for as a queued resource (everything but preemptible)."""
        return self.provisioning != "preemptible"

    @property
    def nodes(self) -> tuple[str, ...]:
        return node_names(self.name, self.slices)

    @property
    def kind(self) -> str:
        """What is asked for, in words: ``v5litepod-16``, or ``2 slices of v5litepod-16``."""
        if self.slices == 1:
            return self.accelerator_type
        return f"{self.slices} slices of {self.accelerator_type}"


def default_runtime(accelerator_type: str) -> str:
    """The runtime version for PyTorch on this type (tpustream.pod.types cites the table)."""
    return slice_type(accelerator_type).runtime_version


def _last_part(path: object) -> str | None:
    """``projects/p/global/networks/default`` -> ``default``: gcloud takes the short name."""
    return str(path).rstrip("/").rsplit("/", 1)[-1] if path else None


def spec_from_describe(node: dict, name: str, zone: str, project: str | None, slices: int = 1) -> SliceSpec:
    """How a pod of ``slices`` alike nodes was made, from one node's ``tpu-vm describe --format=json``."""
    scheduling = node.get("schedulingConfig") or {}
    if scheduling.get("spot"):
        provisioning = "spot"
    elif scheduling.get("preemptible"):
        provisioning = "preemptible"
    elif scheduling.get("reserved"):
        provisioning = "reserved"
    else:
        provisioning = "on-demand"
    network = node.get("networkConfig") or {}
    account = (node.get("serviceAccount") or {}).get("email")
    accelerator = node.get("acceleratorType")
    runtime = node.get("runtimeVersion")
    if not accelerator or not runtime:
        raise TpustreamError(f"gcloud describe {name}: no acceleratorType or runtimeVersion to recreate from")
    return SliceSpec(
        name=name,
        zone=zone,
        project=project,
        accelerator_type=str(accelerator),
        runtime_version=str(runtime),
        provisioning=provisioning,
        slices=slices,
        network=_last_part(network.get("network")),
        subnetwork=_last_part(network.get("subnetwork")),
        service_account=account or None,
    )


def record_path(name: str, zone: str, project: str | None) -> Path:
    return Path.home() / RECORDS_DIR / (project or "default-project") / zone / f"{name}.json"


def save_record(spec: SliceSpec) -> Path:
    """Write the spec atomically (a Ctrl-C mid-write must not leave half a record)."""
    path = record_path(spec.name, spec.zone, spec.project)
    path.parent.mkdir(parents=True, exist_ok=True)
    values = {k: v for k, v in asdict(spec).items() if k != "gcloud"}
    partial = path.with_suffix(".json.tmp")
    partial.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    os.replace(partial, path)
    return path


def load_record(name: str, zone: str, project: str | None, gcloud: str = "gcloud") -> SliceSpec | None:
    """The recorded spec of a pod, or None if this machine never saw it."""
    path = record_path(name, zone, project)
    try:
        values = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise TpustreamError(f"{path}: not a pod record ({exc}); delete it") from None
    known = {f.name for f in fields(SliceSpec)}
    return replace(SliceSpec(**{k: v for k, v in values.items() if k in known}), gcloud=gcloud)
