"""Train an image classifier on every XLA device of this host, streaming shards from GCS.

    python train.py                                    # digits, small CNN, XLA CPU device
    python train.py data=cifar10 model=resnet50 accelerator=tpu batch_size=128 epochs=18

Configuration lives in conf/ (see conf/config.yaml); any key can be overridden
on the command line. This file only parses the config and launches.
"""

import logging
import sys

import hydra
from omegaconf import DictConfig

from tpustream.config import register_configs
from tpustream.errors import TpustreamError
from tpustream.launch import launch, prepare

log = logging.getLogger("train")
register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        result = launch(prepare(cfg))
    except TpustreamError as exc:
        log.error("%s", exc)
        sys.exit(2)
    if result and result["best"] and not cfg.eval_only:
        best = result["best"]
        print(
            f"best validation accuracy {100 * best['val_accuracy']:.2f}% "
            f"({best['val_correct']}/{best['val_samples']}) at epoch {best['epoch']}; "
            f"checkpoints in {cfg.output_dir}",
            flush=True,
        )


if __name__ == "__main__":
    main()
