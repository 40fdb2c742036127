"""A pod's life through gcloud: ask for it as a queued resource, wait until it is ACTIVE, delete what is left.

Cloud TPU queued resources (https://cloud.google.com/tpu/docs/queued-resources)
wait for capacity and create the slice when it is there: ACCEPTED,
WAITING_FOR_RESOURCES, PROVISIONING, then ACTIVE (the node exists), or FAILED.
A spot slice made this way that is preempted leaves its queued resource
SUSPENDING/SUSPENDED and its node PREEMPTED or gone; ``delete --force`` removes
both. Preemptible TPU VMs have no queued form: they are made by ``tpu-vm create
--preemptible``, which returns once the VM exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tpustream.errors import TpustreamError
from tpustream.pod.processes import Console, run_streamed
from tpustream.pod.slice_spec import SliceSpec

ACTIVE = "ACTIVE"
# States a queued resource does not leave for ACTIVE: it must be deleted and asked for again.
GIVEN_UP = {"FAILED", "SUSPENDING", "SUSPENDED"}
DESCRIBE_TIMEOUT_SECONDS = 120
DELETE_TIMEOUT_SECONDS = 1800  # deleting a large slice takes minutes

# Runs as root at every boot of every host: the base image lacks python3-venv, which --sync
# needs. The marker (holding the script's exit status) is what --sync waits for on a new VM
# (tpustream.pod.commands.STARTUP_MARKER).
HOST_SETUP_SCRIPT = """\
#!/bin/bash
# tpustream host set-up (tpustream-pod create): runs as root at every boot of every host.
set -euo pipefail
marker_dir=/var/lib/tpustream
mkdir -p "$marker_dir"
rm -f "$marker_dir/startup-done"
# The marker (holding this script's exit status) tells `tpustream-pod --sync` to stop waiting.
trap 'echo $? > "$marker_dir/startup-done"' EXIT
# python3 -m venv needs python3-venv (ensurepip), which the base image lacks.
if ! dpkg -s python3-venv python3-pip >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  # Right after boot unattended-upgrades may hold the dpkg lock: wait for it instead of failing.
  apt-get -o DPkg::Lock::Timeout=600 update -q
  apt-get -o DPkg::Lock::Timeout=600 install -y -q python3-venv python3-pip
fi
"""


def _gcloud(spec: SliceSpec, group: str, verb: str, *args: str) -> list[str]:
    project = [f"--project={spec.project}"] if spec.project else []
    return [spec.gcloud, "compute", "tpus", group, verb, *args, f"--zone={spec.zone}", *project]


def _placement(spec: SliceSpec) -> list[str]:
    optional = [("network", spec.network), ("subnetwork", spec.subnetwork)]
    optional.append(("service-account", spec.service_account))
    return [f"--{flag}={value}" for flag, value in optional if value]


def create_command(spec: SliceSpec, startup_script: str) -> list[str]:
    """Queued resource NAME for node NAME, or nodes NAME-0 .. with several slices; preemptible:
    ``tpu-vm create --preemptible`` (no queued form)."""
    metadata = f"--metadata-from-file=startup-script={startup_script}"
    if not spec.queued:
        return _gcloud(
            spec,
            "tpu-vm",
            "create",
            spec.name,
            f"--accelerator-type={spec.accelerator_type}",
            f"--version={spec.runtime_version}",
            metadata,
            "--preemptible",
            *_placement(spec),
        )
    capacity = {"spot": ["--spot"], "reserved": ["--reserved"]}.get(spec.provisioning, [])
    return _gcloud(
        spec,
        "queued-resources",
        "create",
        spec.name,
        *([f"--node-count={spec.slices}", f"--node-prefix={spec.name}"] if spec.slices > 1 else []),
        *([f"--node-id={spec.name}"] if spec.slices == 1 else []),
        f"--accelerator-type={spec.accelerator_type}",
        f"--runtime-version={spec.runtime_version}",
        metadata,
        *capacity,
        *_placement(spec),
    )


def queued_describe_command(spec: SliceSpec) -> list[str]:
    return _gcloud(spec, "queued-resources", "describe", spec.name, "--format=json")


def node_describe_command(spec: SliceSpec, node: str) -> list[str]:
    return _gcloud(spec, "tpu-vm", "describe", node, "--format=json")


def queued_delete_command(spec: SliceSpec) -> list[str]:
    """--force: the node the queued resource made goes too; --quiet: no prompt to answer."""
    return _gcloud(spec, "queued-resources", "delete", spec.name, "--force", "--quiet")


def node_delete_command(spec: SliceSpec, node: str) -> list[str]:
    return _gcloud(spec, "tpu-vm", "delete", node, "--quiet")


def delete_commands(spec: SliceSpec) -> list[list[str]]:
    """What deletes the pod however it was made; the one that does not apply fails with NOT_FOUND."""
    nodes = [node_delete_command(spec, node) for node in spec.nodes]
    return [queued_delete_command(spec), *nodes] if spec.queued else nodes


@contextlib.contextmanager
def startup_script_file() -> Iterator[str]:
    """HOST_SETUP_SCRIPT in a temporary file for --metadata-from-file, removed afterwards."""
    with tempfile.NamedTemporaryFile("w", prefix="tpustream-startup-", suffix=".sh", delete=False) as f:
        f.write(HOST_SETUP_SCRIPT)
    try:
        yield f.name
    finally:
        os.unlink(f.name)


def describe_json(argv: list[str], what: str) -> dict | None:
    """gcloud's JSON for ``what``, or None if it does not exist (NOT_FOUND)."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=DESCRIBE_TIMEOUT_SECONDS
        )
    except subprocess.TimeoutExpired:
        raise TpustreamError(f"gcloud describe {what}: no answer in {DESCRIBE_TIMEOUT_SECONDS}s") from None
    except OSError as exc:
        raise TpustreamError(f"cannot run {argv[0]}: {exc}") from None
    if done.returncode != 0:
        if "NOT_FOUND" in done.stderr:
            return None
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        raise TpustreamError(f"gcloud describe {what} failed: {lines[-1] if lines else done.returncode}")
    try:
        found = json.loads(done.stdout)
    except ValueError:
        found = None
    if not isinstance(found, dict):
        raise TpustreamError(f"gcloud describe {what}: unexpected output {done.stdout[:200]!r}")
    return found


