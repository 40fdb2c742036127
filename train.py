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

import logging
import sys

import hydra
from omegaconf import DictConfig

from tpustream.config import register_configs
from tpustream.errors import PREEMPTED_EXIT_CODE, TpustreamError
from tpustream.launch import describe_result, launch, prepare
from tpustream.preemption import Preempted, install_stop_handlers

log = logging.getLogger("train")
register_configs()

if __name__ == "__mp_main__":
    # This file is also the main module of the processes that xmp.spawn and
    # the simulated pod start (and of their DataLoader workers); this runs on
    # their main thread, the only one allowed to install signal handlers, so
    # SIGTERM becomes a stop request there instead of killing them mid-step.
    install_stop_handlers()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    started = PROCESS_START.pop() if PROCESS_START else time.time()
    install_stop_handlers()  # this process waits for its replicas, and reports
    try:
        result = launch(prepare(cfg, started_at=started))
    except Preempted as exc:
        log.warning(
            "preempted (%s); progress is in %s/checkpoints/last.pt: run the same command to continue",
            exc,
            cfg.output_dir,
        )
        sys.exit(PREEMPTED_EXIT_CODE)
    except TpustreamError as exc:
        log.error("%s", exc)
        sys.exit(2)
    if result and not cfg.eval_only:
        print(describe_result(result, cfg.output_dir), flush=True)


if __name__ == "__main__":
    main()
