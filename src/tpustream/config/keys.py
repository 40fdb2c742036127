"""The schema's keys by dotted name, each with its facts resolved; the one way a config is flattened.

``leaf_keys()`` walks the schema once; ``facts_of`` answers for any dotted
key (a key below model.options has the mapping's facts). The fingerprint,
resume's check, the synthetic twin, tpustream-report and docs/configuration.md
(scripts/config_reference.py) read these instead of keeping lists of keys.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from tpustream.config.facts import FACTS, ROOT_FACTS, KeyFacts, OnResume
from tpustream.config.schema import TrainConfig

__all__ = [
    "Key",
    "KeyFacts",
    "OnResume",
    "facts_of",
    "fields_beside",
    "flatten",
    "is_known",
    "key_names_where",
    "keys_where",
    "leaf_keys",
]


@dataclass(frozen=True)
class Key:
    """A leaf of the schema: its dotted name, type, default (MISSING: set by a group option) and facts."""

    name: str
    kind: Any
    default: Any
    facts: KeyFacts

    def choices(self) -> list[str]:
        """The values an enum or a bool key accepts; [] for open types."""
        kinds = typing.get_args(self.kind) or (self.kind,)
        for kind in kinds:
            if isinstance(kind, type) and issubclass(kind, Enum):
                return [member.value for member in kind]
        if self.kind is bool:
            return ["true", "false"]
        return []


def _merge(outer: KeyFacts, inner: KeyFacts) -> KeyFacts:
    values = {
        f.name: (getattr(inner, f.name) if getattr(inner, f.name) is not None else getattr(outer, f.name))
        for f in dataclasses.fields(KeyFacts)
    }
    values["doc"] = inner.doc
    return KeyFacts(**values)


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _walk(schema: type, prefix: str, outer: KeyFacts) -> typing.Iterator[tuple[Key, bool]]:
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        own = field.metadata.get(FACTS, KeyFacts())
        facts = _merge(outer, own)
        name = f"{prefix}{field.name}"
        kind = hints[field.name]
        if dataclasses.is_dataclass(kind):
            if not facts.doc:
                facts = dataclasses.replace(facts, doc=(kind.__doc__ or "").strip().splitlines()[0])
            yield Key(name, kind, None, facts), True
            yield from _walk(kind, f"{name}.", facts)
        else:
            yield Key(name, kind, _default_of(field), facts), False


@functools.cache
def schema_keys() -> tuple[tuple[Key, ...], dict[str, Key]]:
    """(the leaf keys in schema order, every key and section by dotted name)."""
    leaves, everything = [], {}
    for key, is_section in _walk(TrainConfig, "", ROOT_FACTS):
        everything[key.name] = key
        if not is_section:
            leaves.append(key)
    return tuple(leaves), everything


def leaf_keys() -> tuple[Key, ...]:
    """Every key a config sets, in the schema's order (sections are not keys)."""
    return schema_keys()[0]


def _nearest(name: str) -> tuple[Key | None, bool]:
    """The schema key or section that is `name` or holds it (None: none), and whether it is `name` itself."""
    known = schema_keys()[1]
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        key = known.get(".".join(parts[:end]))
        if key is not None:
            return key, end == len(parts)
    return None, False


def facts_of(name: str) -> KeyFacts:
    """The facts of a dotted key; a key below a free-form mapping (model.options.depth) has the mapping's.

    A key the schema does not know (one a saved config still holds after it
    left tpustream) has the root's facts.
    """
    key, _ = _nearest(name)
    return ROOT_FACTS if key is None else key.facts


def is_known(name: str) -> bool:
    """Whether a dotted key is the schema's (or lies below one of its free-form mappings)."""
    key, exact = _nearest(name)
    return key is not None and (exact or bool(key.facts.free_form))


def fields_beside(name: str) -> list[str]:
    """The field names of the section a dotted key is in (the top level's for optim, epochs), sorted."""
    section, _, _ = name.rpartition(".")
    prefix, depth = (f"{section}." if section else ""), name.count(".")
    return sorted(
        other.rsplit(".", 1)[-1]
        for other in schema_keys()[1]
        if other.startswith(prefix) and other.count(".") == depth
    )


def keys_where(**facts: Any) -> tuple[str, ...]:
    """The leaf keys whose facts have these values (e.g. resume=OnResume.ignore), in schema order."""
    return tuple(
        key.name
        for key in leaf_keys()
        if all(getattr(key.facts, name) == value for name, value in facts.items())
    )


def key_names_where(*resume: OnResume) -> tuple[str, ...]:
    """The fewest dotted names covering every key whose OnResume is one of `resume`: a whole
    section when all of it is (debug), else its keys (data.num_workers); in schema order."""
    known = schema_keys()[1]
    names: list[str] = []
    for name, key in known.items():
        if key.facts.resume not in resume:
            continue
        if any(name.startswith(f"{outer}.") for outer in names):
            continue
        inside = [k for k in known.values() if k.name.startswith(f"{name}.")]
        if any(k.facts.resume not in resume for k in inside):
            continue  # its keys are named one by one
        names.append(name)
    return tuple(names)


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted key: value}; an empty mapping (model.options: {}) has no keys."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat
