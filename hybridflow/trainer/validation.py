"""Validation: generate with `rollout.val_kwargs` (greedy by default), score, report reward and accuracy per source.

A response is correct when the scorer returns a dict with `acc` (that value), else when its raw score (mixed,
before penalties) is >= `reward.success_threshold` (default 1.0: partial credit is not success). Responses whose
reward function failed (raised, returned a non-number, timed out) are counted in `val/reward/errors` and
`val/reward/timeouts`, left out of the `val/reward` means (their `error_score` is not a score) and count as not
correct. A batch where every response failed is a warning and a `val_reward_failed` event. A scorer's numeric
extras are averaged into `val/<source>/<key>` (e.g. `val/rule/well_formed` of the `tool_calculator` task).

`trainer.log_val_generations` samples are logged and kept in `last_generations` (`prompt`, `response`, `score`,
`turns`); a multi-turn trajectory is logged whole, one line per turn (`[assistant]` sampled tokens, `[context]`
appended tool responses / user messages).
"""

from __future__ import annotations

import logging
import numbers
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from hybridflow.agentic.trajectory import decoded_turns, format_turns
from hybridflow.config import Config
from hybridflow.data import make_dataloader
from hybridflow.protocol import keys
from hybridflow.rewards.manager import extras_means
from hybridflow.trainer.metrics import per_source_scores

if TYPE_CHECKING:
    from hybridflow.data.rl_dataset import RLHFDataset
    from hybridflow.protocol import DataProto
    from hybridflow.rewards import RewardManager, RewardOutput
    from hybridflow.tracking import Tracker
    from hybridflow.workers.reward_model import RewardModelGroup

logger = logging.getLogger(__name__)


def success(scored: RewardOutput, threshold: float) -> np.ndarray:
    """Per row 1.0/0.0 (or the scorer's own fractional `acc`): the first function source's numeric `acc` for
    that row, else raw score >= threshold; a failed row is 0."""
    raw = np.asarray(scored.raw_scores, dtype=np.float64)
    out = (raw >= threshold).astype(np.float64)
    acc_columns = [v for k, v in sorted(scored.extras.items()) if k.endswith("/acc")]
    for i in range(len(out)):
        given = next((c[i] for c in acc_columns if isinstance(c[i], numbers.Real)), None)
        if given is not None:
            out[i] = float(given)
    out[np.asarray(scored.row_status) != "ok"] = 0.0
    return out


def reward_metrics(scores: np.ndarray, status: np.ndarray, sources: np.ndarray) -> dict[str, float]:
    """`val/reward` (+ per source) over the rows that were scored, and the failed rows' counts."""
    ok = status == "ok"
    metrics = {"val/reward/errors": float((status == "error").sum()),
               "val/reward/timeouts": float((status == "timeout").sum())}
    if ok.any():
        metrics["val/reward"] = float(scores[ok].mean())
        metrics |= {k + "/reward": v for k, v in per_source_scores(scores[ok], sources[ok], "val").items()}
    return metrics


class Generator(Protocol):
    """What validation generates with: the PPO actor's group, or DPO's policy group (`SupervisedGroup`)."""

    def generate_sequences(self, prompts: DataProto) -> DataProto: ...


