"""A stand-in gcloud that scripts a pod's whole life: nodes, queued resources, preemption, ssh and scp.

It keeps a small world in a JSON file (under a lock: workers call it at once):
nodes by name (state, spec, hosts) and queued resources by name (the states
each describe walks through). A test sets the world and a script, puts the
stub first on PATH, runs ``tpustream.pod.__main__.main`` in process, and reads
back the world and the calls. What the script can say:

- ``plans``: per ``queued-resources create``, the states its describes walk
  through, e.g. ``["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"]`` (the
  last one stays); reaching ACTIVE makes the node READY, with empty disks.
- ``create_exit``: exit codes of successive creates (a quota error: 1).
- ``preempt_runs``: training runs (counted per worker) during which the pod is
  preempted: the training gets ``STUB_PREEMPT=1`` (it saves and exits 75) and
  the node becomes PREEMPTED; ssh to a node that is not READY exits 255.
- ``sigint``: ``{"KEY": N}`` sends SIGINT to the launcher at the Nth call of
  KEY (``queued-resources create``, ``tpu-vm delete``, ``ssh 0``, ...), after
  doing what the call does, then waits to be stopped: a Ctrl-C at that moment.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

STUB = r'''#!{python}
"""A stand-in for gcloud compute tpus (tpu-vm, queued-resources): see tests/gcloud_world.py."""
import fcntl, json, os, shutil, signal, subprocess, sys, threading, time

LOG, WORLD = os.environ["GCLOUD_STUB_LOG"], os.environ["GCLOUD_STUB_WORLD"]
args = sys.argv[1:]
group, verb = (args[2], args[3]) if len(args) > 3 else (None, None)
name = args[4] if len(args) > 4 else None
key = f"{{group}} {{verb}}"


def flag(option):
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"--{{option}}=")), None)


lock = open(WORLD + ".lock", "w")
fcntl.flock(lock, fcntl.LOCK_EX)
with open(LOG, "a") as f:
    f.write(json.dumps(args) + "\n")
with open(LOG) as f:
    calls = [json.loads(line) for line in f]
with open(WORLD) as f:
    world = json.load(f)
script = world["script"]
worker, command = flag("worker"), flag("command")
training = verb == "ssh" and worker != "all" and command != "true"
if verb == "ssh":
    key = f"ssh {{worker}}"
    # The training runs of this worker (not the ssh check, not the --worker=all ones)
    mine = f"--worker={{worker}}"
    count = sum(1 for c in calls if c[3] == "ssh" and mine in c and "--command=true" not in c)
else:
    count = sum(1 for c in calls if c[2:4] == [group, verb])


def save():
    with open(WORLD + ".tmp", "w") as f:
        json.dump(world, f)
    os.replace(WORLD + ".tmp", WORLD)


def not_found(what):
    where = f"gcloud.compute.tpus.{{group}}.{{verb}}"
    print(f"ERROR: ({{where}}) NOT_FOUND: {{what}} {{name}} was not found", file=sys.stderr)
    sys.exit(1)


def make_node(spec):
    disk = os.environ.get("STUB_DISK")
    if disk and os.path.isdir(disk):  # a new VM has empty disks
        shutil.rmtree(disk)
    world["nodes"][name] = {{**spec, "state": "READY"}}
    world["made"] = world.get("made", 0) + 1


def ctrl_c_here():
    """Ctrl-C at this call, its work saved: SIGINT to the launcher; this gcloud waits to be stopped."""
    if script.get("sigint", {{}}).get(key) == count:
        fcntl.flock(lock, fcntl.LOCK_UN)
        os.kill(os.getppid(), signal.SIGINT)
        time.sleep(5)
        sys.exit(1)


def run_here(command, env):
    child = subprocess.Popen(["bash", "-c", command], start_new_session=True, env={{**os.environ, **env}})
    code = child.wait()
    return 128 - code if code < 0 else code


nodes, queued = world["nodes"], world["queued"]
if group == "tpu-vm" and verb == "describe":
    node = nodes.get(name) or not_found("node")
    hosts = node.get("hosts", 2) if node["state"] == "READY" else 0
    endpoints = [{{"ipAddress": f"10.0.0.{{i}}"}} for i in range(hosts)]
    print(json.dumps({{**{{k: v for k, v in node.items() if k != "hosts"}}, "networkEndpoints": endpoints}}))
elif group == "tpu-vm" and verb == "delete":
    nodes.pop(name, None) if name in nodes else not_found("node")
    save()
    ctrl_c_here()
elif group == "tpu-vm" and verb == "create":
    codes = script.get("create_exit", [])
    if count <= len(codes) and codes[count - 1]:
        sys.exit(codes[count - 1])
    make_node({{"acceleratorType": flag("accelerator-type"), "runtimeVersion": flag("version"),
               "schedulingConfig": {{"preemptible": True}}, "hosts": world["hosts"]}})
elif group == "queued-resources" and verb == "create":
    codes = script.get("create_exit", [])
    if count <= len(codes) and codes[count - 1]:
        print("ERROR: (gcloud.compute.tpus.queued-resources.create) RESOURCE_EXHAUSTED", file=sys.stderr)
        sys.exit(codes[count - 1])
    if name in queued:
        print("ERROR: ALREADY_EXISTS", file=sys.stderr)
        sys.exit(1)
    plans = script.get("plans", [])
    startup = flag("metadata-from-file")
    if startup:
        shutil.copy(startup.split("=", 1)[1], LOG + ".startup-script")
    scheduling = {{"spot": "--spot" in args, "reserved": "--reserved" in args}}
    node = {{"acceleratorType": flag("accelerator-type"), "runtimeVersion": flag("runtime-version"),
            "schedulingConfig": scheduling, "hosts": world["hosts"],
            "networkConfig": {{"network": flag("network") or "default"}},
            "serviceAccount": {{"email": flag("service-account")}}}}
    states = plans[count - 1] if count <= len(plans) else ["ACTIVE"]
    queued[name] = {{"states": states, "seen": 0, "node": node}}
    save()
    ctrl_c_here()
elif group == "queued-resources" and verb == "describe":
    request = queued.get(name) or not_found("queued resource")
    state = request["states"][min(request["seen"], len(request["states"]) - 1)]
    request["seen"] += 1
    if state == "ACTIVE" and name not in nodes:
        make_node(request["node"])
    error = {{"error": {{"message": "no capacity in the zone"}}}}
    failed = {{"failedData": error}} if state == "FAILED" else {{}}
    save()
    ctrl_c_here()
    print(json.dumps({{"name": name, "state": {{"state": state, **failed}}}}))
elif group == "queued-resources" and verb == "delete":
    queued.pop(name, None) if name in queued else not_found("queued resource")
    if "--force" in args:
        nodes.pop(name, None)
    save()
    ctrl_c_here()
elif verb == "scp":
    shutil.copy(args[4], args[5].split(":", 1)[1])
elif verb == "ssh":
    node = nodes.get(name)
    preempted = training and count - 1 in script.get("preempt_runs", [])
    if not node or (node["state"] != "READY" and not preempted):
        print(f"ssh: connect to host 10.0.0.{{worker}} port 22: Connection refused", file=sys.stderr)
        sys.exit(255)
    env = {{"STUB_WORKER": worker}}
    if preempted:  # every host of this run is told to stop: it saves and exits 75
        env["STUB_PREEMPT"] = "1"
        node["state"] = "PREEMPTED"
    save()
    fcntl.flock(lock, fcntl.LOCK_UN)
    ctrl_c_here() if training else None
    sys.exit(run_here(command, env))
save()
'''

# The training on each "host": continues from last.txt (its last.pt), one epoch per step; only
# host 0 writes, as only rank 0 saves. Preempted (STUB_PREEMPT), it saves after one epoch and exits 75.
RESUMING_TRAIN = r"""
import json, os, sys
from pathlib import Path

