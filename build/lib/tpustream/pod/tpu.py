"""The TPU VM's state, from ``gcloud ... describe``: how many hosts, and waiting until it is READY."""

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


def terminal_error(spec: LaunchSpec, state: str) -> TpustreamError:
    """The error for a TPU VM in a state it never leaves by itself: TpuGone where --recreate helps."""
    message = f"TPU {spec.tpu} is {state}: {TERMINAL_STATES[state]}"
    return TpuGone(message, state) if state in GONE_STATES else TpustreamError(message)


@dataclass(frozen=True)
class TpuInfo:
    state: str
    num_workers: int  # hosts, one per network endpoint


def info_from_node(node: dict) -> TpuInfo:
    """The parts of a node's ``describe --format=json`` a launch needs."""
    endpoints = node.get("networkEndpoints") or []
    return TpuInfo(state=str(node.get("state", "UNKNOWN")), num_workers=len(endpoints))


def parse_describe(text: str, tpu: str) -> TpuInfo:
    try:
        return info_from_node(json.loads(text))
    except (ValueError, AttributeError) as exc:
        raise TpustreamError(f"gcloud describe {tpu}: unexpected output ({exc}): {text[:200]!r}") from None


def describe(spec: LaunchSpec) -> TpuInfo:
    try:
        done = subprocess.run(
            describe_command(spec),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=DESCRIBE_TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired:
        raise TpustreamError(
            f"gcloud describe {spec.tpu}: no answer in {DESCRIBE_TIMEOUT_SECONDS}s"
        ) from None
    if done.returncode != 0:
        lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        detail = lines[-1] if lines else f"exit code {done.returncode}"
        raise TpustreamError(f"gcloud describe {spec.tpu} in {spec.zone} failed: {detail}")
    return parse_describe(done.stdout, spec.tpu)


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
                raise terminal_error(spec, info.state)
            state = info.state
        if clock() >= deadline:
            raise TpustreamError(f"TPU {spec.tpu} is not READY after {spec.ready_timeout:g}s (state {state})")
        console.say(f"TPU {spec.tpu} is {state}; checking again in {spec.poll_interval:g}s")
        sleep(spec.poll_interval)
