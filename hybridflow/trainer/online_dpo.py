"""Online DPO: `OnlineDPOAlgorithm`, run as `OnlineDPOTrainer(cfg).fit()` (`hybridflow dpo dpo.online=true`).

Each step reuses PPO's stages and the offline DPO loss: 1. `gen` — `rollout.n` (≥ 2) responses per prompt on the
actor's own weights; 2. `reward` — the rule functions and/or the reward model (`reward.*`); 3. `pair` — per prompt
the best- and worst-scored response form a (chosen, rejected) pair (`algorithms/preference_pairs.py`); prompts whose
responses all scored the same are skipped and counted (`online_dpo/tied_groups`); 4. `ref` — the reference's
log-probs of both sides (the frozen starting policy, or with LoRA the actor with its adapters disabled; none for
SimPO); 5. `update_actor` — one optimizer step of the `dpo.loss_type` loss on the pairs (chosen and rejected in one
forward). Validation, checkpoints and resume are the RL run's (`val/accuracy` on held-out prompts).

Decision: the run is sized like `hybridflow train` (data.train_batch_size prompts per step, rollout.*, actor.optim,
trainer.total_training_steps / total_epochs) because it is an RL run whose update is the DPO loss — what TRL's
`OnlineDPOTrainer` is (prompt-only data, a judge or reward model, `beta`, `loss_type`). The `dpo` section gives the
loss and `dpo.init_from`. Pairs are trimmed to a multiple of the data-parallel ranks (whole pairs on every rank).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.algorithms.preference_pairs import Pairs, best_worst_pairs
from hybridflow.config import Config
from hybridflow.protocol import DataProto, keys
from hybridflow.trainer.dpo import dpo_model_config
from hybridflow.trainer.loop import Trainer
from hybridflow.trainer.metrics import compute_data_metrics, reduce_metrics
from hybridflow.trainer.ppo import PPOAlgorithm
from hybridflow.trainer.run import cleaned_up, tracked_run
from hybridflow.trainer.timing import StageTimer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hybridflow.tracking import Tracker
    from hybridflow.trainer.roles import WorkerGroups

# What the pair batch keeps of a generated batch (the engine's model inputs and the loss mask).
PAIR_KEYS = (*keys.MODEL_INPUTS, keys.RESPONSE_MASK)


def pair_batch(batch: DataProto, pairs: Pairs, world_size: int) -> DataProto:
    """Interleaved (chosen, rejected) rows of `batch` with `pair_chosen`, trimmed to a multiple of `world_size`
    pairs (so every data-parallel rank holds whole pairs)."""
    keep = pairs.num_pairs // world_size * world_size
    rows = pairs.interleaved()[: 2 * keep]
    out = batch.select(batch_keys=list(PAIR_KEYS), non_tensor_batch_keys=[keys.UID]).select_idxs(rows)
    out.meta_info = {}
    out.batch["pair_chosen"] = torch.tensor([1, 0] * keep, dtype=torch.long)
    return out


class OnlineDPOAlgorithm(PPOAlgorithm):
    """PPO's data, worker groups, generate and reward stages, validation and checkpointing; the update is DPO."""

    guarded = ("actor",)

    def __init__(self, cfg: Config, *, tokenizer: PreTrainedTokenizerBase | None = None,
                 tracker: Tracker | None = None, groups: WorkerGroups | None = None) -> None:
        if not cfg.dpo.online:
            raise ValueError("OnlineDPOAlgorithm runs dpo.online=true configs (offline DPO: DPOTrainer)")
        super().__init__(cfg, tokenizer=tokenizer, tracker=tracker, groups=groups)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "section": "online_dpo"}

    def step(self, batch: DataProto, step: int) -> dict[str, float]:
        """Online DPO step `step`; each numbered stage is timed as `timing/<name>`."""
        self.global_step = step
        timer, metrics = StageTimer(), {}
        start = time.perf_counter()
        with timer("gen"):  # 1. rollout.n responses per prompt (non-sync modes: generated ahead, older weights)
            batch = self._gen(batch, metrics)
        with timer("reward"):  # 2. rule functions / reward model
            batch = self.reward(batch, metrics)
        with timer("pair"):  # 3. best/worst response of each prompt; all-equal groups skipped
            scores_B = batch.batch[keys.TOKEN_LEVEL_SCORES].sum(-1)
            pairs = best_worst_pairs(scores_B, batch.non_tensor_batch[keys.UID])
            pb = pair_batch(batch, pairs, self.res.world_size)
        metrics |= _pair_metrics(pairs, scores_B, len(pb) // 2)
        if len(pb):
            if self.res.use_reference:
                with timer("ref"):  # 4. reference log-probs of both sides
                    pb = pb.union(self.actor.compute_ref_log_prob(pb))
            with timer("update_actor"):  # 5. one optimizer step of the preference loss
                metrics |= reduce_metrics(self.actor.update_actor_preference(pb))
        if self.driver is not None:  # non-sync modes: the rollout workers get policy version `step`
            metrics |= self.driver.after_update(step)
        timer.add("step", time.perf_counter() - start)
        metrics |= compute_data_metrics(batch, self.cfg.data.max_response_length)
        return metrics | timer.metrics()


def _pair_metrics(pairs: Pairs, scores_B: torch.Tensor, trained: int) -> dict[str, float]:
    out = {"online_dpo/pairs": float(trained), "online_dpo/tied_groups": float(pairs.tied_groups),
           "online_dpo/frac_tied_groups": pairs.tied_groups / max(pairs.num_groups, 1),
           "online_dpo/dropped_pairs": float(pairs.num_pairs - trained)}
    if pairs.num_pairs:
        c, r = scores_B[pairs.chosen_P].double(), scores_B[pairs.rejected_P].double()
        out |= {"online_dpo/chosen_score": float(c.mean()), "online_dpo/rejected_score": float(r.mean()),
                "online_dpo/score_gap": float((c - r).mean())}
    return out


class OnlineDPOTrainer(Trainer):
    """The online DPO run: `OnlineDPOAlgorithm` in the one loop (`dpo.init_from` replaces `model.path`)."""

    algorithm: OnlineDPOAlgorithm

    def __init__(self, cfg: Config, *, tokenizer: PreTrainedTokenizerBase | None = None,
                 tracker: Tracker | None = None, groups: WorkerGroups | None = None) -> None:
        cfg = dpo_model_config(cfg)
        super().__init__(cfg, OnlineDPOAlgorithm(cfg, tokenizer=tokenizer, tracker=tracker, groups=groups), tracker)


def run_online_dpo(cfg: Config, tracker: Tracker | None = None) -> list[dict[str, float]]:
    """Train online DPO with `cfg`; returns the per-step metrics (tracker from `trainer.logger` when not given)."""

    with tracked_run(cfg, tracker) as tracker:
        trainer = OnlineDPOTrainer(cfg, tracker=tracker)
        with cleaned_up(trainer.close):
            return trainer.fit()