options = dict(arg.split("=", 1) for arg in sys.argv[1:])
out, epochs = Path(options["output_dir"]), int(options["epochs"])
host = os.environ["TPUSTREAM_HOST_INDEX"]
last = out / "last.txt"
epoch = int(last.read_text()) if last.exists() else 0
print(json.dumps({"host": host, "resumed_from": epoch}), flush=True)
while epoch < epochs:
    epoch += 1
    if host == "0":
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "epochs.log", "a") as log:
            log.write(f"{epoch}\n")
        (out / "last.tmp").write_text(str(epoch))
        os.replace(out / "last.tmp", last)  # atomic, as the real last.pt: the other host reads it
    if os.environ.get("STUB_PREEMPT"):
        sys.exit(75)
"""


class World:
    """The stub on PATH and its world: set the pods and the script, read the calls and what is left."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.log = tmp_path / "gcloud-calls.jsonl"
        self.path = tmp_path / "world.json"
        stub = self.bin / "gcloud"
        stub.write_text(STUB.format(python=sys.executable))
        stub.chmod(0o755)
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.disk = tmp_path / "remote"  # every host's workdir: shared, wiped when a node is made
        self.save({"nodes": {}, "queued": {}, "script": {}, "hosts": 2})
        monkeypatch.setenv("HOME", str(self.home))
        monkeypatch.setenv(
            "PATH", f"{self.bin}{os.pathsep}{_shims(tmp_path)}{os.pathsep}{os.environ['PATH']}"
        )
        monkeypatch.setenv("GCLOUD_STUB_LOG", str(self.log))
        monkeypatch.setenv("GCLOUD_STUB_WORLD", str(self.path))
        monkeypatch.setenv("STUB_DISK", str(self.disk))

    def load(self) -> dict:
        return json.loads(self.path.read_text())

    def save(self, world: dict) -> None:
        self.path.write_text(json.dumps(world))

    def set(self, **changes) -> None:
        self.save({**self.load(), **changes})

    def calls(self, group: str | None = None, verb: str | None = None) -> list[list[str]]:
        if not self.log.exists():
            return []
        calls = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [c for c in calls if (group is None or c[2] == group) and (verb is None or c[3] == verb)]

    def left(self) -> tuple[list[str], list[str]]:
        """The names of the nodes and of the queued resources that exist now."""
        world = self.load()
        return sorted(world["nodes"]), sorted(world["queued"])


