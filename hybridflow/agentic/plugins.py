"""Loading user classes from the agentic YAML configs (tools, interactions): `class_name` is a built-in name or a
dotted path; each file holds one top-level list of entries. Errors name the file, the entry and the fix."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml


def import_class(path: str, where: str, builtins: dict[str, type], base: type, kind: str) -> type:
    """The class `path` names: a key of `builtins` or an importable 'package.module.ClassName' subclassing `base`."""
    if path in builtins:
        return builtins[path]
    module_name, _, cls_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{where}: class_name={path!r} is neither a built-in {kind} ({', '.join(builtins)}) "
                         "nor a dotted path 'package.module.ClassName'")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{where}: cannot import class_name={path!r} ({err}); give an importable "
                         "'package.module.ClassName' (is the package on PYTHONPATH?)") from None
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise ValueError(f"{where}: class_name={path!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls


def yaml_entries(path: str | Path, key: str, list_key: str, allowed: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    """(where, entry) for each entry of the top-level `list_key:` list in the YAML at `path` (the value of config
    key `key`); every entry is a mapping with `class_name` and only `allowed` keys."""
    p = Path(path)
    article = "an" if list_key[0] in "aeiou" else "a"
    if not p.is_file():
        raise ValueError(f"{key}={str(path)!r}: no such file; point it at a YAML with {article} `{list_key}:` list")
    doc = yaml.safe_load(p.read_text()) or {}
    entries = doc.get(list_key) if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        shown = ", ".join(k for k in allowed if k != "tool_schema")
        raise ValueError(f"{key}={str(path)!r}: expected a top-level `{list_key}:` list of {{{shown}}} entries")
    out = []
    for i, entry in enumerate(entries):
        where = f"{path} {list_key}[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ValueError(f"{where}: each entry needs `class_name` (a built-in name or a dotted class path)")
        unknown = set(entry) - set(allowed)
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; allowed: {', '.join(allowed)}")
        out.append((where, entry))
    return out
