"""observe.advice: input-bound by the best figure there is, workers within the host, runs compared."""

from __future__ import annotations

import re

import pytest

from tpustream.observe.advice import advise, advise_runs, host_worker_cap


def epochs(wait: float, rate: float = 3033.0, **fields) -> list[dict]:
    """Three metrics.jsonl lines of a steady run (epoch 0 is left out as start-up)."""
    return [
        {"epoch": number, "input_wait_fraction": wait, "input_wait_fraction_worst": wait, "global_rate": rate}
        | fields
        for number in range(3)
    ]


def suggested(finding: str) -> int | None:
    """The worker count a finding tells the run to go to (None: it names none)."""
    found = re.search(r"raise data\.num_workers from \d+ to (?:about )?(\d+)", finding)
    return int(found.group(1)) if found else None


def test_the_suggested_workers_never_pass_the_vcpus_each_replica_gets_less_one():
    # An H100 host of 16 vCPUs, one replica, 12 workers waiting 29%: not "about 32".
    (finding,) = advise(epochs(0.29), num_workers=12, cpus=16, local_replicas=1)
    assert suggested(finding) == 15
    assert "(the most: this host has 16 vCPUs, one kept for each replica's loop)" in finding
    # Four replicas share the host: 16 // 4 - 1 = 3 each.
    (finding,) = advise(epochs(0.5), num_workers=2, cpus=16, local_replicas=4)
    assert suggested(finding) == 3 and "this host has 16 vCPUs for 4 replicas" in finding
    for cpus in (1, 2, 8, 16, 96):
        for replicas in (1, 2, 4, 8):
            for workers in (0, 1, 4, 12, 32):
                for wait in (0.25, 0.5, 0.9):
                    (finding,) = advise(epochs(wait), workers, cpus, local_replicas=replicas)
                    target = suggested(finding)
                    cap = max(1, cpus // replicas - 1)
                    assert host_worker_cap(cpus, replicas) == cap
                    assert target is None or workers < target <= cap, (cpus, replicas, workers, finding)


def test_at_the_cap_the_advice_says_what_can_help_instead_of_more_workers():
    (finding,) = advise(epochs(0.29), num_workers=15, cpus=16, local_replicas=1)
    assert suggested(finding) is None
    assert "data.num_workers=15 already uses the 15 vCPU(s) this host spares a replica" in finding
    assert "more workers cannot help on this host; store fewer bytes per sample, set data.in_" in finding
    assert finding.endswith("or use a host with more vCPUs")
    (finding,) = advise(epochs(0.29), num_workers=15, cpus=16, local_replicas=1, gpu_could_decode=True)
    assert finding.endswith(
        "; or let the GPU decode the JPEGs (data.decode=device: the workers then only read them "
        "and draw the crops)"
    )
    (finding,) = advise(epochs(0.29), num_workers=32, cpus=16, local_replicas=1)
    assert "data.num_workers=32 is more than the 15 vCPU(s)" in finding
    assert "fewer (15) may be faster" in finding
    # This machine: 2 vCPUs, one replica, one worker: the cap, not "raise from 1 to 2".
    (finding,) = advise(epochs(0.5), num_workers=1, cpus=2, local_replicas=1)
    assert "data.num_workers=1 already uses the 1 vCPU(s)" in finding


def test_without_the_hosts_vcpus_the_advice_says_what_its_count_needs():
    # tpustream-report reads a run later, elsewhere: the count comes with the vCPUs it takes.
    (finding,) = advise(epochs(0.5), num_workers=2)
    assert "raise data.num_workers from 2 to about 5 (if the training host has 6 vCPUs per replica" in finding


def test_the_devices_idle_time_decides_over_the_training_threads_wait():
    # The device's own figure, when the epoch records carry it, names itself.
    (finding,) = advise(epochs(0.29, input_bound_fraction=0.31), num_workers=4, cpus=16)
    assert finding.startswith("input-bound: the device sat idle waiting for input 31% of the loop; raise")
    # The thread waited, but the device ran the steps already queued: not input-bound.
    (finding,) = advise(epochs(0.29, input_bound_fraction=0.02), num_workers=4, cpus=16)
    assert finding.startswith("not input-bound: the device sat idle waiting for input only 2% of the loop")
    assert "the training thread waited for batches 29% of the time" in finding and suggested(finding) is None
    assert advise(epochs(0.05, input_bound_fraction=0.02), num_workers=4, cpus=16) == []
    # Without it, the host-side figure, saying it is host-side.
    (finding,) = advise(epochs(0.29), num_workers=4, cpus=16)
    assert finding.startswith(
        "input-bound: the training thread waited for batches 29% of the time "
        "(worst replica 29%; host-side: the device may have been busy)"
    )


@pytest.mark.parametrize("wait", [0.29, 0.6])
def test_a_run_at_95_percent_of_its_synthetic_rate_is_not_input_bound_whatever_it_waited(wait):
    # 98% of the GPU's own rate (data.synthetic=true) while waiting 29%: no "raise to 8".
    (finding,) = advise(epochs(wait, rate=3033), num_workers=4, cpus=16, synthetic_rate=3095)
    assert finding.startswith(
        "not input-bound: the run reached 98% of its synthetic rate (3033 of 3095 samples/s with "
        "data.synthetic=true)"
    )
    assert suggested(finding) is None
    # Below it, the wait counts, and the ratio is said beside it.
    (finding,) = advise(epochs(wait, rate=3033), num_workers=4, cpus=16, synthetic_rate=4000)
    assert finding.startswith("input-bound:") and "the run reached 76% of its synthetic rate" in finding
    assert suggested(finding) is not None
    # Near it and not waiting: nothing to say.
    assert advise(epochs(0.05, rate=3033), num_workers=4, cpus=16, synthetic_rate=3095) == []


def test_runs_where_more_workers_were_slower_are_named_with_both_rates():
    def run(workers: int, rate: float, **config) -> tuple[dict, list[dict]]:
        flat = {"output_dir": f"/runs/{workers}", "data.num_workers": workers, "batch_size": 256} | config
        return flat, [{"epoch": 0, "global_rate": rate / 2}, *epochs(0.29, rate)[1:]]

    (finding,) = advise_runs([run(4, 3033), run(12, 2882)])
    assert finding.startswith(
        "too many workers: data.num_workers=12 ran at 2882 samples/s, slower than data.num_workers=4 at 3033"
    )
    assert "compete for the host's vCPUs" in finding
    # Faster with more, or within the few percent runs differ by: nothing.
    assert advise_runs([run(4, 2882), run(12, 3033)]) == []
    assert advise_runs([run(4, 3033), run(12, 3000)]) == []
    # A sweep of workers and batch sizes: each batch size's runs compared among themselves.
    sweep = [run(4, 3033), run(12, 2882), run(4, 2000, batch_size=128), run(12, 2500, batch_size=128)]
    assert len(advise_runs(sweep)) == 1
    # Runs that differ in something else as well are not compared.
    assert advise_runs([run(4, 3033), run(12, 2882, batch_size=128)]) == []
    # Synthetic runs read no data: their workers say nothing.
    synthetic = [
        (config, [r | {"synthetic": True} for r in records])
        for config, records in (run(4, 3033), run(12, 2882))
    ]
    assert advise_runs(synthetic) == []


def test_the_vcpus_counted_are_the_ones_this_process_may_run_on(monkeypatch):
    """A container or taskset given 4 of 64 cores sizes workers for 4 (os.cpu_count() says 64)."""
    from tpustream.observe import advice

    monkeypatch.setattr(advice.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(advice.os, "cpu_count", lambda: 64)
    assert advice.usable_cpus() == 4
    monkeypatch.delattr(advice.os, "sched_getaffinity")  # as on macOS
    assert advice.usable_cpus() == 64


def resumed_run(*epochs_: tuple[str, str, int, bool]) -> list[dict]:
    """Lines naming their processes, each (ended by, trained by, compilations, evaluated)."""
    return [
        {
            "epoch": number,
            "compilations": total,
            "process": ended_by,
            "train_process": trained_by,
            "global_rate": 1000.0,
            **({"val_accuracy": 0.5} if evaluated else {}),
        }
        for number, (ended_by, trained_by, total, evaluated) in enumerate(epochs_)
    ]


def test_a_resumed_processs_first_compiles_are_not_recompiles():
    """A run stopped and resumed: each process compiled its graphs once, in the epoch it resumed in."""
    from tpustream.observe.advice import process_epochs

    # The issue's digits run: stopped after epoch 0's training (the next process evaluated it and
    # compiled 1 graph), then in epoch 1 (a third compiled its 5 there, and nothing after).
    records = resumed_run(("p2", "p1", 1, True), ("p3", "p3", 5, True), ("p3", "p3", 5, True))
    assert advise(records) == []
    assert [e.compiles for e in process_epochs(records)] == [1, 5, 0]
    assert [e.started for e in process_epochs(records)] == [True, True, False]
    # Without the third stop: the second process's first training loop compiled in epoch 1.
    records = resumed_run(("p2", "p1", 1, True), ("p2", "p2", 5, True), ("p2", "p2", 5, True))
    assert advise(records) == []
    # What a process compiles after its first loop and evaluation is a recompile, named per process.
    records = resumed_run(("p2", "p1", 1, True), ("p2", "p2", 5, True), ("p2", "p2", 7, True))
    (finding,) = advise(records)
    assert finding.startswith("compile-bound: 2 graph(s) compiled after epoch 0 (by epoch 2)")
    records = resumed_run(
        ("p2", "p1", 1, True),
        ("p2", "p2", 5, True),
        ("p2", "p2", 7, True),
        ("p3", "p3", 5, True),
        ("p3", "p3", 6, True),
    )
    (finding,) = advise(records)
    assert finding.startswith(
        "compile-bound: 3 graph(s) compiled after its process's first epoch (by epoch 2)"
    )


def test_lines_that_name_no_process_are_split_by_their_set_up_time_or_a_count_that_fell():
    lines = [
        {"epoch": 0, "compilations": 1, "val_accuracy": 0.1, "setup_seconds": 5.0},
        {"epoch": 1, "compilations": 5, "val_accuracy": 0.2, "setup_seconds": 5.0},  # resumed in
        {"epoch": 2, "compilations": 5, "val_accuracy": 0.3},
    ]
    assert advise(lines) == []
    lines[1].pop("setup_seconds")  # no start time given: a count that rose is a recompile
    assert advise(lines)[0].startswith("compile-bound: 4 graph(s)")
    lines[1]["compilations"] = 0  # ... and one that fell starts a process (its 0 are its own)
    assert advise([*lines[:2], {**lines[2], "compilations": 0}]) == []


def test_a_first_evaluation_after_epoch_0_compiles_its_graph_once():
    """eval_every=2: the evaluation graph compiles in epoch 1, the first evaluated one."""
    records = resumed_run(
        ("p1", "p1", 3, False), ("p1", "p1", 4, True), ("p1", "p1", 4, False), ("p1", "p1", 5, True)
    )
    assert advise(records[:3]) == []
    (finding,) = advise(records)  # a second evaluation that compiles: a recompile
    assert finding.startswith("compile-bound: 1 graph(s) compiled after epoch 0 (by epoch 3)")


def test_the_steady_epochs_leave_out_those_a_process_resumed_in():
    from tpustream.observe.advice import measured

    records = resumed_run(("p1", "p1", 3, True), ("p2", "p2", 3, True), ("p2", "p2", 3, True))
    records[1]["global_rate"] = 120.0  # its rate includes compiling the resumed process's graphs
    assert [r["epoch"] for r in measured(records)] == [2]
    assert [r["epoch"] for r in measured(records[:2])] == [1]  # nothing steady: all but epoch 0
    # A stop between training and evaluation: the next process only evaluated epoch 0.
    records = resumed_run(("p2", "p1", 1, True), ("p2", "p2", 3, True), ("p2", "p2", 3, True))
    assert [r["epoch"] for r in measured(records)] == [2]


def saves(stall: float, copy: float | None, writer_wait: float | None = 0.0) -> list[dict]:
    """Three epochs of 10 s whose loop waited `stall` seconds for saves, split as given."""
    parts = (
        {}
        if copy is None
        else {"checkpoint_copy_seconds": copy, "checkpoint_writer_wait_seconds": writer_wait}
    )
    return [
        {"epoch": number, "checkpoint_stall_seconds": stall, "epoch_seconds": 10.0, **parts}
        for number in range(3)
    ]


def test_the_saving_advice_says_what_the_loop_waited_for_and_names_only_changes_not_made():
    from tpustream.observe.advice import SavingSettings

    # The run: asynchronous (the default), every 3 steps, the wait almost all the host copy.
    every_3 = SavingSettings(every_n_steps=3, asynchronous=True)
    (finding,) = advise(saves(2.8, copy=2.7), saving=every_3)
    assert finding.startswith("host-bound: training waited for checkpoints up to 28% of an epoch, 96% of it")
    assert "in the state's copy to host memory, which every save makes, written in the background" in finding
    assert finding.endswith(": raise checkpoint.every_n_steps from 3 (or 0: epoch ends only)")
    assert "asynchronous" not in finding.split(":")[-1] and "bucket" not in finding
    # Saving at epoch ends only already: nothing in checkpoint.* to change, and none named.
    (finding,) = advise(saves(2.8, copy=2.7), saving=SavingSettings(0, True))
    assert finding.endswith("; checkpoint.every_n_steps=0 already saves at epoch ends only")
    assert "raise" not in finding
    # Synchronous saves waiting for their writing: asynchronous is the change.
    (finding,) = advise(saves(2.8, copy=0.3), saving=SavingSettings(3, False))
    assert "89% of it for writing saves synchronously (checkpoint.asynchronous=false)" in finding
    assert "turn checkpoint.asynchronous on (the writing then overlaps training)" in finding
    # Asynchronous, but each save waited for the previous one's writing: the writer was slower.
    (finding,) = advise(saves(2.8, copy=0.3, writer_wait=2.4), saving=every_3)
    assert "86% of it for the background writer to finish the previous save" in finding
    assert finding.endswith(
        "raise checkpoint.every_n_steps from 3 (or 0: epoch ends only), or save to a closer bucket"
    )
    # Older lines: no split and unknown settings; the old advice, asynchronous only if it is off.
    (finding,) = advise(saves(2.8, copy=None))
    assert finding == (
        "host-bound: training waited for checkpoints up to 28% of an epoch: raise checkpoint.every_n_steps "
        "(or 0: epoch ends only), turn checkpoint.asynchronous on if it is off, or save to a closer bucket"
    )
    assert advise(saves(0.5, copy=0.5), saving=every_3) == []  # 5%: not worth a look
