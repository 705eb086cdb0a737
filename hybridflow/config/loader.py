"""Load the configuration: defaults.yaml <- user YAML files <- dotted `a.b.c=value` overrides.

`algorithm.preset` (hybridflow/config/presets.py) inserts its overrides just before the layer (file or command
line) that names it, so that layer and later ones win over the preset.

The merged plain dict is type-checked while it is turned into the frozen `Config` dataclasses; unknown keys fail
with a "did you mean" suggestion and the full key path. `${a.b}` inside strings refers to another value.
verl's key names (`actor_rollout_ref.rollout.n`, ...) are rewritten to ours per layer (`verl_keys.py`). YAML is
bounded before anything walks it: a file's size, and the size of its tree with every alias expanded (an alias bomb
is a few lines that expand to billions of nodes).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import keyword
import logging
import re
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from hybridflow.config.auto_sizes import resolve_auto_sizes
from hybridflow.config.dotted import ConfigError, set_dotted
from hybridflow.config.lr_rule import resolve_lr
from hybridflow.config.presets import preset_overrides
from hybridflow.config.schema import Config
from hybridflow.config.validate import validate_config
from hybridflow.config.verl_keys import VerlKeyError, translate_layer, translate_overrides

logger = logging.getLogger(__name__)

DEFAULTS_PATH = Path(__file__).with_name("defaults.yaml")
_REF = re.compile(r"\$\{([a-zA-Z0-9_.]+)\}")
MAX_YAML_BYTES = 4 << 20  # a config file is a few KB; data belongs in parquet
MAX_YAML_NODES = 200_000  # values in a document with its aliases expanded (defaults.yaml: ~500)

# Keys that were removed: an old config (e.g. a run directory's config.yaml) still loads, with a warning and the fix.
REMOVED_KEYS: dict[str, str] = {
    "rollout.block_size": "the rollout KV cache is per-slot static buffers, not paged blocks, so it never had an "
                          "effect",
    "trainer.rollback.patience": "rollback acts on the health monitor's val_drop warning: set "
                                 "trainer.health.val_drop_patience",
}


def load_config(files: Iterable[str | Path | Mapping[str, Any]] = (), overrides: Iterable[str] = (),
                validate: bool = True, command: str = "train") -> Config:
    """Build the typed config from defaults, YAML files or nested dicts shaped like one (in order, later wins)
    and `a.b=c` overrides (last wins); `validate` checks what `command` (train|sft|rm|dpo) uses."""
    merged = resolve_lr(resolve_auto_sizes(merge_sources(files, overrides)))
    cfg = build(Config, merged, "")
    if validate:
        validate_config(cfg, command)
    return cfg


def merge_sources(files: Iterable[str | Path | Mapping[str, Any]] = (), overrides: Iterable[str] = ()
                  ) -> dict[str, Any]:
    """The config as a dict — defaults, files, overrides — before `auto` sizes and the LR rule are resolved."""
    merged = load_defaults_dict()
    for f in files:
        source = "a dict layer" if isinstance(f, Mapping) else str(f)
        layer = _from_verl(dict(f) if isinstance(f, Mapping) else read_yaml(Path(f)), source)
        section = layer.get("algorithm")
        merged = merge(_with_preset(merged, section.get("preset") if isinstance(section, Mapping) else None), layer,
                       source=source)
    parsed = _verl_overrides([parse_override(item) for item in overrides])
    presets = [value for key, value in parsed if key == "algorithm.preset"]
    if presets:
        merged = _with_preset(merged, presets[-1])
    for key, value in parsed:
        set_dotted(merged, key, value)
    merged = interpolate(merged)
    warn_uncorrected_fp8(merged)
    return merged


def warn_uncorrected_fp8(merged: dict[str, Any]) -> None:
    """Warn when `rollout.quantization=fp8` comes with `algorithm.rollout_is.mode=null` set explicitly. (`auto`, the
    default, stays in the config: `config/resolved.py:rollout_is` decides it, tis with fp8.)"""
    section = merged.get("algorithm", {}).get("rollout_is")
    if not isinstance(section, dict):
        return
    if merged.get("rollout", {}).get("quantization") == "fp8" and section.get("mode", "auto") is None:
        logger.warning("rollout.quantization=fp8 with algorithm.rollout_is.mode=null: the policy gradient is not "
                       "corrected for the fp8 rollout's mismatch with the trainer (rollout_is/* not logged); "
                       "leave the mode at auto (tis) to correct it")


def _from_verl(layer: dict[str, Any], source: str) -> dict[str, Any]:
    try:
        return translate_layer(layer)
    except VerlKeyError as err:
        raise ConfigError(f"{source}: {err}") from None


def _verl_overrides(parsed: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    try:
        return translate_overrides(parsed)
    except VerlKeyError as err:
        raise ConfigError(str(err)) from None


def _with_preset(merged: dict[str, Any], name: Any) -> dict[str, Any]:
    """`merged` with preset `name`'s overrides applied (unchanged for null)."""
    if name is None:
        return merged

    try:
        items = preset_overrides(str(name))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    out = copy.deepcopy(merged)
    for item in items:
        set_dotted(out, *parse_override(item))
    return out


