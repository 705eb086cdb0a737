"""Checks of what a config points at — data files and their columns, the custom reward function, scorers for the
data, the code sandbox, fsspec backends, the model — run by `config validate` and by every command before any
model loads (`check_before_run`), for one command: `train`, `sft`, `rm` or `dpo` check only what that command uses.

Each problem is one line naming the key, the value and the fix; user code that fails to import becomes a line
too (its exception type and message), never a traceback. Parquet files are read for their schema and row count
(footer metadata), never their rows — except `data_source` for `rule` rewards. Remote (fsspec URL) files are not
opened here; their fsspec backend must be installed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow import sandbox
from hybridflow.config.loader import ConfigError
from hybridflow.config.schema import Config

VERL_SIGNATURE = "compute_score(data_source, solution_str, ground_truth, extra_info=None)"
_VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def check_before_run(cfg: Config, *, command: str = "train", data: bool = True, reward: bool | None = None) -> None:
    """Raise `ConfigError` listing every problem `preflight_errors` finds."""
    errors = preflight_errors(cfg, command=command, data=data, reward=reward)
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def uses_reward(cfg: Config, command: str) -> bool:
    """Whether `command` scores responses with reward.* (RL training and online DPO; SFT/RM/offline DPO do not)."""
    return command == "train" or (command == "dpo" and cfg.dpo.online)


def preflight_errors(cfg: Config, *, command: str = "train", data: bool = True,
                     reward: bool | None = None) -> list[str]:
    """Problems with the model path, the checkpoint mirror, the data files and their columns for `command` (when
    `data`), the reward sources, their functions and the sandbox (when `reward`; default: `uses_reward`)."""
    reward = uses_reward(cfg, command) if reward is None else reward
    errors = _model_errors(cfg) + _mirror_errors(cfg)
    files = _data_files(cfg) if data else []
    file_errors = [e for e in (_file_error(key, f) for key, f in files) if e]
    if data and not file_errors:
        file_errors = _column_errors(cfg, command, reward, files)
    errors += file_errors
    if reward:
        errors += _reward_errors(cfg, [f for _, f in files] if not errors else [])
    return errors


def train_rows(cfg: Config) -> int | None:
    """Rows of the training set: the parquet files' row counts (footer metadata) or `data.train_size`; None when
    a training file is remote (not opened here)."""
    import pyarrow.parquet as pq

    if not cfg.data.train_files:
        return cfg.data.train_size
    if any("://" in str(f) and not str(f).startswith("file://") for f in cfg.data.train_files):
        return None
    return sum(pq.read_metadata(p).num_rows for f in cfg.data.train_files for p in _local_parquets(str(f)))


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
        return _backend_error(key, path)
    local = Path(path.removeprefix("file://")).expanduser()
    if not local.exists():
        return f"{key}: {path!r} does not exist; fix the path (a parquet file or a directory of *.parquet files)"
    if local.is_dir() and not any(local.glob("*.parquet")):
        return f"{key}: {path!r} is a directory without *.parquet files; point to the files"
    return None


def _local_parquets(f: str) -> list[Path]:
    """The local parquet files `f` stands for (a directory: its *.parquet); [] for a remote URL."""
    if "://" in f and not f.startswith("file://"):
        return []
    local = Path(f.removeprefix("file://")).expanduser()
    return sorted(local.glob("*.parquet")) if local.is_dir() else [local]


def _column_errors(cfg: Config, command: str, reward: bool, files: list[tuple[str, str]]) -> list[str]:
    """Each local parquet's columns (its schema only) against what `command` reads."""
    import pyarrow.parquet as pq

    from hybridflow.data.contract import ground_truth_required
    from hybridflow.data.layouts import rl_columns_problem, sft_layout
    from hybridflow.data.preference_columns import resolve_columns

    d = cfg.data
    out = []
    for key, f in files:
        for p in _local_parquets(f):
            try:
                names = pq.read_schema(p).names
            except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
                out.append(f"{key}: {str(p)!r} is not a readable parquet file ({err}); fix or replace it")
                continue
            try:
                if command == "sft":
                    sft_layout(names, d.prompt_key, name=str(p))
                elif command in ("rm", "dpo") and not (command == "dpo" and cfg.dpo.online):
                    resolve_columns(names, d.prompt_key, d.chosen_key, d.rejected_key, name=str(p))
                else:
                    problem = rl_columns_problem(names, d.prompt_key,
                                                 reward and ground_truth_required(d, cfg.reward))
                    if problem:
                        out.append(f"{key}: {str(p)!r}: {problem}")
            except ValueError as err:
                out.append(f"{key}: {err}")
    return out


