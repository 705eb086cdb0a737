"""The Python API: a config built in code, reward functions and datasets passed as objects, then `train()`.

Decision: no second trainer. `train()` turns the objects into what the CLI takes — the rows into verl-schema
parquet under `<trainer.run_dir>/data/`, each reward function into a registered reward source — runs the same
pre-flight checks as `hybridflow train`, then calls the same `run_ppo`. A reward function has verl's signature
`(data_source, solution_str, ground_truth, extra_info)` or TRL's `(completions, **columns)` (called per response
with one-element lists: `completions`, `ground_truth`, `data_source` and the row's other columns).

    import hybridflow
    cfg = hybridflow.build_config({"rollout": {"n": 4}}, "trainer.total_training_steps=10")
    history = hybridflow.train(cfg, reward_fns=[my_reward], train_dataset=rows, eval_dataset=val_rows)
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridflow.config import Config, load_config
from hybridflow.config.schema import RewardSourceConfig
from hybridflow.preflight import check_before_run, signature_problem
from hybridflow.trainer.run import run_ppo

RewardFunction = Callable[..., Any]
# Columns of the verl schema; any other column of a row goes into `extra_info` (and to TRL-style functions).
SCHEMA_COLUMNS = ("data_source", "ability", "reward_model", "extra_info")
_API_NAMES: set[str] = set()  # reward sources registered by this module (re-registering them is fine)


def build_config(*layers: Mapping[str, Any] | str | Path) -> Config:
    """A validated `Config`: defaults ← each layer in order — a nested dict shaped like the YAML, a YAML file path,
    or an `a.b=c` override string."""
    files: list[Mapping[str, Any] | str | Path] = []
    overrides: list[str] = []
    for layer in layers:
        if isinstance(layer, str) and "=" in layer:
            overrides.append(layer)
        elif overrides:
            raise ValueError(f"config layer {layer!r} comes after the override {overrides[-1]!r}; give dicts and "
                             "YAML files first, then a.b=c overrides")
        else:
            files.append(layer)
    return load_config(files, overrides)


def train(cfg: Config | Mapping[str, Any] | None = None, *, reward_fns: Sequence[RewardFunction] = (),
          train_dataset: Any = None, eval_dataset: Any = None) -> list[dict[str, float]]:
    """PPO/GRPO as `hybridflow train` runs it; returns the per-step metrics.

    `reward_fns` replace `reward.sources` (weights 1.0, summed, as TRL does); `train_dataset` / `eval_dataset`
    (a `datasets.Dataset`, a pyarrow Table, a pandas DataFrame or a list of dicts) replace `data.train_files` /
    `data.val_files`. A row needs the prompt column (`data.prompt_key`: chat messages or a string) and, for
    reward functions, `ground_truth` (or verl's `reward_model.ground_truth`)."""

    cfg = cfg if isinstance(cfg, Config) else build_config(cfg or {})
    cfg = with_datasets(cfg, train_dataset, eval_dataset)
    if reward_fns:
        cfg = with_reward_fns(cfg, reward_fns)
    check_before_run(cfg)
    return run_ppo(cfg)


# ---------------------------------------------------------------------------------------------------- data
def to_rows(data: Any, name: str = "train_dataset") -> list[dict[str, Any]]:
    """A `datasets.Dataset`, pyarrow Table, pandas DataFrame or sequence of dicts → verl-schema row dicts."""
    if hasattr(data, "to_pylist"):  # pyarrow.Table
        rows = data.to_pylist()
    elif hasattr(data, "to_list"):  # datasets.Dataset
        rows = data.to_list()
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas.DataFrame
        rows = data.to_dict("records")
    elif isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        rows = list(data)
    else:
        raise TypeError(f"{name}: expected a datasets.Dataset, a pyarrow Table, a pandas DataFrame or a list of "
                        f"dicts, got {type(data).__name__}")
    return [_verl_row(row, i, name) for i, row in enumerate(rows)]


def _verl_row(row: Any, i: int, name: str) -> dict[str, Any]:
    if not isinstance(row, Mapping):
        raise TypeError(f"{name} row {i}: expected a dict of columns, got {type(row).__name__}")
    out = dict(row)
    if "ground_truth" in out:
        if "reward_model" in out:
            raise ValueError(f"{name} row {i} has both 'ground_truth' and 'reward_model'; keep one "
                             "(reward_model.ground_truth is verl's spelling)")
        out["reward_model"] = {"style": "rule", "ground_truth": out.pop("ground_truth")}
    return out


def with_datasets(cfg: Config, train_dataset: Any, eval_dataset: Any) -> Config:
    """`cfg` reading the given datasets, written as parquet under `<trainer.run_dir>/data/`."""
    from hybridflow.data.parquet_io import write_rows

    changes: dict[str, Any] = {}
    prompt_key = cfg.data.prompt_key
    for key, data, file in (("train_files", train_dataset, "train"), ("val_files", eval_dataset, "val")):
        if data is None:
            continue
        rows = _with_extra_info(to_rows(data, f"{file}_dataset"), prompt_key)
        if rows and prompt_key not in rows[0]:
            raise ValueError(f"{file}_dataset has no prompt column {prompt_key!r} (data.prompt_key); columns: "
                             f"{sorted(rows[0])}. Rename the column or set data.prompt_key")
        changes[key] = [str(write_rows(rows, Path(cfg.trainer.run_dir) / "data" / f"{file}.parquet"))]
    return cfg if not changes else dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **changes))


