"""Resolve a scorer from a picklable spec: ("fn", registered name) or ("file", path, function name).

Functions loaded from user files cannot be pickled by reference, so the reward worker processes receive the spec
and load (and cache) the function themselves. Custom functions keep verl's signature
`compute_score(data_source, solution_str, ground_truth, extra_info)`; keyword arguments the function does not
accept (e.g. an old function without `extra_info`) are left out.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridflow.rewards.registry import get_reward_fn

Spec = tuple[str, ...]
_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
_CACHE: dict[Spec, Callable[..., Any]] = {}


def load_custom_fn(path: str, name: str) -> Callable[..., Any]:
    """Import `path` as a module and return its function `name`, called with verl's keywords."""
    return _adapt(import_function(path, name))


def import_function(path: str, name: str) -> Callable[..., Any]:
    """Import `path` as a module and return its function `name` (ValueError naming the fix otherwise; an error
    raised while importing the file becomes one line with its type and message)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"reward.custom.path={path!r} is not a file; point it to a .py file defining {name}()")
    module_name = f"hybridflow_custom_reward_{hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"reward.custom.path={path!r} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # user code: any error is reported as one line naming the file
        where = f" (line {err.lineno})" if isinstance(err, SyntaxError) else ""
        raise ValueError(f"reward.custom.path={path!r} failed to import{where}: {type(err).__name__}: {err}; "
                         "fix the file (run `python FILE` to see the traceback)") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"reward.custom.name={name!r} is not a function in {path}; functions there: {found}; "
                         "set reward.custom.name to one of them")
    return fn


def _adapt(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Call with keywords, passing only those the function accepts (all of them when it takes **kwargs)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn
    accepted = [a for a in _ARGS if a in params]
    if accepted == list(_ARGS):
        return fn

    def call(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        values = dict(zip(_ARGS, (data_source, solution_str, ground_truth, extra_info)))
        return fn(**{a: values[a] for a in accepted})

    return call


def resolve(spec: Spec) -> Callable[..., Any]:
    """The function a spec names (cached per process)."""
    fn = _CACHE.get(spec)
    if fn is None:
        if spec[0] == "fn":
            fn = get_reward_fn(spec[1])
        elif spec[0] == "file":
            fn = load_custom_fn(spec[1], spec[2])
        else:
            raise ValueError(f"unknown scorer spec {spec!r}")
        _CACHE[spec] = fn
    return fn