def _data_sources(files: list[str]) -> set[str]:
    """The distinct `data_source` values of local parquet files (only that column is read)."""
    import pyarrow.parquet as pq

    out: set[str] = set()
    for f in files:
        for p in _local_parquets(f):
            schema = pq.read_schema(p)
            if "data_source" in schema.names:
                out.update(str(v) for v in pq.read_table(p, columns=["data_source"]).column(0).to_pylist())
            else:
                out.add("unknown")
    return out


# ------------------------------------------------------------------------------------------------- fsspec
def _backend_error(key: str, url: str) -> str | None:
    """Why fsspec cannot open `url` here: an unknown protocol or its backend package not installed."""
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        return f"{key}={url!r}: fsspec knows no protocol {protocol!r}; use s3://, gs://, hdfs://, file://, ..."
    except ImportError as err:
        return (f"{key}={url!r}: the fsspec backend for {protocol}:// is not installed ({err}); install it "
                "(e.g. pip install s3fs for s3://, gcsfs for gs://) or use a local path")
    return None


def _mirror_errors(cfg: Config) -> list[str]:
    url = cfg.trainer.default_hdfs_dir
    if not url or "://" not in url:
        return []
    error = _backend_error("trainer.default_hdfs_dir", url)
    return [error] if error else []


# ------------------------------------------------------------------------------------------------ sandbox
def _sandbox_errors(cfg: Config, scorers: set[str]) -> list[str]:
    """A `code` reward needs a working sandbox (bubblewrap or user namespaces) unless unisolated runs are allowed."""
    if "code" not in scorers or cfg.reward.sandbox.allow_unisolated:
        return []

    if any(sandbox.available(mode) for mode in sandbox.ISOLATED_MODES):
        return []
    reasons = "; ".join(f"{m}: {sandbox.unavailable_reason(m)}" for m in sandbox.ISOLATED_MODES)
    return [f"the code reward runs policy programs in a sandbox, and none works here ({reasons}); install "
            "bubblewrap (apt-get install bubblewrap) or allow unprivileged user namespaces, or set "
            "reward.sandbox.allow_unisolated=true to run them with rlimits only (unsafe)"]


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
        if name not in ("rule", "custom", "model", "judge") and name not in REWARD_FUNCTIONS:
            out.append(f"reward.sources names {name!r}, which is not a registered reward function, 'rule', "
                       f"'custom', 'model' or 'judge'; registered: {', '.join(REWARD_FUNCTIONS.names())}")
    judge = Path(r.judge.path or "").expanduser()
    hub_id = not judge.exists() and str(r.judge.path).count("/") == 1  # "org/name": resolved in the local HF cache
    if "judge" in names and not hub_id and not (judge / "config.json").is_file():
        out.append(f"reward.judge.path={r.judge.path!r} is not a local HF model directory (no config.json); point it "
                   "at the judge model's directory")
    scorers = set(names)
    if "rule" in names and files:
        sources = _data_sources(files)
        scorers |= {DATA_SOURCES.get(ds, ds) for ds in sources}
        missing = sorted(ds for ds in sources if DATA_SOURCES.get(ds, ds) not in REWARD_FUNCTIONS)
        if missing:
            out.append(f"reward.sources=[rule] picks a scorer by each row's data_source, and none is known for "
                       f"{missing}; set reward.custom.path to your .py file (its {VERL_SIGNATURE} then scores "
                       "every row) or name a registered function in reward.sources")
    return out + _sandbox_errors(cfg, scorers)


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
