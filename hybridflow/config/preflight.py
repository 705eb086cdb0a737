"""Checks of what a config points at — data files, the custom reward function, scorers for the data, the model —
run by `config validate` and by every command before any model loads (`check_before_run`).

Each problem is one line naming the key, the value and the fix; user code that fails to import becomes a line
too (its exception type and message), never a traceback. Remote (fsspec URL) files are not opened here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.config.loader import ConfigError
from hybridflow.config.schema import Config

VERL_SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
_VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def check_before_run(cfg: Config, *, data: bool = True, reward: bool = True) -> None:
    """Raise `ConfigError` listing every problem `preflight_errors` finds."""
    errors = preflight_errors(cfg, data=data, reward=reward)
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def preflight_errors(cfg: Config, *, data: bool = True, reward: bool = True) -> list[str]:
    """Problems with the model path, the data files (when `data`), the reward sources and their functions (when
    `reward`: RL commands; SFT and RM data need no scorer)."""
    errors = _model_errors(cfg)
    files = _data_files(cfg) if data else []
    errors += [e for e in (_file_error(key, f) for key, f in files) if e]
    if reward:
        errors += _reward_errors(cfg, [f for _, f in files] if not errors else [])
    return errors


# ---------------------------------------------------------------------------------------------------- model
def _model_errors(cfg: Config) -> list[str]:
    from hybridflow.models.loader import resolve_path

    out = []
    for key, path in (("model.path", cfg.model.path), ("model.tokenizer_path", cfg.model.tokenizer_path)):
        if path is None:
            continue
        try:
            p = resolve_path(path, key)
        except ValueError as err:
            out.append(str(err))
            continue
        if not p.exists():
            out.append(f"{key}={path!r} does not exist; give a local model directory or a cached Hugging Face "
                       "model id" + (", or model.path=null to use model.preset" if key == "model.path" else ""))
        elif key == "model.path" and not (p / "config.json").is_file():
            out.append(f"model.path={path!r} has no config.json; give a Hugging Face model directory "
                       "(config.json + *.safetensors)")
    return out


# ----------------------------------------------------------------------------------------------------- data
def _data_files(cfg: Config) -> list[tuple[str, str]]:
    return [(f"data.{name}", str(f)) for name in ("train_files", "val_files") for f in getattr(cfg.data, name)]


def _file_error(key: str, path: str) -> str | None:
    if "://" in path and not path.startswith("file://"):
        return None
    local = Path(path.removeprefix("file://")).expanduser()
    if not local.exists():
        return f"{key}: {path!r} does not exist; fix the path (a parquet file or a directory of *.parquet files)"
    if local.is_dir() and not any(local.glob("*.parquet")):
        return f"{key}: {path!r} is a directory without *.parquet files; point to the files"
    return None


def _data_sources(files: list[str]) -> set[str]:
    """The distinct `data_source` values of local parquet files (only that column is read)."""
    import pyarrow.parquet as pq

    out: set[str] = set()
    for f in files:
        if "://" in f and not f.startswith("file://"):
            continue
        local = Path(f.removeprefix("file://")).expanduser()
        for p in sorted(local.glob("*.parquet")) if local.is_dir() else [local]:
            schema = pq.read_schema(p)
            if "data_source" in schema.names:
                out.update(str(v) for v in pq.read_table(p, columns=["data_source"]).column(0).to_pylist())
            else:
                out.add("unknown")
    return out


# --------------------------------------------------------------------------------------------------- reward
def _reward_errors(cfg: Config, files: list[str]) -> list[str]:
    r = cfg.reward
    names = [s.name for s in r.sources]
    out = []
    if "custom" in names:
        if not r.custom_functions:
            out.append("reward.sources names 'custom' but reward.custom.path is null; set reward.custom.path to a "
                       f".py file defining {VERL_SIGNATURE}")
        listed = isinstance(r.custom, list)
        for i, fn in enumerate(r.custom_functions):
            out += [f"reward.custom[{i}]: {e}" if listed else e for e in custom_function_errors(fn.path, fn.name)]
    from hybridflow.rewards.registry import DATA_SOURCES, REWARD_FUNCTIONS, load_builtin_scorers

    load_builtin_scorers()
    for name in names:
        if name not in ("rule", "custom", "model") and name not in REWARD_FUNCTIONS:
            out.append(f"reward.sources names {name!r}, which is not a registered reward function, 'rule', "
                       f"'custom' or 'model'; registered: {', '.join(REWARD_FUNCTIONS.names())}")
    if "rule" in names and files:
        missing = sorted(ds for ds in _data_sources(files) if DATA_SOURCES.get(ds, ds) not in REWARD_FUNCTIONS)
        if missing:
            out.append(f"reward.sources=[rule] picks a scorer by each row's data_source, and none is known for "
                       f"{missing}; set reward.custom.path to your .py file (its {VERL_SIGNATURE} then scores "
                       "every row) or name a registered function in reward.sources")
    return out


def custom_function_errors(path: str, name: str) -> list[str]:
    """Import `path`, find `name`, check it takes verl's arguments; one line per problem."""
    from hybridflow.rewards.custom import import_function

    try:
        fn = import_function(path, name)
    except ValueError as err:
        return [str(err)]
    problem = signature_problem(fn)
    return [] if problem is None else [f"reward.custom.name={name!r} in {path}: {problem}"]


def signature_problem(fn: Callable[..., Any]) -> str | None:
    """Why `fn` cannot be called as verl calls a reward function (keywords of `_VERL_ARGS` it accepts)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    params = sig.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    accepted = {a: None for a in _VERL_ARGS if a in params}
    if "solution_str" not in accepted:
        return f"its signature {sig} has no 'solution_str' parameter; write it as {VERL_SIGNATURE}"
    try:
        sig.bind(**accepted)
    except TypeError as err:
        return f"its signature {sig} cannot be called with verl's arguments ({err}); write it as {VERL_SIGNATURE}"
    return None