class Validator:
    def __init__(self, cfg: Config, val_ds: RLHFDataset, actor: Generator, reward_fn: RewardManager,
                 reward_model: RewardModelGroup | None = None, tracker: Tracker | None = None) -> None:
        self.cfg, self.actor, self.reward_fn, self.reward_model = cfg, actor, reward_fn, reward_model
        self.tracker = tracker
        batch_size = cfg.data.val_batch_size or len(val_ds)
        self.loader = make_dataloader(val_ds, cfg.data, batch_size, shuffle=False, drop_last=False)
        self.last_generations: list[dict[str, Any]] = []

    def sampling_meta(self) -> dict[str, Any]:
        v = self.cfg.rollout.val_kwargs
        return {"n": v.n, "do_sample": v.do_sample, "temperature": v.temperature, "top_k": v.top_k, "top_p": v.top_p,
                "validate": True}

    def run(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        scores, accs, sources, status, samples = [], [], [], [], []
        extras: dict[str, list[np.ndarray]] = {}
        for batch in self.loader:
            batch.meta_info = {**batch.meta_info, **self.sampling_meta()}
            out = self.actor.generate_sequences(batch)
            out.meta_info.pop("metrics", None)
            if self.reward_model is not None:  # a `model` reward source needs the reward model's scores
                out = out.union(self.reward_model.compute_rm_score(out))
            scored = self.reward_fn.score(out)
            row_scores = np.asarray(scored.scores, dtype=np.float64)
            scores.append(row_scores)
            accs.append(success(scored, self.cfg.reward.success_threshold))
            sources.append(np.asarray(out.non_tensor_batch[keys.DATA_SOURCE]))
            status.append(np.asarray(scored.row_status))
            for key, column in scored.extras.items():
                extras.setdefault(key, []).append(column)
            samples.extend(self._samples(out, row_scores))
        score_arr, acc_arr, src_arr = np.concatenate(scores), np.concatenate(accs), np.concatenate(sources)
        metrics = reward_metrics(score_arr, np.concatenate(status), src_arr) | {"val/accuracy": float(acc_arr.mean())}
        metrics |= {k + "/accuracy": v for k, v in per_source_scores(acc_arr, src_arr, "val").items()}
        metrics |= {f"val/{k}": v for k, v in extras_means({k: np.concatenate(c) for k, c in extras.items()}).items()}
        self._warn_failed_batches(status, step)
        metrics["timing/val"] = time.perf_counter() - start
        self.last_generations = samples[: self.cfg.trainer.log_val_generations]
        for s in self.last_generations:
            if len(s["turns"]) > 1:  # multi-turn: the whole trajectory, one line per turn
                logger.info("val sample (step %d, score %.2f, %d turns): %r ->\n%s", step, s["score"],
                            len(s["turns"]), s["prompt"], format_turns(s["turns"]))
            else:
                logger.info("val sample (step %d, score %.2f): %r -> %r", step, s["score"], s["prompt"],
                            s["response"])
        return metrics

    def _warn_failed_batches(self, status: list[np.ndarray], step: int) -> None:
        """A warning and one `val_reward_failed` event when every response of a validation batch failed."""
        failed = [i for i, s in enumerate(status) if len(s) and (s != "ok").all()]
        if not failed:
            return
        message = (f"validation at step {step}: every response failed to score in {len(failed)} of {len(status)} "
                   f"batches ({sum(len(status[i]) for i in failed)} responses); those rows are left out of "
                   "val/reward — check the reward function (its first error is in the log)")
        logger.warning(message)
        if self.tracker is not None:
            self.tracker.event("val_reward_failed", message, step, level="warning", batches=failed,
                               responses=int(sum(len(status[i]) for i in failed)))

    def _samples(self, out: DataProto, row_scores: np.ndarray) -> list[dict[str, Any]]:
        n = self.cfg.trainer.log_val_generations
        if n <= 0:
            return []
        tok = self.reward_fn.tokenizer
        res = []
        width = out.batch[keys.RESPONSES].shape[1]
        for i in range(min(n, len(out))):
            prompt_ids = out.batch[keys.PROMPTS][i]
            # the real response tokens: model turns and, in multi-turn rollouts, the tool/user tokens between them
            real = out.batch[keys.ATTENTION_MASK][i, -width:].bool()
            resp_ids = out.batch[keys.RESPONSES][i][real].tolist()
            model = out.batch[keys.RESPONSE_MASK][i][real].tolist()
            res.append({"prompt": tok.decode(prompt_ids[prompt_ids != tok.pad_token_id]),
                        "response": tok.decode(resp_ids), "score": float(row_scores[i]),
                        "turns": decoded_turns(tok, resp_ids, model)})
        return res
