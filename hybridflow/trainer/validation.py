"""Validation: generate with `rollout.val_kwargs` (greedy by default), score, report reward and accuracy per source.

Accuracy of a response is the scorer's `acc` when it returns one, else raw score (before penalties) > 0.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from hybridflow.config import Config
from hybridflow.trainer.metrics import per_source_scores

logger = logging.getLogger(__name__)


class Validator:
    def __init__(self, cfg: Config, val_ds: Any, actor: Any, reward_fn: Any, reward_model: Any = None) -> None:
        from hybridflow.data import make_dataloader

        self.cfg, self.actor, self.reward_fn, self.reward_model = cfg, actor, reward_fn, reward_model
        batch_size = cfg.data.val_batch_size or len(val_ds)
        self.loader = make_dataloader(val_ds, cfg.data, batch_size, shuffle=False, drop_last=False)
        self.last_generations: list[dict[str, Any]] = []

    def sampling_meta(self) -> dict[str, Any]:
        v = self.cfg.rollout.val_kwargs
        return {"n": v.n, "do_sample": v.do_sample, "temperature": v.temperature, "top_k": v.top_k, "top_p": v.top_p,
                "validate": True}

    def run(self, step: int) -> dict[str, float]:
        start = time.perf_counter()
        scores, accs, sources, samples = [], [], [], []
        for batch in self.loader:
            batch.meta_info = {**batch.meta_info, **self.sampling_meta()}
            out = self.actor.generate_sequences(batch)
            out.meta_info.pop("metrics", None)
            if self.reward_model is not None:  # a `model` reward source needs the reward model's scores
                out = out.union(self.reward_model.compute_rm_score(out))
            scored = self.reward_fn.score(out)
            row_scores = np.asarray(scored.scores, dtype=np.float64)
            scores.append(row_scores)
            accs.append(self._accuracy(scored))
            sources.append(out.non_tensor_batch["data_source"])
            samples.extend(self._samples(out, row_scores))
        score_arr, acc_arr, src_arr = np.concatenate(scores), np.concatenate(accs), np.concatenate(sources)
        metrics = {"val/reward": float(score_arr.mean()), "val/accuracy": float(acc_arr.mean())}
        metrics |= {k + "/accuracy": v for k, v in per_source_scores(acc_arr, src_arr, "val").items()}
        metrics["timing/val"] = time.perf_counter() - start
        self.last_generations = samples[: self.cfg.trainer.log_val_generations]
        for s in self.last_generations:
            logger.info("val sample (step %d, score %.2f): %r -> %r", step, s["score"], s["prompt"], s["response"])
        return metrics

    @staticmethod
    def _accuracy(scored: Any) -> np.ndarray:
        """The scorer's own `acc` when it reports one, else raw score > 0 (1/0 rule scorers)."""
        accs = [v for k, v in scored.extras.items() if k.endswith("/acc")]
        if accs:
            return np.asarray(accs[0], dtype=np.float64)
        return (np.asarray(scored.raw_scores, dtype=np.float64) > 0).astype(np.float64)

    def _samples(self, out: Any, row_scores: np.ndarray) -> list[dict[str, Any]]:
        n = self.cfg.trainer.log_val_generations
        if n <= 0:
            return []
        tok = self.reward_fn.tokenizer
        res = []
        for i in range(min(n, len(out))):
            prompt_ids = out.batch["prompts"][i]
            resp_ids = out.batch["responses"][i][out.batch["response_mask"][i].bool()]
            res.append({"prompt": tok.decode(prompt_ids[prompt_ids != tok.pad_token_id]),
                        "response": tok.decode(resp_ids), "score": float(row_scores[i])})
        return res
