"""`ResourcePool`: how many worker processes a group gets on each node, and how many groups may share a GPU.

The pool is plain data plus the backend's allocation for it (Ray placement groups), created on first use and
kept until `release()`, so several worker groups can be placed on the same pool (up to `max_colocate_count`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.config import Config

logger = logging.getLogger(__name__)


@dataclass
class ResourcePool:
    """`process_on_nodes[i]` worker processes (one per GPU, or per CPU slot without GPUs) on node i.

    `use_gpu=None` means "GPUs if the backend finds any". `max_colocate_count` groups may share each slot:
    every actor asks for 1/max_colocate_count of a GPU.
    """

    process_on_nodes: list[int]
    max_colocate_count: int = 1
    use_gpu: bool | None = None
    name: str = "global_pool"
    _backend_state: dict[str, Any] = field(default_factory=dict, init=False, repr=False)
    _releasers: list[Callable[[], None]] = field(default_factory=list, init=False, repr=False)
    groups_placed: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.process_on_nodes = list(self.process_on_nodes)
        if not self.process_on_nodes or any(not isinstance(n, int) or n < 1 for n in self.process_on_nodes):
            raise ValueError(f"ResourcePool {self.name!r}: process_on_nodes={self.process_on_nodes} must be a "
                             f"non-empty list of positive ints (processes per node), e.g. [8, 8] for 2 nodes")
        if self.max_colocate_count < 1:
            raise ValueError(f"ResourcePool {self.name!r}: max_colocate_count={self.max_colocate_count} must be >= 1")

    @property
    def world_size(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def nnodes(self) -> int:
        return len(self.process_on_nodes)

    @classmethod
    def from_config(cls, cfg: Config, name: str = "global_pool") -> ResourcePool:
        """The pool `trainer.nnodes × n_gpus_per_node` (or `resource_pool.process_on_nodes`) describes."""
        nodes = cfg.resource_pool.process_on_nodes or [cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes
        use_gpu = {"cpu": False, "cuda": True}.get(cfg.trainer.device)
        return cls(list(nodes), cfg.resource_pool.max_colocate_count, use_gpu, name)

    def on_release(self, fn: Callable[[], None]) -> None:
        """Backends register how to free what they allocated for this pool."""
        self._releasers.append(fn)

    def release(self) -> None:
        """Free the backend's allocation (Ray placement groups). Groups placed on it must be shut down first."""
        while self._releasers:
            self._releasers.pop()()
        self._backend_state.clear()
        self.groups_placed = 0

    def __enter__(self) -> ResourcePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
