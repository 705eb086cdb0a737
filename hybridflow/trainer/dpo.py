"""Offline preference optimisation: `DPOAlgorithm` (DPO / cDPO / IPO / SimPO, `dpo.loss_type`), run as
`DPOTrainer(cfg).fit()` on the one loop.

Pairs are the reward model's (`build_preference_datasets`: parquet `prompt`/`chosen`/`rejected`, or a built-in
task's synthetic pairs), collated interleaved without a score slot, so chosen and rejected go through one forward.
The reference is the starting model (`dpo.init_from`, else `model.path` / `model.preset`): a second, frozen engine
built once in the worker, or — with `model.lora.rank > 0` — the trained engine with its adapters disabled. Its
log-probs are computed per batch (stage 1), or with `dpo.precompute_ref=true` once for every training and
validation pair before training (`ReferenceLogps`), after which the frozen engine is freed. SimPO needs no
reference and builds none.
Validation on held-out pairs: `val/loss`, `val/accuracy` (implicit reward of chosen > rejected, TRL's
`rewards/accuracies`), `val/logp_accuracy` (the policy's own log π(chosen) > log π(rejected); length-normalised
for SimPO), `val/reward_margin`, `val/logps_chosen`, `val/logps_rejected`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from hybridflow.algorithms.preference import REFERENCE_FREE, PairLogps, preference_loss
from hybridflow.config import Config
from hybridflow.config.schema import DPOConfig
from hybridflow.engine import EngineSpec, HeadRequest
from hybridflow.protocol import DataProto
from hybridflow.trainer.metrics import reduce_metrics
from hybridflow.trainer.ref_cache import ReferenceLogps
from hybridflow.trainer.rm import build_preference_datasets
from hybridflow.trainer.supervised import SupervisedAlgorithm, SupervisedTrainer
from hybridflow.trainer.supervised_batch import collate_pairs
from hybridflow.trainer.supervised_losses import pair_logps
from hybridflow.workers.engine_specs import dpo_ref_spec, dpo_spec, sft_head

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hybridflow.tracking import Tracker

logger = logging.getLogger(__name__)


def dpo_model_config(cfg: Config) -> Config:
    """`dpo.init_from` replaces `model.path` (policy, reference and tokenizer all come from that directory)."""
    if not cfg.dpo.init_from:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=cfg.dpo.init_from))


class DPOAlgorithm(SupervisedAlgorithm):
    section, loss = "dpo", "preference"
    sec: DPOConfig

    def __init__(self, cfg: Config, *, tokenizer: PreTrainedTokenizerBase | None = None,
                 tracker: Tracker | None = None) -> None:
        self.ref_cache: dict[str, ReferenceLogps] = {}  # "train"/"val" → precomputed reference log-probs
        super().__init__(cfg, tokenizer=tokenizer, tracker=tracker)
        if self.sec.precompute_ref and self.needs_reference:
            self.precompute_reference()

    def precompute_reference(self) -> None:
        """Reference log-probs of every training and validation pair in one pass, then free the frozen reference
        (with LoRA the reference is the trained model with adapters off: nothing to free)."""
        start = time.perf_counter()
        for name, ds in (("train", self.train_ds), ("val", self.val_ds)):
            if ds is not None:
                loader = self.make_loader(ds, shuffle=False, drop_last=False)
                self.ref_cache[name] = ReferenceLogps.compute(loader, self.group.compute_ref_log_prob)
        self.group.release_ref()
        logger.info("dpo: precomputed reference log-probs of %d rows in %.1f s; the reference model is freed",
                    sum(len(c) for c in self.ref_cache.values()), time.perf_counter() - start)

    def _ref_log_prob(self, batch: DataProto, split: str) -> torch.Tensor:
        if split in self.ref_cache:
            return self.ref_cache[split].lookup(batch)
        return self.group.compute_ref_log_prob(batch).batch["ref_log_prob"]

    @property
    def needs_reference(self) -> bool:
        return self.sec.loss_type not in REFERENCE_FREE

    def build_datasets(self) -> tuple[Dataset, Dataset | None]:
        return build_preference_datasets(self.cfg, self.tokenizer, self.sec.synthetic_mix)

    def collate_fn(self) -> Callable[[list[Any]], DataProto]:
        return functools.partial(collate_pairs, pad_token_id=self.pad_id, score_slot=False)

    def engine_spec(self) -> EngineSpec:
        return dpo_spec(self.cfg, self.total_steps, self.model_path())

    def ref_spec(self) -> EngineSpec | None:
        if not self.needs_reference or self.cfg.model.lora.enabled:
            return None  # SimPO: reference-free; LoRA: the actor with adapters disabled is the reference
        return dpo_ref_spec(self.cfg, self.model_path())

    def train_head(self) -> HeadRequest:
        return sft_head(self.cfg)  # log-probs at temperature 1

    def loss_kwargs(self) -> dict[str, Any]:
        s = self.sec
        return {"loss_type": s.loss_type, "beta": s.beta, "label_smoothing": s.label_smoothing, "gamma": s.gamma}

    # ------------------------------------------------------------------------------------------------- step
    def step(self, batch: DataProto, step: int) -> dict[str, float]:
        start = time.perf_counter()
        # 1. reference log-probs of both sides of every pair (frozen reference, adapters disabled, or precomputed)
        if self.needs_reference:
            batch.batch["ref_log_prob"] = self._ref_log_prob(batch, "train")
        t_ref = time.perf_counter()
        # 2. one optimizer step on the preference loss (chosen + rejected in one forward)
        metrics = reduce_metrics(self.group.train_batch(batch), self.section)
        end = time.perf_counter()
        metrics |= {"timing/ref": t_ref - start, "timing/update": end - t_ref, "timing/step": end - start}
        return metrics

    # ------------------------------------------------------------------------------------------- validation
    def run(self, step: int) -> dict[str, float]:
        """Loss, implicit-reward accuracy/margin and the policy's own preference on the held-out pairs."""
        loader = self.make_loader(self.val_ds, shuffle=False, drop_last=False)
        parts: dict[str, list[torch.Tensor]] = {"log_probs": [], "ref_log_prob": [], "mask": [], "pair": []}
        for batch in loader:
            parts["log_probs"].append(self.group.eval_log_probs(batch).batch["log_probs"].double())
            if self.needs_reference:
                parts["ref_log_prob"].append(self._ref_log_prob(batch, "val").double())
            parts["mask"].append(batch.batch["response_mask"])
            parts["pair"].append(batch.batch["pair_chosen"])
        x = _pairs_of(parts)
        s = self.sec
        out = preference_loss(x, s.loss_type, s.beta, s.label_smoothing, s.gamma)
        margin = out.chosen_reward_P - out.rejected_reward_P
        own_c, own_r = x.chosen_P, x.rejected_P
        if s.loss_type in REFERENCE_FREE:  # SimPO's notion of "preferred" is the per-token mean
            own_c, own_r = own_c / x.chosen_len_P, own_r / x.rejected_len_P
        return {"val/loss": float(out.loss_P.mean()), "val/accuracy": float((margin > 0).double().mean()),
                "val/logp_accuracy": float((own_c > own_r).double().mean()), "val/reward_margin": float(margin.mean()),
                "val/logps_chosen": float(x.chosen_P.mean()), "val/logps_rejected": float(x.rejected_P.mean())}


def _pairs_of(parts: dict[str, list[torch.Tensor]]) -> PairLogps:
    """Per-batch [B, R] pieces (widths differ between batches) → one `PairLogps` over all pairs."""
    xs = [pair_logps(lp, m, p, ref) for lp, m, p, ref in
          zip(parts["log_probs"], parts["mask"], parts["pair"], parts["ref_log_prob"] or [None] * len(parts["mask"]))]
    cat = {f.name: (None if getattr(xs[0], f.name) is None else torch.cat([getattr(x, f.name) for x in xs]))
           for f in dataclasses.fields(xs[0])}
    return PairLogps(**cat)


class DPOTrainer(SupervisedTrainer):
    algorithm_cls = DPOAlgorithm
    algorithm: DPOAlgorithm

    def __init__(self, cfg: Config, *, tokenizer: PreTrainedTokenizerBase | None = None,
                 tracker: Tracker | None = None) -> None:
        super().__init__(dpo_model_config(cfg), tokenizer=tokenizer, tracker=tracker)
