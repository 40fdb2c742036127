"""Getting the pod READY for a launch: wait for it, and with --recreate ask for it again once it is taken.

A spot or preemptible TPU VM that is preempted never comes back. With
``recreate`` the launcher deletes what is left of it, asks for the same pod
again (the SliceSpec read from the pod before it went, or recorded on this
machine when it was made) as a queued resource, waits until it is ACTIVE and
its node READY, and the launch goes on: --sync ships the code to the new disks
and the same command continues from output_dir's last.pt. Requests are bounded
by --max-restarts, a failed one is retried after --backoff seconds (doubling),
and every step is one line with the time it took. A Ctrl-C while a request of
this launch is not yet ACTIVE deletes that request; a pod this launch made is
named at the end, with the command that deletes it.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import replace

from tpustream.errors import TpustreamError
from tpustream.pod import interrupts, queued
from tpustream.pod.commands import describe_command
from tpustream.pod.processes import Console
from tpustream.pod.slice_spec import SliceSpec, load_record, record_path, save_record, spec_from_describe
from tpustream.pod.spec import LaunchSpec
from tpustream.pod.tpu import (
    READY,
    TERMINAL_STATES,
    TpuGone,
    TpuInfo,
    describe,
    info_from_node,
    pod_info,
    terminal_error,
    wait_until_ready,
)
from tpustream.pod.types import slice_type


def learn_slice(spec: LaunchSpec, node: dict | None) -> SliceSpec | None:
    """How the pod was made: from a node's describe (recorded for later), this machine's record, or --type.

    The slice count is the launch's (--num-slices), whatever was recorded.
    """
    if node is not None:
        try:
            found = spec_from_describe(node, spec.tpu, spec.zone, spec.project, spec.num_slices)
            learned = replace(found, gcloud=spec.gcloud)
        except TpustreamError:
            pass  # too little in it: the record may know
        else:
            save_record(learned)
            return learned
    recorded = load_record(spec.tpu, spec.zone, spec.project, spec.gcloud)
    if recorded is not None:
        return replace(recorded, slices=spec.num_slices)
    if spec.slice_type is not None:
        kind = slice_type(spec.slice_type)
        return SliceSpec(
            name=spec.tpu,
            zone=spec.zone,
            project=spec.project,
            accelerator_type=kind.name,
            runtime_version=kind.runtime_version,
            provisioning=spec.provisioning,
            slices=spec.num_slices,
            gcloud=spec.gcloud,
        )
    return None


class PodKeeper:
    """The pod of one launch: its hosts once READY, recreated when it is gone and ``recreate`` allows."""

    def __init__(
        self,
        spec: LaunchSpec,
        console: Console,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec, self.console, self.sleep, self.clock = spec, console, sleep, clock
        self.slice: SliceSpec | None = None
        self.requests = 0  # queued-resource requests this launch made: at most --max-restarts
        self.recreated = False  # a pod this launch made is there: named at the end
        self.fresh = False  # the last ready() made a new pod: nothing of the old runs is left on it

    def first(self) -> TpuInfo | None:
        """Before the first run: the READY pod's hosts (None: --num-workers given, nothing to ask)."""
        spec = self.spec
        if spec.recreate:
            found = [queued.describe_json(describe_command(spec, node), f"TPU {node}") for node in spec.nodes]
            self.slice = learn_slice(spec, next((node for node in found if node is not None), None))
            if any(node is None for node in found):
                return self.recover("NOT_FOUND")
            nodes = zip(found, spec.nodes, strict=True)
            info = pod_info(spec, [info_from_node(described, node) for described, node in nodes])
        elif spec.num_workers is None or spec.num_slices > 1:
            info = describe(spec)  # several slices: the coordinator's address too
        else:
            return None
        if info.state == READY:
            return info
        if info.state in TERMINAL_STATES:
            error = terminal_error(info.node, info.state)
            if spec.recreate and isinstance(error, TpuGone):
                return self.recover(info.state)
            raise error
        if not spec.restart:
            raise TpustreamError(f"TPU {info.node} is {info.state}, not READY (--restart waits for READY)")
        return self.ready()

    def ready(self) -> TpuInfo:
        """Wait until the pod is READY; with ``recreate``, make it again if it is gone."""
        self.fresh = False
        try:
            return wait_until_ready(self.spec, self.console, self.sleep, self.clock)
        except TpuGone as gone:
            if not self.spec.recreate:
                raise
            return self.recover(gone.state)

    def recover(self, state: str) -> TpuInfo:
        """Delete what is left, ask again (with backoff after a failure) until the node is READY."""
        spec, made = self.spec, self.slice
        if made is None:
            raise TpustreamError(
                f"TPU {spec.tpu} is {state}, and neither the pod nor this machine "
                f"({record_path(spec.tpu, spec.zone, spec.project)}) says how it was made: recreate it with "
                f"tpustream-pod create {spec.tpu} --zone {spec.zone} --type TYPE [--spot] and launch again"
            )
        started = self.clock()
        self.console.say(
            f"TPU {spec.tpu} is {state}: --recreate asks for it again ({made.kind}, "
            f"{made.provisioning}, runtime {made.runtime_version})"
        )
        failures = 0
        while True:
            if self.requests >= spec.max_restarts:
                raise TpustreamError(
                    f"TPU {spec.tpu} is {state}, but the {spec.max_restarts} request(s) --max-restarts "
                    "allows are used up"
                )
            if failures:
                wait = spec.backoff * 2 ** (failures - 1)
                self.console.say(f"asking again in {wait:g}s")
                self.sleep(wait)
            try:
                self._request(made)
                info = wait_until_ready(spec, self.console, self.sleep, self.clock)
            except (queued.ProvisioningFailed, TpuGone) as exc:
                failures += 1  # a request that will not be filled was deleted; a node gone is, next
                self.console.say(f"request {self.requests} failed: {exc}")
                continue
            self.console.say(
                f"TPU {spec.tpu} is READY with {info.num_workers} worker(s): recreated in "
                f"{self.clock() - started:.0f}s (request {self.requests} of at most {spec.max_restarts})"
            )
            self.fresh = True
            return info

    def _request(self, made: SliceSpec) -> None:
        """One request: delete what is left, ask, wait until ACTIVE; a Ctrl-C meanwhile withdraws it."""
        begun = self.clock()
        if not queued.delete(made, self.console):
            raise TpustreamError(f"could not delete what is left of TPU {made.name} (see above)")
        self.console.say(f"deleted what was left of TPU {made.name} ({self.clock() - begun:.0f}s)")
        self.requests += 1
        try:
            begun = self.clock()
            self.recreated = True  # from the start of the request: gcloud may create it and then be stopped
            queued.request(made, self.console)
            save_record(made)  # a pod made from --type is recorded as `create` records it
            kind = "queued resource" if made.queued else "preemptible TPU VM"
            self.console.say(f"asked for {kind} {made.name} ({self.clock() - begun:.0f}s)")
            queued.wait_until_active(
                made, self.console, self.spec.create_timeout, self.spec.poll_interval, self.sleep, self.clock
            )
        except KeyboardInterrupt:
            self._withdraw(made)
            raise
        except queued.ProvisioningFailed:
            queued.delete(made, self.console)  # a request that will not be filled is not left in the queue
            self.recreated = False
            raise

    def _withdraw(self, made: SliceSpec) -> None:
        """After a Ctrl-C: delete the request this launch made; a second Ctrl-C leaves it, named."""
        commands = " && ".join(shlex.join(argv) for argv in queued.delete_commands(made))
        with interrupts.deferred(up_to=1):
            self.console.say(
                f"Ctrl-C: deleting TPU {made.name}, which this launch asked for (Ctrl-C again to leave it)"
            )
            try:
                if queued.delete(made, self.console):
                    self.recreated = False
                    self.console.say(f"deleted TPU {made.name}: nothing of it is left")
                    return
            except (KeyboardInterrupt, TpustreamError):
                pass  # a second Ctrl-C, or gcloud failing: say what may be left
        self.console.say(f"TPU {made.name} may be left behind; delete it with: {commands}")
        self.recreated = False  # named just now

    def farewell(self) -> None:
        """Name the pod this launch made: it is billed until someone deletes it."""
        if self.recreated and self.slice is not None:
            made = self.slice
            project = f" --project {made.project}" if made.project else ""
            self.console.say(
                f"TPU {made.name} was recreated by this launch and is still there (billed until deleted); "
                f"delete it when done: tpustream-pod delete {made.name} --zone {made.zone}{project}"
            )


def recreate_dry_run_lines(spec: LaunchSpec) -> list[str]:
    """What --recreate would run, as comments: it runs only if the pod is taken."""
    lines = [
        f"# --recreate: if TPU {spec.tpu} is PREEMPTED, TERMINATED or gone (at most {spec.max_restarts} "
        f"request(s), {spec.backoff:g}s backoff doubling), delete what is left and ask again:"
    ]
    made = load_record(spec.tpu, spec.zone, spec.project, spec.gcloud)
    if made is None:
        lines.append("#   as `describe` shows the pod at the launch (this machine has no record of it)")
        return lines
    lines += [f"#   {shlex.join(argv)}" for argv in queued.delete_commands(made)]
    lines.append(f"#   {shlex.join(queued.create_command(made, 'STARTUP_SCRIPT'))}")
    if made.queued:
        lines.append(f"#   {shlex.join(queued.queued_describe_command(made))}   # until ACTIVE")
    return lines
