"""Per-token policy versions for partial rollouts (`trainer.async.partial_rollout=continue`).

A generate call may see new weights between two decode chunks (the scheduler's host checks, every `check_every`
steps). `TokenVersions` asks its `check` callable for the version in effect at each check — the callable is where
the rollout worker applies weights that arrived meanwhile — and records, per KV slot, the token index from which
each version sampled: a slot whose next token is index k when version v arrives gets the span (k, v). Token k's
version is that of the weights whose logits it was sampled from (its `rollout_log_probs` entry comes from the same
logits). The K/V of the tokens before a swap stay as the older weights computed them (no recomputation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from hybridflow.rollout.model_runner import ModelRunner


class TokenVersions:
    def __init__(self, check: Callable[[], int], rows: int, width: int) -> None:
        self.check = check
        self.current = int(check())  # applies weights that arrived before the call started
        self.first = self.current
        self.swaps = 0
        self.out = torch.full((rows, width), self.current, dtype=torch.long)
        self._spans: dict[int, list[tuple[int, int]]] = {}  # slot -> [(first token index, version)]

    def admit(self, slots: Iterable[int]) -> None:
        for s in slots:
            self._spans[s] = [(0, self.current)]

    def poll(self, runner: ModelRunner, in_flight: Iterable[int]) -> None:
        """Between decode chunks: take new weights if any arrived; the slots in flight switch at their next token."""
        version = int(self.check())
        if version == self.current:
            return
        if version < self.current:
            raise RuntimeError(f"rollout weights went from policy version {self.current} back to {version} during a "
                               "generate call; versions must not decrease (the driver labels re-sent weights, "
                               "e.g. after a rollback, with the current step)")
        slots = list(in_flight)
        if slots:
            steps = runner.resp_len[torch.tensor(slots, dtype=torch.long, device=runner.device)].tolist()
            for s, k in zip(slots, steps):
                self._spans[s].append((int(k), version))
        self.current = version
        self.swaps += 1

    def finish(self, slot: int, row: int) -> None:
        """The slot's sequence is done: write its per-token versions into output row `row`."""
        for start, version in self._spans.pop(slot):
            self.out[row, start:] = version
