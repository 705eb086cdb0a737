"""`RewardManager`: responses in a DataProto → token-level rewards (the sequence reward on the last response token).

Sources are mixed by weight (`reward.sources`): `rule` (the scorer chosen by each row's data_source), `custom`
(`reward.custom`: one function `path` + `name`, or a list of them, each a source named after it, weighted by the
custom source's weight times its own), `model` (precomputed `rm_scores` [B] or [B, R] in the batch, from the reward
model worker), `judge` (an LLM judge's parsed verdict, `reward.judge`: rewards/judge.py) or any REWARD_FUNCTIONS
name. `reward.reward_model.score_norm=running` whitens the RM scores by the
running mean/std of the training batches and `score_clip` bounds them: an RM's scale is arbitrary, and a response
it over-rates must not outweigh the other sources. Scorers run in a `ScoringPool` kept alive between calls; a
scorer that raises, times out, or returns NaN or a non-number (a reward is an int/float, or a dict with a numeric
`score`) gets `reward.error_score` and is counted in `reward/errors` / `reward/timeouts` — training never stops
for it; each kind of failure is logged once per data_source.
Length and DAPO overlong penalties are added after mixing. A scorer's numeric extras (dict keys besides `score`)
are averaged into `reward/<source>/<key>` (validation: `val/<source>/<key>`); a None entry is left out of the mean.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridflow.protocol import DataProto, keys
from hybridflow.rewards.custom import Spec, resolve
from hybridflow.rewards.judge import JudgeFn
from hybridflow.rewards.penalties import length_penalty, overlong_penalty
from hybridflow.rewards.pool import InlineScorer, Item, ItemResult, ScoringPool
from hybridflow.rewards.registry import reward_fn_name
from hybridflow.sandbox import configure as configure_sandbox
from hybridflow.sandbox import select_mode as select_sandbox_mode
from hybridflow.utils.tokenizer_protocol import Tokenizer

if TYPE_CHECKING:
    from hybridflow.config.schema import RewardConfig

logger = logging.getLogger(__name__)

MODEL_SOURCE = "model"
JUDGE_SOURCE = "judge"


@dataclass
class RewardOutput:
    """Everything one scoring call produced. Arrays are per row ([B])."""

    token_level_scores: torch.Tensor  # [B, R] float32, the final reward on the last valid response token
    scores: np.ndarray  # final sequence reward (mixed + penalties)
    raw_scores: np.ndarray  # mixed score before penalties (validation accuracy for 0/1 scorers)
    source_scores: dict[str, np.ndarray]  # per source, before weighting
    data_sources: np.ndarray
    row_status: np.ndarray  # "ok" | "error" | "timeout": a row whose reward function failed scored error_score
    extras: dict[str, np.ndarray] = field(default_factory=dict)  # "<source>/<key>" from scorers returning dicts
    metrics: dict[str, float] = field(default_factory=dict)


def extras_means(extras: dict[str, np.ndarray]) -> dict[str, float]:
    """"<source>/<key>" → the mean of that extra over the rows where it is a finite number (a bool counts as 0/1;
    None, strings and NaN are left out; a key with no number gets no entry)."""
    out = {}
    for key, column in sorted(extras.items()):
        values = [float(v) for v in column if isinstance(v, numbers.Real) and math.isfinite(v)]
        if values:
            out[key] = float(np.mean(values))
    return out


class RunningMoments:
    """Count, mean and variance of every value seen (Chan et al.'s parallel update: exact for any batch split)."""

    def __init__(self) -> None:
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: np.ndarray) -> None:
        n = len(values)
        if n == 0:
            return
        mean, m2 = float(values.mean()), float(((values - values.mean()) ** 2).sum())
        delta, total = mean - self.mean, self.count + n
        self.mean += delta * n / total
        self.m2 += m2 + delta**2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count > 1 else 1.0


def last_token_index(mask_BR: torch.Tensor) -> torch.Tensor:
    """Index of the last 1 in each row (0 for an all-zero row)."""
    positions = torch.arange(mask_BR.shape[1], device=mask_BR.device).expand_as(mask_BR)
    return (positions * (mask_BR > 0)).amax(dim=1)


