"""Every config key a message names is a real key: a hint that sends the user to `rollout.response_length` (no such
key; it is `data.max_response_length`) costs them a search. Scans every string literal in hybridflow/ (docstrings
too) for `<section>.<key>` and resolves it in defaults.yaml."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import hybridflow
from hybridflow.config.loader import REMOVED_KEYS, load_defaults_dict
from hybridflow.config.verl_keys import NO_EQUIVALENT, VERL_KEYS

ROOT = Path(hybridflow.__file__).parent
# Dotted names that share a section's spelling but are not config keys.
NOT_KEYS = {
    "model.base_model.layers",  # the decoder-layer attribute path of a transformers model
    "model.safetensors", "extra.json", "data.json",  # file names
}


def _named_keys() -> list[tuple[str, int, str]]:
    defaults = load_defaults_dict()
    sections = "|".join(sorted(defaults, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w./`])(?:{sections})\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?!\w*\()")
    found = []
    for file in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found += [(str(file.relative_to(ROOT)), node.lineno, m.group(0)) for m in pattern.finditer(node.value)]
    return found


def _is_verl_key(dotted: str) -> bool:
    """verl's names, which the verl key table (config/verl_keys.py) spells out, or a section of them."""
    return any(k == dotted or k.startswith(dotted + ".") for k in (*VERL_KEYS, *NO_EQUIVALENT))


def _is_key(dotted: str, tree: dict) -> bool:
    node = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_every_key_named_in_a_message_exists():
    defaults = load_defaults_dict()
    named = _named_keys()
    assert len(named) > 100  # the scan finds the keys messages name
    wrong = [(f, line, key) for f, line, key in named
             if key not in NOT_KEYS and key not in REMOVED_KEYS and not _is_key(key, defaults)
             and not _is_verl_key(key)]
    assert wrong == [], f"messages name keys that do not exist: {wrong}"
