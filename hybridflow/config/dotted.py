"""Dotted keys (`actor.optim.lr`) in nested config dicts, and `ConfigError`, which every config check raises: the
bottom of config/, imported by the loader, the cross-section checks and the verl key translation alike."""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A user error in the configuration; the message names the key, the value and the fix."""


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: {part!r} holds a value ({child!r}), not a section")
        node = child
    node[parts[-1]] = value
