"""A small YAML writer for Kubernetes manifests: dicts, lists, strings, numbers and booleans, block style.

The pod launcher imports only the standard library (it runs where torch and
PyYAML may be missing). JSON would do (kubectl reads it), but a manifest people
read and edit is YAML. Strings are written plain only when YAML 1.1 and 1.2 both
read them back as the same string; anything else is double-quoted with JSON's
escapes, which YAML's double-quoted style shares.
"""

from __future__ import annotations

import json
import re

_PLAIN = re.compile(r"[A-Za-z_/][A-Za-z0-9_./-]*\Z")
# Plain words YAML 1.1 reads as booleans or null (kubectl's parser is YAML 1.1-ish).
_SPECIAL = {"y", "n", "yes", "no", "true", "false", "on", "off", "null", "~"}


def scalar(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    if value is None:
        return "null"
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in _SPECIAL:
        return text
    return json.dumps(text, ensure_ascii=False)


def _lines(value: object, indent: int) -> list[str]:
    pad = " " * indent
    if isinstance(value, dict):
        lines = []
        for key, item in value.items():
            head = f"{pad}{scalar(key)}:"
            if isinstance(item, dict | list) and item:
                lines.append(head)
                lines += _lines(item, indent + 2)
            else:
                lines.append(f"{head} {_inline(item)}")
        return lines
    if isinstance(value, list):
        lines = []
        for item in value:
            if isinstance(item, dict | list) and item:
                nested = _lines(item, indent + 2)
                # The first line of the item shares the dash: "- key: value".
                lines.append(f"{pad}- {nested[0].lstrip()}")
                lines += nested[1:]
            else:
                lines.append(f"{pad}- {_inline(item)}")
        return lines
    return [pad + scalar(value)]


def _inline(value: object) -> str:
    if isinstance(value, dict):
        return "{}"
    if isinstance(value, list):
        return "[]"
    return scalar(value)


def to_yaml(document: dict) -> str:
    """One YAML document, ending with a newline."""
    return "\n".join(_lines(document, 0)) + "\n"
