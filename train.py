"""Train an image classifier on every XLA device of this host, streaming shards from GCS.

    python train.py                                    # digits, small CNN, XLA CPU device
    python train.py data=cifar10 model=resnet50 accelerator=tpu batch_size=128 epochs=18

Configuration lives in conf/ (see conf/config.yaml); any key can be overridden
on the command line. This file only parses the config and launches.
"""

import time

# Set-up time (metrics.jsonl, bench/EPOCH_TIME.md) counts from here, imports
# included, for the first run of this process; the later jobs of a Hydra
# multirun run in the same process and count from their own start.
PROCESS_START = [time.time()]

if __name__ in ("__main__", "__mp_main__"):
    # SIGTERM and SIGINT become a stop request instead of killing the process,
    # first thing, before the heavy imports. In train.py itself: a stop in the
    # seconds before the replicas start ends the run there (exit 75, 130 for
    # Ctrl-C) instead of being lost. This file is also the main module of the
    # processes that xmp.spawn and the simulated pod start, and of their
    # DataLoader workers; this runs on their main thread, the only one allowed
    # to install signal handlers: a worker killed by a signal in the second it
    # spends importing torch would fail its replica.
    from tpustream.preemption import install_stop_handlers as install_early

    install_early()

import logging
import sys

import hydra
from omegaconf import DictConfig

from tpustream.checkpoint import OVERWRITE_RESUME
from tpustream.config import register_configs
from tpustream.errors import TpustreamError
from tpustream.launch import describe_result, launch, prepare
from tpustream.launch.spawn import skip_final_collection
from tpustream.preemption import Preempted, StoppedBeforeStart, install_stop_handlers
from tpustream.watchdog import Hung

log = logging.getLogger("train")
register_configs()

# Jobs of a Hydra multirun that failed: the sweep goes on, and the process exits non-zero at its end.
FAILED_JOBS: list[str] = []


def is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def how_to_continue(cfg: DictConfig) -> str:
    again = "run the same command" if cfg.resume != OVERWRITE_RESUME else "run it with resume=auto"
    return f"progress is in {cfg.output_dir}/checkpoints/last.pt: {again} to continue"


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    started = PROCESS_START.pop() if PROCESS_START else time.time()
    install_stop_handlers()  # this process waits for its replicas, and reports
    try:
        result = launch(prepare(cfg, started_at=started))
    except StoppedBeforeStart as exc:
        log.warning("stopped before training started (%s)", exc)
        sys.exit(exc.exit_code)
    except Hung as exc:
        # A replica's watchdog found nothing progressing; its stacks file names where.
        log.error("hung: %s; %s", exc, how_to_continue(cfg))
        sys.exit(exc.exit_code)
    except Preempted as exc:
        if cfg.data.synthetic:  # it saved nothing; run again, it measures again from the start
            log.warning("stopped (%s); a synthetic run (data.synthetic) saves no progress", exc)
            sys.exit(exc.exit_code)
        log.warning("preempted (%s); %s", exc, how_to_continue(cfg))
        sys.exit(exc.exit_code)
    except TpustreamError as exc:
        log.error("%s", exc)
        if is_multirun():
            # One job's bad config or data must not cost the other jobs their runs.
            from hydra.core.hydra_config import HydraConfig

            FAILED_JOBS.append(f"job {HydraConfig.get().job.num}: {exc}")
            return
        sys.exit(2)
    if result and not cfg.eval_only:
        print(describe_result(result, cfg.output_dir), flush=True)


if __name__ == "__main__":
    from tpustream.launch.checks import check_override_keys, check_run_dir

    # Hydra creates its run folder before main() runs, and reports a failure
    # there as a traceback, and an unknown key in several lines: say each in one line instead.
    problem = check_override_keys(sys.argv[1:]) or check_run_dir(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        main()
    finally:
        skip_final_collection()  # every job has run: this process only exits now
    if FAILED_JOBS:
        print(f"{len(FAILED_JOBS)} job(s) of the multirun failed: {'; '.join(FAILED_JOBS)}", file=sys.stderr)
        sys.exit(2)