@dataclass(frozen=True)
class QueuedState:
    state: str  # ACCEPTED, WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, FAILED, SUSPENDED, ...
    detail: str = ""  # why it failed, when the API says

    @classmethod
    def parse(cls, found: dict) -> QueuedState:
        state = found.get("state") or {}
        if isinstance(state, str):  # older API versions: a bare string
            return cls(state)
        error = ((state.get("failedData") or {}).get("error") or {}).get("message", "")
        return cls(str(state.get("state", "UNKNOWN")), str(error))


def describe_queued(spec: SliceSpec) -> QueuedState | None:
    found = describe_json(queued_describe_command(spec), f"queued resource {spec.name}")
    return None if found is None else QueuedState.parse(found)


class ProvisioningFailed(TpustreamError):
    """The queued resource will not become ACTIVE (FAILED, SUSPENDED, or waited for too long)."""


class RequestRefused(ProvisioningFailed):
    """gcloud did not accept the request (quota, a name in use, a bad flag): nothing was made."""


def request(spec: SliceSpec, console: Console) -> None:
    """Ask for the pod; a queued resource returns once the request is accepted, not filled."""
    with startup_script_file() as startup:
        argv = create_command(spec, startup)
        code = run_streamed(argv, console, "[gcloud] ")
    if code != 0:
        kind = "queued resource" if spec.queued else "TPU VM"
        raise RequestRefused(f"gcloud could not create {kind} {spec.name} (exit code {code}; see above)")


def wait_until_active(
    spec: SliceSpec,
    console: Console,
    timeout: float,
    poll_interval: float,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Poll the queued resource until ACTIVE: one line per state, with the time spent in the last one."""
    if not spec.queued:
        return  # tpu-vm create returned: the VM exists
    start = changed = clock()
    last = None
    while True:
        try:
            found = describe_queued(spec)
            current = QueuedState("NOT_FOUND") if found is None else found
        except TpustreamError as exc:  # a network error on this side: keep asking
            current = QueuedState("UNKNOWN", str(exc))
        if current.state != last:
            took = f" after {clock() - changed:.0f}s {last}" if last else ""
            console.say(f"queued resource {spec.name}: {current.state}{took}")
            last, changed = current.state, clock()
        if current.state == ACTIVE:
            return
        if current.state in GIVEN_UP or current.state == "NOT_FOUND":
            why = f": {current.detail}" if current.detail else ""
            raise ProvisioningFailed(f"queued resource {spec.name} is {current.state}{why}")
        if clock() - start >= timeout:
            raise ProvisioningFailed(
                f"queued resource {spec.name} is not ACTIVE after {timeout:g}s (still {current.state}); "
                "raise --create-timeout to wait longer"
            )
        sleep(poll_interval)


def delete(spec: SliceSpec, console: Console) -> bool:
    """Delete the queued resource (and its nodes) and any bare node of those names; True once none is left.

    Both are looked for whatever ``spec`` says: a pod made by other means, or a
    recreated one, may be either.
    """
    targets = [(f"queued resource {spec.name}", queued_describe_command(spec), queued_delete_command(spec))]
    targets += [
        (f"TPU VM {node}", node_describe_command(spec, node), node_delete_command(spec, node))
        for node in spec.nodes
    ]
    for what, describe_argv, delete_argv in targets:
        if describe_json(describe_argv, what) is None:
            continue
        code = run_streamed(delete_argv, console, "[gcloud] ", timeout=DELETE_TIMEOUT_SECONDS)
        if code != 0:
            console.say(
                f"could not delete {what} (exit code {code}); delete it with: {shlex.join(delete_argv)}"
            )
            return False
    return True
