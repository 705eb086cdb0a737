"""hybridflow: RL post-training for LLMs in the HybridFlow single-controller style.

`hybridflow.train(...)` and `hybridflow.build_config(...)` are the Python API (`hybridflow.api`), imported on first use
so that `import hybridflow` (and the CLI's start-up) stays light.
"""

from typing import Any

from hybridflow.version import __version__

__all__ = ["__version__", "build_config", "train"]


def __getattr__(name: str) -> Any:
    if name in ("build_config", "train"):
        from hybridflow import api

        return getattr(api, name)
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
