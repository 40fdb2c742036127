"""Typed configuration schemas, registered in Hydra's ConfigStore.

The YAML files in conf/ fill these dataclasses; Hydra checks every key and
type against them when it composes the config, so a typo such as
``optim.lrr=0.1`` or ``epochs=ten`` fails before any process is spawned.

``schema`` holds the dataclasses (each section checks its own fields; the
recipe's sections, model, optim and ema, are ``recipe``'s), each field
declared with ``facts.setting``: its documentation and facts beside it;
``keys`` resolves those by dotted name (docs/configuration.md is written from
them); ``choices`` holds the enums, ``environment`` the settings read from the
environment.

This package is the ground floor: everything reads it, and it imports none
of the code that reads it. A check that needs the data code, a model or
storage lives beside that package (data.read.config_checks, models.check_model_config,
augment.policies.build_policy) and launch.checks calls it before spawning.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from tpustream.config.choices import (
    BATCH_AXES,
    MESH_AXES,
    PLATFORMS,
    SPMD_STRATEGIES,
    Accelerator,
    BestOf,
    Collectives,
    Decode,
    Device,
    EpochsChange,
    EraseMode,
    IndexMode,
    Interpolation,
    LastBatch,
    MixMode,
    ModelLibrary,
    OnError,
    OptimizerName,
    Platform,
    Precision,
    RuntimeKind,
    Schedule,
    Strategy,
    TrainCrop,
)
from tpustream.config.environment import positive_seconds
from tpustream.config.recipe import AugmentConfig, EmaConfig, ModelConfig, OptimConfig
from tpustream.config.schema import (
    AcceleratorConfig,
    CheckpointConfig,
    DataConfig,
    DebugConfig,
    MeshConfig,
    TrainConfig,
    WatchdogConfig,
)

__all__ = [
    "BATCH_AXES",
    "MESH_AXES",
    "MeshConfig",
    "PLATFORMS",
    "SPMD_STRATEGIES",
    "Accelerator",
    "AcceleratorConfig",
    "AugmentConfig",
    "BestOf",
    "EpochsChange",
    "CheckpointConfig",
    "Collectives",
    "DataConfig",
    "DebugConfig",
    "Decode",
    "Device",
    "EmaConfig",
    "EraseMode",
    "Interpolation",
    "IndexMode",
    "LastBatch",
    "MixMode",
    "ModelConfig",
    "ModelLibrary",
    "OnError",
    "OptimConfig",
    "OptimizerName",
    "Platform",
    "Precision",
    "RuntimeKind",
    "Schedule",
    "Strategy",
    "TrainConfig",
    "TrainCrop",
    "WatchdogConfig",
    "positive_seconds",
    "register_configs",
]


def register_configs() -> None:
    """Register the schemas so conf/*.yaml can extend them by name.

    Each schema is stored at the top of the ConfigStore, in no group: an
    entry in a group is one of its options, which Hydra lists in its errors
    and --help and lets ``accelerator=accelerator_schema`` pick (a run on the
    schema's defaults). A group's files extend theirs from the top as Hydra's
    docs show for a schema outside the group, ``- /accelerator_schema@_here_``,
    so each file is still checked against it as it is composed.
    """
    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=TrainConfig)
    cs.store(name="data_schema", node=DataConfig)
    cs.store(name="model_schema", node=ModelConfig)
    cs.store(name="optim_schema", node=OptimConfig)
    cs.store(name="accelerator_schema", node=AcceleratorConfig)