def load_defaults_dict() -> dict[str, Any]:
    return read_yaml(DEFAULTS_PATH)


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML config file as a dict; size and alias expansion bounded (`check_yaml_size`)."""
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    size = path.stat().st_size
    if size > MAX_YAML_BYTES:
        raise ConfigError(f"config file {str(path)!r} is {size / 2**20:.1f} MiB, over the {MAX_YAML_BYTES >> 20} MiB "
                          "a config may have; is it a data file? Give data as parquet in data.train_files")
    with path.open() as fh:
        try:
            data = yaml.safe_load(fh) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from None
    check_yaml_size(data, f"config file {str(path)!r}")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def check_yaml_size(data: Any, source: str) -> None:
    """Raise ConfigError when `data` has more than MAX_YAML_NODES values with its aliases expanded (YAML aliases
    load as shared references, which every later walk — merge, interpolation, typing — visits again). Stops
    counting at the bound, so a bomb fails in milliseconds."""
    count, stack = 0, [data]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_YAML_NODES:
            raise ConfigError(f"{source} expands to more than {MAX_YAML_NODES:,} values (YAML aliases — `*name` — "
                              "repeat what they refer to, and nested ones multiply); a config is a few hundred "
                              "values: remove the nested aliases")
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def merge(base: dict[str, Any], update: Mapping[str, Any], source: str = "", prefix: str = "") -> dict[str, Any]:
    """Recursive dict merge; mappings merge, everything else (lists included) replaces."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value, source, f"{prefix}{key}.")
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=c` → ("a.b", parsed c): ints, floats (1e-6 too), true/false, null, [lists], {maps}, else strings."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value (e.g. trainer.nnodes=2)")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("+")
    if not key or not re.fullmatch(r"[A-Za-z0-9_.\-]+", key):
        raise ConfigError(f"override {item!r}: {key!r} is not a dotted key path")
    return key, parse_value(raw)


def parse_value(raw: str) -> Any:
    raw = raw.strip()
    if raw.lower() in ("none", "null", "~"):
        return None
    if len(raw) > MAX_YAML_BYTES:
        raise ConfigError(f"override value of {len(raw)} characters is over the {MAX_YAML_BYTES >> 20} MiB a config "
                          "value may have")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    check_yaml_size(value, f"override value {raw[:40]!r}")
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads 1e-6 as a string
        except ValueError:
            return value
    return value


def get_dotted(tree: Mapping[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise ConfigError(f"${{{key}}} refers to a key that does not exist")
        node = node[part]
    return node


def interpolate(tree: dict[str, Any]) -> dict[str, Any]:
    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, str):
            for _ in range(10):  # nested references resolve in a few rounds
                new = _REF.sub(lambda m: str(get_dotted(tree, m.group(1))), node)
                if new == node:
                    break
                node = new
        return node

    return walk(tree)


# ------------------------------------------------------------------------------------------- typed construction
def build(cls: type, data: Any, path: str) -> Any:
    """Turn a plain dict into dataclass `cls`, checking every key and type; errors carry the dotted path."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {config_key(f.name): f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            full = f"{path}.{key}" if path else str(key)
            if full in REMOVED_KEYS:
                logger.warning("config key '%s' was removed and is ignored (%s); delete it from your config",
                               full, REMOVED_KEYS[full])
                continue
            match = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f" Did you mean '{path + '.' if path else ''}{match[0]}'?" if match else ""
            raise ConfigError(f"unknown config key '{full}'.{hint} Valid keys here: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        full = f"{path}.{name}" if path else name
        if name not in data:
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                continue
            raise ConfigError(f"missing config key '{full}' (add it to defaults.yaml or your config file)")
        kwargs[f.name] = _coerce(hints[f.name], data[name], full)
    try:
        return cls(**kwargs)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from None


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        errors = []
        for a in inner:
            try:
                return _coerce(a, value, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}={value!r}: " + "; ".join(errors))
    if value is None:
        raise ConfigError(f"{path}=null: a value is required here ({_type_name(tp)})")
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if origin is list:
        if isinstance(value, str) and args and args[0] is str:  # one file or name, e.g. verl's data.train_files=a.parquet
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}={value!r}: expected a list ({_type_name(tp)}), e.g. {path}=[a,b]")
        return [_coerce(args[0] if args else Any, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}={value!r}: expected a mapping")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path}={value!r}: expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}={value!r}: expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}={value!r}: expected a string")
    raise ConfigError(f"{path}: unsupported type {tp!r} in the schema")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def config_key(field_name: str) -> str:
    """The YAML key of a dataclass field: a Python keyword is spelled with a trailing underscore in Python
    (`trainer.async` is the field `async_`) and without it in the config."""
    stem = field_name[:-1]
    return stem if field_name.endswith("_") and keyword.iskeyword(stem) else field_name


def to_dict(cfg: Config) -> dict[str, Any]:
    return _config_keys(dataclasses.asdict(cfg))


def _config_keys(node: Any) -> Any:
    if isinstance(node, dict):
        return {config_key(k) if isinstance(k, str) else k: _config_keys(v) for k, v in node.items()}
    return node


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=False, width=110)
