"""PPO/GRPO: `PPOAlgorithm.stages()` is the step's numbered list of stages, `run_stages` (`stage_schedule.py`) runs
them, overlapping what may overlap; `PPOTrainer` runs the step in the one loop.

Everything heavy runs inside worker groups (`groups.actor`, `groups.critic`, `groups.reward_model`); the driver only
moves DataProtos between them and does the cheap tensor math (rewards, advantages, metrics).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from hybridflow.agentic.prompting import prompt_tools
from hybridflow.algorithms import (
    apply_kl_penalty,
    build_kl_controller,
    compute_advantage,
    kl_penalty,
    masked_mean,
    rollout_is_metrics,
)
from hybridflow.config import Config, resolve, to_dict
from hybridflow.config.lr_rule import lr_warning
from hybridflow.config.plan import BATCH_UNITS, planned_steps
from hybridflow.data import build_rl_datasets, make_dataloader
from hybridflow.models.loader import load_image_processor, load_tokenizer
from hybridflow.protocol import DataProto, keys
from hybridflow.rewards import RewardManager
from hybridflow.trainer.async_driver import build_driver
from hybridflow.trainer.balance import balanced_order
from hybridflow.trainer.dynamic_sampling import InformativeGroups, combine_reward_metrics
from hybridflow.trainer.judge import build_judge
from hybridflow.trainer.loop import Algorithm, Trainer
from hybridflow.trainer.metrics import (
    compute_data_metrics,
    memory_metrics,
    reduce_metrics,
    throughput_metrics,
)
from hybridflow.trainer.roles import WorkerGroups, build_worker_groups
from hybridflow.trainer.stage_schedule import AnyStage, Beside, Stage, WorkerCall, run_stages
from hybridflow.trainer.timing import StageTimer
from hybridflow.trainer.validation import Validator
from hybridflow.workers.actor_rollout_ref import ActorRolloutRefGroup

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from hybridflow.checkpoint.worker import CheckpointingGroup
    from hybridflow.data.contract import SkipReport
    from hybridflow.tracking import Tracker

logger = logging.getLogger(__name__)


class PPOAlgorithm(Algorithm):
    guarded = ("actor", "critic")

    def __init__(self, cfg: Config, *, tokenizer: PreTrainedTokenizerBase | None = None,
                 tracker: Tracker | None = None, groups: WorkerGroups | None = None) -> None:
        self.cfg, self.res = cfg, resolve(cfg)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
        tools = prompt_tools(cfg.rollout.multi_turn, self.tokenizer, cfg.data.chat_template)
        self.train_ds, self.val_ds = build_rl_datasets(cfg.data, self.tokenizer, cfg.reward, tools=tools,
                                                       image_processor=load_image_processor(cfg.model))
        self.loader = make_dataloader(self.train_ds, cfg.data, cfg.data.train_batch_size,
                                      shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last)
        if len(self.loader) == 0:
            raise ValueError(f"data.train_batch_size={cfg.data.train_batch_size} prompts is larger than the training "
                             f"set ({len(self.train_ds)} prompts) with drop_last: lower the batch size or add data")
        self.reward_fn = RewardManager(cfg.reward, self.tokenizer, cfg.data.max_response_length,
                                       build_judge(cfg.reward))
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
        t = cfg.trainer  # a step count set → the data cycles until it is reached (config/plan.py)
        self.total_epochs = None if t.total_training_steps else t.total_epochs
        self.total_steps = planned_steps(t.total_training_steps, t.total_epochs, len(self.loader))
        self.batch_unit = BATCH_UNITS["train"]
        self.groups = groups if groups is not None else build_worker_groups(cfg, self.res, self.total_steps)
        self.validator = Validator(cfg, self.val_ds, self.groups.actor, self.reward_fn, self.groups.reward_model,
                                   tracker=tracker) if self.val_ds else None
        self.global_step = 0  # the step being trained (set by `step`)
        self._gen_calls = 0
        self._extra: Iterator[DataProto] | None = None  # DAPO's extra prompts (`extra_batch`), from the first draw
        self.driver = build_driver(self)  # trainer.mode=one_step_off|async: generation on the rollout workers

    @property
    def actor(self) -> ActorRolloutRefGroup:
        return self.groups.actor

    # ------------------------------------------------------------------------------------ loop interface
    def checkpoint_groups(self) -> dict[str, CheckpointingGroup]:
        if self.cfg.trainer.use_colocated_worker or self.groups.critic is None:
            return {"": self.groups.actor}  # one checkpoint for every role of the process
        return {"actor": self.groups.actor, "critic": self.groups.critic}

    def batches(self, source: Iterator[DataProto], start_step: int) -> Iterator[DataProto]:
        return source if self.driver is None else self.driver.run(source, start_step)

    def skip_reports(self) -> list[SkipReport]:
        return [ds.skips for ds in (self.train_ds, self.val_ds) if ds is not None]

    def state_dict(self) -> dict[str, Any]:
        ema = self.cfg.ref.ema
        return {"kl_ctrl": self.kl_ctrl.state_dict(),
                "gen_calls": int(self._gen_calls),  # the driver's sampling seeds count generate calls
                "ema": {"enable": ema.enable, "decay": ema.decay, "update_every": ema.update_every},
                **(self.driver.state_dict() if self.driver is not None else {})}

    def load_state_dict(self, extra: dict[str, Any]) -> None:
        ema_saved, ema_now = bool(extra.get("ema", {}).get("enable", False)), self.cfg.ref.ema.enable
        if ema_saved != ema_now:
            raise ValueError(f"the checkpoint was saved with ref.ema.enable={ema_saved} but now ref.ema.enable="
                             f"{ema_now}; resume with the same setting (or trainer.resume_mode=disable)")
        self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        self._gen_calls = int(extra.get("gen_calls", 0))

    def checkpoint_payload(self) -> dict[str, Any] | None:
        return None if self.driver is None else self.driver.checkpoint_payload()  # the rollouts generated ahead

    def load_checkpoint_payload(self, payload: dict[str, Any]) -> None:
        if self.driver is None:
            logger.warning("the checkpoint holds rollouts generated ahead by trainer.mode=%s; trainer.mode=sync "
                           "generates their prompts again", payload.get("mode"))
            return
        self.driver.load_checkpoint_payload(payload)

    def on_rollback(self, extra: dict[str, Any]) -> None:
        self.kl_ctrl.load_state_dict(extra["kl_ctrl"])
        if self.driver is not None:  # the rollout workers must generate with the restored weights
            self.driver.on_rollback(self.global_step)

    def cleanups(self) -> list[Callable[[], object]]:
        return [self.reward_fn.close, self.groups.close]

    # ----------------------------------------------------------------------------------------------- step
    def step(self, batch: DataProto, step: int) -> dict[str, float]:
        """RL step `step`: its stages (`stages`) on the batch, each timed as `timing/<name>`."""
        self.global_step = step
        timer, metrics, start = StageTimer(), {}, time.perf_counter()
        batch = run_stages(self.stages(step, timer), batch, timer, metrics, self.in_process)
        return self._finish(batch, step, metrics, timer, start)

    def stages(self, step: int, timer: StageTimer) -> list[AnyStage]:
        """The stages of step `step` in data order (numbered in each method's docstring), the optional ones left out.
        What runs beside what (`reward.overlap`) is `run_stages`' decision, from their contracts."""
        res, critic = self.res, self.res.use_critic
        actor = step > self.cfg.critic.warmup_steps or not critic  # the critic warms up first
        stages = [
            Stage("gen", self._gen),
            self._reward_stage(timer),
            Stage("balance", self._balance, timed=False),  # rows spread evenly over the data-parallel ranks
            WorkerCall("old_log_prob", self.old_log_prob, keys.OLD_LOG_PROB) if res.recompute_old_log_prob else None,
            Stage("old_from_rollout", self._old_from_rollout, keys.OLD_FROM_ROLLOUT, timed=False)
            if res.old_log_prob_from_rollout else None,
            WorkerCall("ref", self.ref_log_prob, keys.REF) if res.use_reference else None,
            WorkerCall(keys.TEACHER.name, self.teacher_log_prob, keys.TEACHER) if res.use_teacher else None,
            WorkerCall(keys.VALUES_STAGE.name, self.values, keys.VALUES_STAGE) if critic else None,
            Stage("adv", self.advantages, keys.ADV),
            WorkerCall("update_critic", self.update_critic, keys.UPDATE_CRITIC) if critic else None,
            WorkerCall("update_actor", self.update_actor, keys.UPDATE_ACTOR, late=self._update_takes_late())
            if actor else None,
        ]
        return [s for s in stages if s is not None]

    @property
    def in_process(self) -> bool:
        """The workers run in this process (local backend): a worker call can call the driver back."""
        return self.actor.worker_group.backend_kind == "local"

    def _finish(self, batch: DataProto, step: int, metrics: dict[str, float], timer: StageTimer,
                start: float) -> dict[str, float]:
        if self.driver is not None:  # non-sync modes: the rollout workers get policy version `step`
            metrics |= self.driver.after_update(step)
        ema = self.cfg.ref.ema
        if ema.enable and self.global_step % ema.update_every == 0:
            self.actor.update_ref_ema()
        timer.add("step", time.perf_counter() - start)
        metrics |= compute_data_metrics(batch, self.cfg.data.max_response_length)
        metrics |= timer.metrics() | throughput_metrics(batch, timer.times["step"], self.res.world_size)
        for key, value in memory_metrics().items():  # the workers' GPU peaks win over the driver's (Ray: no GPU)
            metrics.setdefault(key, value)
        return metrics  # 9. the caller logs, validates and checkpoints

    def _reward_stage(self, timer: StageTimer) -> Stage | None:
        """2. The reward; DAPO's dynamic sampling instead (it times its scoring and generating rounds itself); None
        when a non-sync driver scored each request on arrival. It may run beside the worker stages after it
        (`reward.overlap`) when it needs no worker (a reward model) and no decision waits on it (DAPO)."""
        if self.driver is not None and self.driver.scores:
            return None
        if self.cfg.algorithm.filter_groups.enable:
            return Stage("reward", lambda b, m: self._keep_informative_groups(b, m, timer), keys.REWARD, timed=False)
        overlaps = self.cfg.reward.overlap and not self.res.use_reward_model
        return Stage("reward", self.reward, keys.REWARD, overlaps=overlaps)

    def _update_takes_late(self) -> bool:
        """The actor update may start before its advantages exist (late columns, `engine/update.py`): one mini-batch
        and one epoch (its first forward reads none) and a batch generated by this step (not ahead by a driver)."""
        return (self.driver is None and self.res.actor.num_mini_batches == 1
                and self.cfg.actor.ppo_epochs == 1)

    # --------------------------------------------------------------------------------------------- stages
    def _gen(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        """1. The step's responses: generated here, or (non-sync modes) taken from the driver."""
        if self.driver is not None:  # non-sync modes: generated ahead on the rollout workers
            return self.driver.take(batch, self.global_step, metrics)
        return self.generate(batch, metrics)

    def generate(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        """1. `rollout.n` responses per prompt on the hybrid actor (train → generate → train inside)."""
        batch = self.with_seeds(batch)
        out = self.actor.generate_sequences(batch)
        metrics |= reduce_metrics(out.meta_info.pop("metrics", []))  # timing/switch, timing/generate per rank
        if self.cfg.algorithm.adv_estimator == "remax":  # greedy baseline response per prompt
            greedy = self.actor.generate_sequences(self.greedy_prompts(batch))
            out.batch[keys.BASELINE_REWARDS] = self.baseline_rewards(greedy)
        return out

    def with_seeds(self, batch: DataProto) -> DataProto:
        """One sampling seed per prompt, from (rollout.seed, step, row): the same responses whatever the split
        across data-parallel ranks, so 1 and N ranks (or a resumed run) generate identically."""
        base = (self.cfg.rollout.seed * 1_000_003 + self.global_step * 7_919 + self._gen_calls) * 1_000_033
        self._gen_calls += 1
        view = batch[:]
        view.batch = {**batch.batch, keys.SEEDS: torch.arange(len(batch), dtype=torch.long) + base % (2**62)}
        return view

    @staticmethod
    def greedy_prompts(batch: DataProto) -> DataProto:
        """ReMax's baseline request: the same prompts, one greedy response each."""
        view = batch[:]
        view.meta_info = {**batch.meta_info, "do_sample": False, "n": 1}
        return view

    def baseline_rewards(self, greedy: DataProto) -> torch.Tensor:
        """ReMax: each greedy response's reward, repeated over its prompt's `rollout.n` samples."""
        greedy.meta_info.pop("metrics", None)
        scores, _ = self.reward_fn(greedy)
        return scores.sum(-1).repeat_interleave(self.cfg.rollout.n)

    @keys.checked_stage(keys.REWARD)
    def reward(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        """2. Rule functions / reward model, mixing, penalties: `token_level_scores`."""
        if self.res.use_reward_model:
            batch = batch.union(self.groups.reward_model.compute_rm_score(batch))
        scores, reward_metrics = self.reward_fn(batch)
        if keys.TURN_REWARDS in batch.batch:  # multi-turn: tool/interaction rewards at each turn's end
            turn = batch.batch[keys.TURN_REWARDS].to(scores.dtype)
            scores = scores + turn
            reward_metrics["reward/turn_rewards/mean"] = float(turn.sum(-1).mean())
        batch.batch[keys.TOKEN_LEVEL_SCORES] = scores
        metrics |= reward_metrics
        return batch

    def _keep_informative_groups(self, batch: DataProto, metrics: dict[str, float], timer: StageTimer) -> DataProto:
        """Score the generated batch and drop groups whose responses all scored the same; generate more prompts
        until the batch is full. The reward metrics cover every round (`combine_reward_metrics`)."""
        groups = InformativeGroups(self.res.samples_per_step, self.cfg.rollout.n, self.res.world_size)
        scored: list[tuple[int, dict[str, float]]] = []
        tries = 0
        while True:
            with timer("reward"):
                batch = self.reward(batch, round_metrics := {})
            scored.append((len(batch), round_metrics))
            groups.add(batch)
            tries += 1
            if groups.full or tries >= self.cfg.algorithm.filter_groups.max_num_gen_batches:
                break
            with timer("gen"):
                batch = self.generate(self.extra_batch(), metrics)
        metrics |= combine_reward_metrics(scored)
        return groups.batch(metrics, tries)

    def extra_batch(self) -> DataProto:
        """DAPO's next batch of extra prompts (`_batches_forever`)."""
        if self._extra is None:
            self._extra = self._batches_forever()
        return next(self._extra)

    def _batches_forever(self) -> Iterator[DataProto]:
        """DAPO's extra prompts: a loader of their own (shuffled with data.seed + 1, uids `<name>-extra-e<epoch>-i`),
        so extras neither repeat the batches the run trains next nor move its saved data position, and a prompt
        drawn twice into one batch never merges two groups."""

        cfg = self.cfg.data
        loader = make_dataloader(self.train_ds, cfg, cfg.train_batch_size, shuffle=cfg.shuffle,
                                 drop_last=cfg.drop_last, seed=cfg.seed + 1, name=f"{self.loader.name}-extra")
        while True:
            yield from loader

    def _balance(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        if self.res.world_size <= 1:
            return batch
        batch.reorder(balanced_order(batch.batch[keys.ATTENTION_MASK].sum(-1), self.res.world_size))
        return batch

    def old_log_prob(self, batch: DataProto, metrics: dict[str, float], beside: Beside | None = None) -> DataProto:
        """3. Log-probs of the sampling policy, recomputed (and the rollout-IS metrics when the loss applies them)."""
        out = self.actor.compute_log_prob(batch, beside=beside)
        metrics |= reduce_metrics(out.meta_info.pop("metrics", []))  # MoE: moe/routing_agreement, moe/logprob_gap
        if (is_cfg := self.res.rollout_is) is not None:
            metrics |= rollout_is_metrics(out.batch[keys.OLD_LOG_PROBS], batch.batch[keys.ROLLOUT_LOG_PROBS],
                                          batch.batch[keys.RESPONSE_MASK], mode=is_cfg.mode, cap=is_cfg.cap)
        return out

    def _old_from_rollout(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        """3'. Exact log-probs in sync mode: the rollout's log-probs are the sampling policy's as the trainer computes
        them (the same bits), so they are the old log-probs — the recompute pass is skipped."""
        batch.batch[keys.OLD_LOG_PROBS] = batch.batch[keys.ROLLOUT_LOG_PROBS].clone()
        if (is_cfg := self.res.rollout_is) is not None:
            metrics |= rollout_is_metrics(batch.batch[keys.OLD_LOG_PROBS], batch.batch[keys.ROLLOUT_LOG_PROBS],
                                          batch.batch[keys.RESPONSE_MASK], mode=is_cfg.mode, cap=is_cfg.cap)
        return batch

    def ref_log_prob(self, batch: DataProto, metrics: dict[str, float], beside: Beside | None = None) -> DataProto:
        """4. Log-probs of the reference policy (only when KL is used)."""
        return self.actor.compute_ref_log_prob(batch, beside=beside)

    def teacher_log_prob(self, batch: DataProto, metrics: dict[str, float], beside: Beside | None = None) -> DataProto:
        """4b. Log-probs of the frozen teacher (on-policy distillation only)."""
        return self.actor.compute_teacher_log_prob(batch, beside=beside)

    def values(self, batch: DataProto, metrics: dict[str, float], beside: Beside | None = None) -> DataProto:
        """5. Critic values before the update."""
        return self.groups.critic.compute_values(batch, beside=beside)

    @keys.checked_stage(keys.ADV)
    def advantages(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        """6. KL measured (and, with `use_kl_in_reward`, taken from the rewards), advantages and returns."""
        alg, b = self.cfg.algorithm, batch.batch
        mask = b[keys.RESPONSE_MASK]
        if self.res.use_reference and keys.OLD_LOG_PROBS in b:  # else the KL loss's actor/kl_loss measures it
            kl = kl_penalty(b[keys.OLD_LOG_PROBS], b[keys.REF_LOG_PROB], alg.kl_penalty)
            metrics["kl/actor_ref"] = float(masked_mean(kl, mask))
        if alg.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(b[keys.TOKEN_LEVEL_SCORES], keys.sampling_log_probs(b),
                                                   b[keys.REF_LOG_PROB], mask, self.kl_ctrl, alg.kl_penalty)
            b[keys.TOKEN_LEVEL_REWARDS] = rewards
            metrics |= kl_metrics
        else:
            b[keys.TOKEN_LEVEL_REWARDS] = b[keys.TOKEN_LEVEL_SCORES]
        metrics["kl/coef"] = float(self.kl_ctrl.value)
        teacher = b.get(keys.TEACHER_LOG_PROBS.name)
        if teacher is not None:  # the distillation gap: E[log π_student − log π_teacher] on the sampled tokens
            metrics["distill/reverse_kl"] = float(masked_mean(keys.sampling_log_probs(b) - teacher, mask))
        adv, ret = compute_advantage(
            alg.adv_estimator, token_level_rewards=b[keys.TOKEN_LEVEL_REWARDS], response_mask=mask,
            index=batch.non_tensor_batch[keys.UID], values=b.get(keys.VALUES), gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std=alg.norm_adv_by_std, baseline_rewards=b.get(keys.BASELINE_REWARDS),
            teacher_log_probs=teacher, log_probs=keys.sampling_log_probs(b) if teacher is not None else None,
            task_reward_weight=self.cfg.teacher.task_reward_weight,
        )
        b[keys.ADVANTAGES], b[keys.RETURNS] = adv, ret
        return batch

    def update_critic(self, batch: DataProto, metrics: dict[str, float], beside: Beside | None = None) -> None:
        """7. Critic PPO epochs."""
        assert beside is None, "the critic update takes no late columns (WorkerCall.late is False)"
        metrics |= reduce_metrics(self.groups.critic.update_critic(batch))

    def update_actor(self, batch: DataProto, metrics: dict[str, float], late: Beside | None = None) -> None:
        """8. Actor PPO epochs; `late` returns the batch with the advantages when the update started without them."""
        metrics |= reduce_metrics(self.actor.update_actor(batch, late=late))


class PPOTrainer(Trainer):
    """The PPO/GRPO run: `PPOAlgorithm` in the one loop (`Trainer`)."""

    algorithm: PPOAlgorithm

    def __init__(self, cfg: Config, *, tokenizer: PreTrainedTokenizerBase | None = None,
                 tracker: Tracker | None = None, groups: WorkerGroups | None = None) -> None:
        super().__init__(cfg, PPOAlgorithm(cfg, tokenizer=tokenizer, tracker=tracker, groups=groups), tracker)
        warning = lr_warning(to_dict(cfg))  # e.g. verl's 1e-6 on a tiny model: nothing moves, nothing said
        if warning is not None and tracker is not None:
            tracker.event("lr_far_from_rule", warning, 0, level="warning")
        elif warning is not None:
            logger.warning(warning)

    @property
    def groups(self) -> WorkerGroups:
        return self.algorithm.groups

    @property
    def actor(self) -> ActorRolloutRefGroup:
        return self.algorithm.actor