def _shims(tmp_path: Path) -> Path:
    """python3 and pip on the "hosts": --sync's `python3 -m venv` and `pip install` in a blink."""
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "pip").write_text("#!/bin/bash\nexit 0\n")
    (shims / "python3").write_text(
        f'#!/bin/bash\n[ "$1 $2" = "-m venv" ] || exit 3\nmkdir -p "$3/bin" && cp {shims}/pip "$3/bin/pip"\n'
    )
    for shim in ("pip", "python3"):
        (shims / shim).chmod(0o755)
    return shims


def tiny_checkout(tmp_path: Path) -> Path:
    """What --sync ships (--source): enough to be a checkout, plus the resuming training."""
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (root / "train.py").write_text(RESUMING_TRAIN)
    return root


def spot_node(**changes) -> dict:
    """A READY spot v5litepod-16 as describe shows it (hosts: the stub's own field)."""
    node = {
        "state": "READY",
        "acceleratorType": "v5litepod-16",
        "runtimeVersion": "v2-alpha-tpuv5-lite",
        "schedulingConfig": {"spot": True},
        "networkConfig": {
            "network": "projects/p/global/networks/tpu-net",
            "subnetwork": "projects/p/regions/r/subnetworks/tpu-sub",
        },
        "serviceAccount": {"email": "trainer@p.iam.gserviceaccount.com"},
        "hosts": 2,
    }
    return {**node, **changes}


def wipe(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)