def custom_sources(reward_cfg: RewardConfig) -> list[tuple[str, float, Spec]]:
    """(source name, weight, spec) of each `reward.custom` function: the single form is the source `custom`; a
    list's functions are sources named after them (metrics `reward/<name>/mean`, as `hybridflow.train`'s)."""
    functions = reward_cfg.custom_functions
    if not functions:
        raise ValueError("reward.sources names 'custom' but reward.custom.path is null; set it to a .py file "
                         "defining compute_score(data_source, solution_str, ground_truth, extra_info)")
    if not isinstance(reward_cfg.custom, list):
        fn = functions[0]
        return [("custom", float(fn.weight), ("file", fn.path, fn.name))]
    return [(fn.name, float(fn.weight), ("file", fn.path, fn.name)) for fn in functions]


class RewardManager:
    """`manager(batch) -> (token_level_scores [B, R], metrics)`; `manager.score(batch)` → `RewardOutput` with
    per-row arrays (what validation needs). Call `close()` (or use as a context manager) to stop the pool."""

    def __init__(self, reward_cfg: RewardConfig, tokenizer: Tokenizer, max_response_length: int,
                 judge: JudgeFn | None = None) -> None:
        self.cfg = reward_cfg
        self.tokenizer = tokenizer
        self.max_response_length = max_response_length
        self.sources: list[tuple[str, float]] = []  # (name, weight): `custom` expanded into its functions
        self._fixed_specs: dict[str, Spec] = {}
        for source in reward_cfg.sources:
            if source.name == "custom":
                for name, weight, spec in custom_sources(reward_cfg):
                    self.sources.append((name, float(source.weight) * weight))
                    self._fixed_specs[name] = spec
                continue
            self.sources.append((source.name, float(source.weight)))
            if source.name not in ("rule", MODEL_SOURCE, JUDGE_SOURCE):
                self._fixed_specs[source.name] = ("fn", source.name)
        for spec in self._fixed_specs.values():
            resolve(spec)  # fail now with the fix, and forked workers inherit the loaded function (no cold start)
        configure_sandbox(reward_cfg.sandbox)  # before the pool forks: workers inherit the caps
        self._check_sandbox(self._fixed_specs.values())
        if reward_cfg.overlong_buffer.enable:
            overlong_penalty(np.zeros(1), max_response_length, reward_cfg.overlong_buffer.len, 1.0)  # validates
        n = reward_cfg.num_workers
        self._scorer = ScoringPool(n, reward_cfg.timeout_s) if n > 0 else InlineScorer(reward_cfg.timeout_s)
        self._logged_failures: set[tuple[str, str]] = set()  # (data_source, kind) already logged
        self._rm_moments = RunningMoments() if reward_cfg.reward_model.score_norm == "running" else None
        self.judge = judge  # trainer/judge.py: build_judge(reward_cfg)
        if judge is None and any(n == JUDGE_SOURCE for n, _ in self.sources):
            raise ValueError("reward.sources names 'judge' but no judge model was given: build the RewardManager "
                             "with judge=hybridflow.trainer.judge.build_judge(cfg.reward)")
        self.total_errors = 0
        self.total_timeouts = 0

    # --------------------------------------------------------------------------------------------- public
    def __call__(self, batch: DataProto) -> tuple[torch.Tensor, dict[str, float]]:
        """The training path: RM running statistics (score_norm=running) are updated with this batch first."""
        out = self.score(batch, update_stats=True)
        return out.token_level_scores, out.metrics

    def score(self, batch: DataProto, update_stats: bool = False) -> RewardOutput:
        responses = batch.batch[keys.RESPONSES]
        if responses.shape[0] == 0:
            raise ValueError("RewardManager.score got an empty batch (0 responses)")
        mask = self._response_mask(batch)
        last = last_token_index(mask)
        n = responses.shape[0]
        data_sources = batch.non_tensor_batch.get(keys.DATA_SOURCE, np.array(["unknown"] * n, dtype=object))
        solutions = self._decode(responses, last, mask)
        source_scores: dict[str, np.ndarray] = {}
        extras: dict[str, np.ndarray] = {}
        metrics: dict[str, float] = {}
        status = np.array(["ok"] * n, dtype=object)
        if any(name not in (MODEL_SOURCE, JUDGE_SOURCE) for name, _ in self.sources):
            fn_scores, extras, metrics, status = self._run_functions(batch, solutions, data_sources)
            source_scores.update(fn_scores)
        if any(name == MODEL_SOURCE for name, _ in self.sources):
            source_scores[MODEL_SOURCE] = self._model_scores(batch, update_stats, metrics)
        if self.judge is not None:
            source_scores[JUDGE_SOURCE] = self._judge_scores(batch, solutions, metrics)
        raw = sum(w * source_scores[name] for name, w in self.sources)
        lengths = mask.sum(-1).cpu().numpy()
        final = raw + self._penalties(lengths, metrics)
        token_scores = torch.zeros(responses.shape, dtype=torch.float32)
        token_scores[torch.arange(n), last.cpu()] = torch.as_tensor(final, dtype=torch.float32)
        metrics.update(self._summary(raw, source_scores, data_sources, extras))
        return RewardOutput(token_scores.to(responses.device), final, raw, source_scores, data_sources, status,
                            extras, metrics)

    def check_data_sources(self, data_sources: Iterable[str]) -> None:
        """Raise now (e.g. at trainer start-up) if a `rule` source has no scorer for one of these data sources."""
        if any(name == "rule" for name, _ in self.sources):
            self._check_sandbox([("fn", reward_fn_name(ds)) for ds in set(data_sources)])

    def close(self) -> None:
        self._scorer.close()
        if self.judge is not None:
            self.judge.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------------------------------------- helpers
    @staticmethod
    def _check_sandbox(specs: Iterable[Spec]) -> None:
        """Code rewards need a sandbox: pick it (probed once) or raise the one-line refusal here, in the driver."""
        if any(spec == ("fn", "code") for spec in specs):
            select_sandbox_mode()

    def _response_mask(self, batch: DataProto) -> torch.Tensor:
        if keys.RESPONSE_MASK in batch.batch:
            return batch.batch[keys.RESPONSE_MASK]
        r = batch.batch[keys.RESPONSES].shape[1]
        if keys.ATTENTION_MASK in batch.batch:
            return batch.batch[keys.ATTENTION_MASK][:, -r:]
        return torch.ones_like(batch.batch[keys.RESPONSES])

    def _decode(self, responses: torch.Tensor, last: torch.Tensor, mask: torch.Tensor) -> list[str]:
        valid = mask.sum(-1) > 0
        rows, ends = responses.cpu().tolist(), (last + 1).mul(valid).tolist()
        ids = [row[:k] for row, k in zip(rows, ends)]
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(self.tokenizer, "clean_up_tokenization_spaces", False):
            # Same text as batch_decode without its per-token Python type checks (10x faster on 4k responses);
            # one call per row: decode_batch's thread pool would make every later fork warn and disable it.
            return [backend.decode(row, skip_special_tokens=True) for row in ids]
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def _run_functions(self, batch: DataProto, solutions: list[str], data_sources: np.ndarray
                       ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, float], np.ndarray]:
        """Scores, extras and failure metrics of every function source, and each row's status (its worst)."""
        n = len(solutions)
        reward_model = batch.non_tensor_batch.get(keys.REWARD_MODEL, np.array([None] * n, dtype=object))
        extra_info = batch.non_tensor_batch.get(keys.EXTRA_INFO, np.array([None] * n, dtype=object))
        truths = [rm.get("ground_truth") if isinstance(rm, dict) else None for rm in reward_model]
        names = [name for name, _ in self.sources if name not in (MODEL_SOURCE, JUDGE_SOURCE)]
        rule_specs = {ds: ("fn", reward_fn_name(ds)) for ds in set(data_sources)} if "rule" in names else {}
        self._check_sandbox(rule_specs.values())
        items: list[Item] = []
        for name in names:
            for i in range(n):
                spec = rule_specs[data_sources[i]] if name == "rule" else self._fixed_specs[name]
                items.append((spec, str(data_sources[i]), solutions[i], truths[i], extra_info[i]))
        results = self._scorer.run(items)
        scores, extras = {}, {}
        status = np.array(["ok"] * n, dtype=object)
        for k, name in enumerate(names):
            chunk = results[k * n:(k + 1) * n]
            scores[name] = np.array([r.score if r.status == "ok" else self.cfg.error_score for r in chunk])
            for i, r in enumerate(chunk):
                if r.status != "ok" and status[i] != "error":
                    status[i] = r.status
            for key in sorted({key for r in chunk for key in r.extras}):
                extras[f"{name}/{key}"] = np.array([r.extras.get(key) for r in chunk], dtype=object)
        return scores, extras, self._failures(results, items), status

    def _failures(self, results: list[ItemResult], items: list[Item]) -> dict[str, float]:
        """Count errors and timeouts; log each (data_source, kind of failure) once, with its details."""
        errors = sum(r.status == "error" for r in results)
        timeouts = sum(r.status == "timeout" for r in results)
        self.total_errors += errors
        self.total_timeouts += timeouts
        for r, item in zip(results, items):
            key = (item[1], r.kind or r.status)
            if r.status == "ok" or key in self._logged_failures:
                continue
            self._logged_failures.add(key)
            logger.warning("reward for data_source=%r failed (%s); it scores reward.error_score=%s and training "
                           "continues. Logged once per data_source and kind; see reward/errors and "
                           "reward/timeouts.\n%s", key[0], key[1], self.cfg.error_score, r.error)
        return {"reward/errors": float(errors), "reward/timeouts": float(timeouts)}

    def _model_scores(self, batch: DataProto, update_stats: bool, metrics: dict[str, float]) -> np.ndarray:
        if keys.RM_SCORES not in batch.batch:
            raise ValueError("reward.sources includes 'model' but the batch has no 'rm_scores'; enable "
                             "reward.reward_model so the reward-model worker scores responses before the reward "
                             "stage, or remove 'model' from reward.sources")
        rm = batch.batch[keys.RM_SCORES].float()
        rm = rm.sum(-1) if rm.ndim == 2 else rm  # token-level RM output has the score on one token
        scores = torch.nan_to_num(rm, nan=self.cfg.error_score).cpu().numpy().astype(np.float64)
        rm_cfg = self.cfg.reward_model
        if self._rm_moments is not None:
            if update_stats:
                self._rm_moments.update(scores)
            metrics["reward/model/raw_mean"] = float(scores.mean())
            scores = (scores - self._rm_moments.mean) / max(self._rm_moments.std, 1e-6)
        if rm_cfg.score_clip is not None:
            metrics["reward/model/clip_frac"] = float((np.abs(scores) > rm_cfg.score_clip).mean())
            scores = np.clip(scores, -rm_cfg.score_clip, rm_cfg.score_clip)
        return scores

    def _judge_scores(self, batch: DataProto, solutions: list[str], metrics: dict[str, float]) -> np.ndarray:
        """The judge's verdict on each (prompt, response, ground truth); the prompt is the policy's prompt text."""
        n = len(solutions)
        prompts_BP = batch.batch[keys.PROMPTS].cpu()
        pad = self.tokenizer.pad_token_id
        prompts = [self.tokenizer.decode([t for t in row if t != pad], skip_special_tokens=True)
                   for row in prompts_BP.tolist()]
        reward_model = batch.non_tensor_batch.get(keys.REWARD_MODEL, np.array([None] * n, dtype=object))
        truths = [rm.get("ground_truth") if isinstance(rm, dict) else None for rm in reward_model]
        t0 = time.perf_counter()
        verdicts = self.judge(prompts, solutions, truths)
        metrics.update(verdicts.metrics())
        metrics["timing/judge"] = time.perf_counter() - t0
        return verdicts.scores

    def _penalties(self, lengths: np.ndarray, metrics: dict[str, float]) -> np.ndarray:
        total = np.zeros(len(lengths))
        if self.cfg.length_penalty.enable:
            pen = length_penalty(lengths, self.cfg.length_penalty.coef, self.max_response_length)
            metrics["reward/length_penalty/mean"] = float(pen.mean())
            total += pen
        ob = self.cfg.overlong_buffer
        if ob.enable:
            pen = overlong_penalty(lengths, self.max_response_length, ob.len, ob.penalty_factor)
            metrics["reward/overlong_penalty/mean"] = float(pen.mean())
            metrics["reward/overlong_frac"] = float((pen < 0).mean())
            total += pen
        return total

    def _summary(self, raw: np.ndarray, source_scores: dict[str, np.ndarray], data_sources: np.ndarray,
                 extras: dict[str, np.ndarray]) -> dict[str, float]:
        """Breakdowns only where they are a value of their own: the sequence score itself is the trainer's
        `reward/score/*` (of the trained batch), so one source at weight 1 gets no `reward/<source>/mean` and a
        batch of one data source no `reward/<data_source>/score` (each would repeat it)."""
        out = {}
        if len(self.sources) > 1 or any(w != 1.0 for _, w in self.sources):
            for name, values in source_scores.items():
                out[f"reward/{name}/mean"] = float(values.mean())
        kinds = sorted(set(data_sources))
        if len(kinds) > 1:
            for ds in kinds:
                out[f"reward/{ds}/score"] = float(raw[data_sources == ds].mean())
        return out | {f"reward/{key}": value for key, value in extras_means(extras).items()}
