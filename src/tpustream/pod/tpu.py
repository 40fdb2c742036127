"""The pod's state, from ``gcloud ... describe`` of each node: how many hosts, and waiting until READY.

A pod is one TPU VM node, or with --num-slices one per slice
(tpustream.pod.multislice): it is READY when every node is, and its state is
otherwise the first node's that is not (one that will never be READY first).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from tpustream.errors import TpustreamError
from tpustream.pod.commands import describe_command
from tpustream.pod.processes import Console
from tpustream.pod.spec import LaunchSpec

READY = "READY"
# States a TPU VM does not leave by itself: waiting for READY would be forever.
TERMINAL_STATES = {
    "PREEMPTED": "a preemptible or spot TPU VM does not come back: run this command again with --recreate "
    "(it deletes the pod, asks for it again and resumes from last.pt), or recreate it yourself "
    "(tpustream-pod create) and run it again with --sync",
    "TERMINATED": "run this command again with --recreate, or delete it, recreate it (tpustream-pod create) "
    "and run it again with --sync",
    "STOPPED": "start it (gcloud compute tpus tpu-vm start) and run this command again",
    "STOPPING": "start it (gcloud compute tpus tpu-vm start) and run this command again",
    "DELETING": "it is being deleted",
    "HIDING": "it is being hidden",
    "HIDDEN": "it is hidden",
}
# Of TERMINAL_STATES, those --recreate recovers from: the pod is gone for good, delete and ask again.
GONE_STATES = ("PREEMPTED", "TERMINATED", "NOT_FOUND")
DESCRIBE_TIMEOUT_SECONDS = 120


class TpuGone(TpustreamError):
    """The TPU VM was taken (PREEMPTED, TERMINATED) or no longer exists (NOT_FOUND): only a new one helps."""

    def __init__(self, message: str, state: str) -> None:
        super().__init__(message)
        self.state = state


def terminal_error(node: str, state: str) -> TpustreamError:
    """The error for a TPU VM in a state it never leaves by itself: TpuGone where --recreate helps."""
    message = f"TPU {node} is {state}: {TERMINAL_STATES[state]}"
    return TpuGone(message, state) if state in GONE_STATES else TpustreamError(message)


@dataclass(frozen=True)
class TpuInfo:
    state: str
    num_workers: int  # hosts, one per network endpoint (of each node: the slices are alike)
    address: str | None = None  # the first host's internal IP: slice 0's coordinates several slices
    node: str = ""  # the node this is about: of several, the first that is not READY


def info_from_node(found: dict, node: str = "") -> TpuInfo:
    """The parts of a node's ``describe --format=json`` a launch needs."""
    endpoints = found.get("networkEndpoints") or []
    address = endpoints[0].get("ipAddress") if endpoints and isinstance(endpoints[0], dict) else None
    return TpuInfo(str(found.get("state", "UNKNOWN")), len(endpoints), address, node)


def parse_describe(text: str, node: str) -> TpuInfo:
    try:
        return info_from_node(json.loads(text), node)
    except (ValueError, AttributeError) as exc:
        raise TpustreamError(f"gcloud describe {node}: unexpected output ({exc}): {text[:200]!r}") from None


def pod_info(spec: LaunchSpec, nodes: list[TpuInfo]) -> TpuInfo:
    """The pod from its nodes' infos, in spec.nodes' order: READY only when every node is."""
    waiting = [info for info in nodes if info.state != READY]
    if waiting:
        return next((info for info in waiting if info.state in TERMINAL_STATES), waiting[0])
    first = nodes[0]
    if any(info.num_workers != first.num_workers for info in nodes):
        counts = ", ".join(f"{info.node}: {info.num_workers}" for info in nodes)
        raise TpustreamError(f"the slices of TPU {spec.tpu} have different numbers of hosts ({counts})")
    return TpuInfo(READY, first.num_workers, first.address, spec.tpu)


def describe(spec: LaunchSpec) -> TpuInfo:
    """The pod's state: every node described."""
    return pod_info(spec, [describe_node(spec, node) for node in spec.nodes])


def describe_node(spec: LaunchSpec, node: str) -> TpuInfo:
    try:
        done = subprocess.run(
            describe_command(spec, node),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=DESCRIBE_TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired:
        raise TpustreamError(f"gcloud describe {node}: no answer in {DESCRIBE_TIMEOUT_SECONDS}s") from None
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        detail = lines[-1] if lines else f"exit code {done.returncode}"
        raise TpustreamError(f"gcloud describe {node} in {spec.zone} failed: {detail}")
    return parse_describe(done.stdout, node)


def wait_until_ready(
    spec: LaunchSpec,
    console: Console,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> TpuInfo:
    """Poll describe until the TPU VM is READY; fail at once in a state it never leaves by itself."""
    deadline = clock() + spec.ready_timeout
    while True:
        try:
            info = describe(spec)
        except TpustreamError as exc:
            if "NOT_FOUND" in str(exc):
                raise TpuGone(
                    f"TPU {spec.tpu} no longer exists: run this command again with --recreate, or recreate "
                    "it (tpustream-pod create) and run it again with --sync; training resumes from last.pt",
                    "NOT_FOUND",
                ) from None
            state = f"unknown ({exc})"  # a network error on this side: keep trying
        else:
            if info.state == READY and info.num_workers:
                return info
            if info.state in TERMINAL_STATES:
                raise terminal_error(info.node, info.state)
            state = info.state if info.node == spec.tpu else f"{info.state} ({info.node})"
        if clock() >= deadline:
            raise TpustreamError(f"TPU {spec.tpu} is not READY after {spec.ready_timeout:g}s (state {state})")
        console.say(f"TPU {spec.tpu} is {state}; checking again in {spec.poll_interval:g}s")
        sleep(spec.poll_interval)
