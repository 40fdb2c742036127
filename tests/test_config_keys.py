"""Each config key's documentation and facts, written once beside its field (tpustream.config.keys)."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import typing
from pathlib import Path

from tpustream.checkpoint import (
    FINGERPRINT_IGNORES,
    RESUME_MAY_DIFFER,
    SHAPE_MAY_DIFFER,
    config_differences,
    config_fingerprint,
    schema_defaults,
)
from tpustream.config import TrainConfig
from tpustream.config.keys import FACTS, OnResume, facts_of, flatten, is_known, keys_where, leaf_keys
from tpustream.launch import resolve_config
from tpustream.observe.synthetic_rate import the_step

REPO = Path(__file__).resolve().parent.parent


def _fields(schema: type):
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        yield schema, field
        if dataclasses.is_dataclass(hints[field.name]):
            yield from _fields(hints[field.name])


def test_every_field_of_the_schema_is_a_documented_setting():
    """A field added without setting(...) would have no line in docs/configuration.md and no facts."""
    for schema, field in _fields(TrainConfig):
        assert FACTS in field.metadata, f"{schema.__name__}.{field.name} is not declared with setting()"
    undocumented = [key.name for key in leaf_keys() if not key.facts.doc.strip()]
    assert undocumented == []


def test_a_sections_facts_hold_for_its_keys_unless_a_key_says_otherwise():
    assert facts_of("debug.stop_at_step").resume == OnResume.ignore
    assert facts_of("accelerator.num_devices").resume == OnResume.change
    assert facts_of("data.num_workers").resume == OnResume.change
    assert facts_of("data.shuffle_buffer").resume == OnResume.keep
    assert not facts_of("data.mean").step and facts_of("optim.lr").step
    # Below a free-form mapping a key has the mapping's facts; a key nowhere in the schema, the root's.
    assert facts_of("model.options.width").free_form and is_known("model.options.width")
    assert not is_known("data.name") and not is_known("optim.lrr")
    assert keys_where(path=True) == (
        "data.root",
        "data.train_shards",
        "data.val_shards",
        "output_dir",
        "log_dir",
    )


def test_the_key_lists_are_derived_and_name_whole_sections_where_they_can():
    assert set(FINGERPRINT_IGNORES) >= {"epochs", "output_dir", "debug", "watchdog", "eval_every"}
    assert "debug.stop_at_step" not in FINGERPRINT_IGNORES  # "debug" covers it
    assert set(RESUME_MAY_DIFFER) == set(FINGERPRINT_IGNORES) | {
        "accelerator",
        "strategy",
        "mesh",
        "model.remat",
        "fsdp_wrap_min_params",
        "checkpoint",
        "log_steps",
        "data.num_workers",
        "data.prefetch_factor",
        "data.streams",
        "data.decode",
        "optim.on_epochs_change",
    }
    assert SHAPE_MAY_DIFFER == ("batch_size",)


def test_a_checkpoints_fingerprint_is_what_it_was_when_the_ignored_keys_were_a_list(compose_config):
    """Checkpoints written before keep matching: the fingerprint hashes the same keys the same way."""
    _, plain = resolve_config(compose_config("model=resnet18", "debug.stop_at_step=3"))
    listed = ("epochs", "output_dir", "log_dir", "resume", "eval_only", "debug", "watchdog")
    listed += ("early_stop_patience", "eval_every", "xla_cache_dir", "tensorboard")
    kept = {k: v for k, v in plain.items() if k not in listed}
    before = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()
    assert config_fingerprint(plain) == before


def test_a_run_saved_with_a_key_tpustream_no_longer_has_continues():
    saved = {"data": {"name": "digits", "root": "/d"}, "optim": {"lr": 0.1}}
    current = {"data": {"root": "/d"}, "optim": {"lr": 0.1}}
    assert config_differences(saved, current, RESUME_MAY_DIFFER, schema_defaults()) == []
    current["optim"]["lr"] = 0.2
    assert config_differences(saved, current, RESUME_MAY_DIFFER, schema_defaults()) == [
        "optim.lr: 0.1 -> 0.2"
    ]


def test_the_synthetic_step_is_the_keys_whose_step_fact_holds():
    config = {"data": {"root": "/d"}, "seed": 3, "epochs": 2, "optim": {"lr": 0.1}, "batch_size": 8}
    assert the_step(config) == {"optim.lr": 0.1, "batch_size": 8}


def test_flatten_names_leaves_by_dotted_keys_and_empty_mappings_have_none():
    assert flatten({"a": {"b": 1, "c": {}}, "d": [1]}) == {"a.b": 1, "d": [1]}


def test_the_configuration_page_is_generated_from_the_schema():
    """docs/configuration.md's key tables are the schema's: run scripts/config_reference.py after a change."""
    spec = importlib.util.spec_from_file_location(
        "config_reference", REPO / "scripts" / "config_reference.py"
    )
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    page = (REPO / "docs" / "configuration.md").read_text()
    assert reference.page_with(reference.render(), page) == page, "run python scripts/config_reference.py"
    for key in leaf_keys():
        assert f"| `{key.name}` |" in page