def _with_extra_info(rows: list[dict[str, Any]], prompt_key: str) -> list[dict[str, Any]]:
    """Columns outside the verl schema move into `extra_info` (which reward functions receive)."""
    out = []
    for row in rows:
        extra = {k: v for k, v in row.items() if k not in (*SCHEMA_COLUMNS, prompt_key)}
        kept = {k: v for k, v in row.items() if k in (*SCHEMA_COLUMNS, prompt_key)}
        if extra:
            kept["extra_info"] = {**(kept.get("extra_info") or {}), **extra}
        out.append(kept)
    return out


# ------------------------------------------------------------------------------------------------- rewards
def with_reward_fns(cfg: Config, reward_fns: Sequence[RewardFunction]) -> Config:
    """`cfg` whose `reward.sources` are `reward_fns` (each registered in REWARD_FUNCTIONS, weight 1.0)."""
    sources = [RewardSourceConfig(name=register_reward_fn(fn, i), weight=1.0) for i, fn in enumerate(reward_fns)]
    return dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, sources=sources))


def register_reward_fn(fn: RewardFunction, index: int = 0) -> str:
    """Register `fn` (verl or TRL style) as a reward source; returns its name (the function's name when free,
    with several sources its metrics read `reward/<name>/mean`)."""
    from hybridflow.rewards.registry import REWARD_FUNCTIONS, load_builtin_scorers

    if not callable(fn):
        raise TypeError(f"reward_fns[{index}] is a {type(fn).__name__}, not a function")
    load_builtin_scorers()
    name = re.sub(r"\W", "_", getattr(fn, "__name__", "")).strip("_") or f"reward_fn_{index}"
    if name == "lambda" or name in ("rule", "custom", "model") or (name in REWARD_FUNCTIONS and name not in _API_NAMES):
        name = f"reward_fn_{index}_{name}"
    REWARD_FUNCTIONS.register(name, override=True)(as_verl_reward(fn, index))
    _API_NAMES.add(name)
    return name


def as_verl_reward(fn: RewardFunction, index: int = 0) -> RewardFunction:
    """`fn` with verl's signature: itself, or a per-response wrapper of a TRL-style `(completions, **columns)`."""

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    if "completions" not in params:
        problem = signature_problem(fn)
        if problem is not None:
            raise TypeError(f"reward_fns[{index}] ({getattr(fn, '__name__', fn)!r}): {problem}; or TRL's "
                            "(completions, **kwargs) returning one score per completion")
        return fn
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def trl_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> Any:
        columns = {"ground_truth": ground_truth, "data_source": data_source, **(extra_info or {})}
        kwargs = {k: [v] for k, v in columns.items() if takes_all or k in params}
        scores = fn(completions=[solution_str], **kwargs)
        if not isinstance(scores, Sequence) or len(scores) != 1:
            raise TypeError(f"reward function {fn.__name__!r} (TRL style) must return a list of one score per "
                            f"completion; got {scores!r} for 1 completion")
        return scores[0]

    trl_score.__name__ = getattr(fn, "__name__", "trl_reward")
    return trl_score
