"""PPO/GRPO: `PPOAlgorithm.step()` is the numbered list of stage calls; `PPOTrainer` runs it in the one loop.

Everything heavy runs inside worker groups (`groups.actor`, `groups.critic`, `groups.reward_model`); the driver only
moves DataProtos between them and does the cheap tensor math (rewards, advantages, metrics).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

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
from hybridflow.config.plan import planned_steps
from hybridflow.protocol import DataProto, keys, late
from hybridflow.trainer.async_driver import build_driver
from hybridflow.trainer.balance import balanced_order
from hybridflow.trainer.dynamic_sampling import InformativeGroups, combine_reward_metrics
from hybridflow.trainer.loop import Algorithm, Trainer
from hybridflow.trainer.metrics import (
    compute_data_metrics,
    memory_metrics,
    reduce_metrics,
    throughput_metrics,
)
from hybridflow.trainer.roles import WorkerGroups, build_worker_groups
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
        from hybridflow.agentic.prompting import prompt_tools
        from hybridflow.data import build_rl_datasets, make_dataloader
        from hybridflow.models.loader import load_tokenizer
        from hybridflow.rewards import RewardManager

        self.cfg, self.res = cfg, resolve(cfg)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg.model)
        tools = prompt_tools(cfg.rollout.multi_turn, self.tokenizer, cfg.data.chat_template)
        self.train_ds, self.val_ds = build_rl_datasets(cfg.data, self.tokenizer, cfg.reward, tools=tools)
        self.loader = make_dataloader(self.train_ds, cfg.data, cfg.data.train_batch_size,
                                      shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last)
        if len(self.loader) == 0:
            raise ValueError(f"data.train_batch_size={cfg.data.train_batch_size} prompts is larger than the training "
                             f"set ({len(self.train_ds)} prompts) with drop_last: lower the batch size or add data")
        self.reward_fn = RewardManager(cfg.reward, self.tokenizer, cfg.data.max_response_length)
        self.kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
        t = cfg.trainer  # a step count set → the data cycles until it is reached (config/plan.py)
        self.total_epochs = None if t.total_training_steps else t.total_epochs
        self.total_steps = planned_steps(t.total_training_steps, t.total_epochs, len(self.loader))
        self.batch_unit = "prompts"
        self.groups = groups if groups is not None else build_worker_groups(cfg, self.res, self.total_steps)
        self.validator = Validator(cfg, self.val_ds, self.groups.actor, self.reward_fn, self.groups.reward_model,
                                   tracker=tracker) if self.val_ds else None
        self.global_step = 0  # the step being trained (set by `step`)
        self._gen_calls = 0
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
        """RL step `step`; each numbered stage is timed as `timing/<name>`."""
        self.global_step = step
        timer, metrics = StageTimer(), {}
        start = time.perf_counter()
        with timer("gen"):  # 1. generate rollout.n responses per prompt (train→generate→train inside)
            batch = (self._generate(batch, metrics, timer) if self.driver is None  # non-sync: generated ahead
                     else self.driver.take(batch, step, metrics))
        if self._reward_during_update():  # 2, 6 and 8 at once: the host scores while the update's forward runs
            batch = self._reward_beside_update(self._balance(batch), metrics, timer)
            return self._finish(batch, step, metrics, timer, start)
        if self._overlap_reward():  # 2-5 at once: the host scores while the workers compute log-probs / values
            batch, outs = self._reward_beside_worker_stages(self._balance(batch), metrics, timer)
        else:
            scored = self.driver is not None and self.driver.scores  # non-sync dynamic sampling: scored on arrival
            if self.cfg.algorithm.filter_groups.enable and not scored:  # 2. reward, DAPO dynamic sampling
                batch = self._keep_informative_groups(batch, metrics, timer)
            elif not scored:
                with timer("reward"):  # 2. rule functions / reward model, mixing, penalties
                    batch = self._reward(batch, metrics)
            batch = self._balance(batch)
            outs = self._worker_stages(batch, timer, metrics)  # 3-5
        for out in outs:
            batch = batch.union(out)
        with timer("adv"):  # 6. advantages on the driver (KL-in-reward here)
            metrics |= self._advantages(batch)
        if self.res.use_critic:
            with timer("update_critic"):  # 7. critic PPO epochs
                metrics |= reduce_metrics(self.groups.critic.update_critic(batch))
        if self.global_step > self.cfg.critic.warmup_steps or not self.res.use_critic:
            with timer("update_actor"):  # 8. actor PPO epochs
                metrics |= reduce_metrics(self.actor.update_actor(batch))
        return self._finish(batch, step, metrics, timer, start)

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

    def _reward_beside_worker_stages(self, batch: DataProto, metrics: dict[str, float], timer: StageTimer
                                     ) -> tuple[DataProto, list[DataProto]]:
        """Stage 2 while stages 3-5 run (they never read rewards; they get `batch[:]`, their own dicts, as the
        scoring writes into `batch`). In-process workers (local backend): on this thread, inside the first stage,
        which queues its forwards and then calls back to score (`protocol.late`) while the device computes — a
        second thread would hold the GIL while the stage launches kernels; that stage's timing then includes the
        scoring's host time). Otherwise the stages run on a thread while this one scores. An error in either waits
        for both and is the one raised."""
        if self.actor.worker_group.backend_kind == "local":
            return self._reward_inside_worker_stages(batch, metrics, timer)
        stage_metrics: dict[str, float] = {}
        with ThreadPoolExecutor(1, thread_name_prefix="worker-stages") as pool:
            stages = pool.submit(self._worker_stages, batch[:], timer, stage_metrics, _cuda_device())
            try:
                with timer("reward", sync=False):  # the GPU work in flight is the other thread's
                    batch = self._reward(batch, metrics)
            finally:  # never leave the workers busy behind an error
                outs = stages.result()
        metrics |= stage_metrics
        return batch, outs

    def _reward_inside_worker_stages(self, batch: DataProto, metrics: dict[str, float], timer: StageTimer
                                     ) -> tuple[DataProto, list[DataProto]]:
        def score() -> DataProto:
            with timer("reward", sync=False):  # the forwards in flight are the stage's
                return self._reward(batch, metrics)

        outs, scored = self._scoring_inside(
            score, lambda token: self._worker_stages(batch[:], timer, metrics, late_token=token),
            "the first worker stage returned without scoring the rewards beside it")
        return scored, outs

    def _reward_beside_update(self, batch: DataProto, metrics: dict[str, float], timer: StageTimer) -> DataProto:
        """Stages 2 and 6 inside stage 8: the actor's update gets the batch without advantages and a late-columns
        token (`protocol.late`); it queues its first micro-batch's forward, then calls back here, on this thread,
        to score and compute the advantages while the device runs that forward. (On this thread, not a second one:
        a scoring thread would hold the GIL while the update's host code launches kernels.) Only where nothing
        else could overlap the host's scoring (`_reward_during_update`)."""
        def score() -> DataProto:
            view = batch[:]  # its own dicts: the update's batch stays as sent
            with timer("reward", sync=False):  # the forward in flight is the update's
                view = self._reward(view, metrics)
            with timer("adv", sync=False):
                metrics.update(self._advantages(view))
            return view

        def update(token: str) -> list[dict[str, float]]:
            with timer("update_actor"):
                return self.actor.update_actor(self._with_meta(batch, **{late.META_KEY: token}))

        result, scored = self._scoring_inside(score, update, "the actor update returned without taking its late "
                                                             "columns (advantages)")
        metrics |= reduce_metrics(result)
        return scored

    @staticmethod
    def _scoring_inside(score: Callable[[], DataProto], call: Callable[[str], Any], missed: str
                        ) -> tuple[Any, DataProto]:
        """`call(token)` with `score` offered under `token` (`protocol.late`): an in-process worker call that runs
        the driver's scoring on this thread while its device work is queued. (call's result, the scored batch).
        A scoring error is the error raised (not the worker's wrapper of it); a call that never scored is refused."""
        done: dict[str, Any] = {}

        def run() -> DataProto:
            try:
                done["batch"] = score()
            except BaseException as exc:
                done["error"] = exc
                raise
            return done["batch"]

        token = late.offer(run)
        try:
            result = call(token)
        except Exception:
            if "error" in done:
                raise done["error"] from None
            raise
        finally:
            late.discard(token)
        if "batch" not in done:
            raise RuntimeError(f"{missed}; set reward.overlap=false and report this")
        return result, done["batch"]

    def _reward_during_update(self) -> bool:
        """Score during the actor update when `reward.overlap` is on and there is no stage 3-5 or critic to overlap
        with (on-policy GRPO-style runs), the reward needs no worker and no decision waits on it, the actor is an
        in-process worker (local backend), its update is one mini-batch and one epoch, and the stage checks are off
        (they want the advantages at the call)."""
        res, cfg = self.res, self.cfg
        return (self._reward_may_overlap() and not self._has_worker_stages() and self.driver is None
                and self.actor.worker_group.backend_kind == "local" and not keys.checks_enabled()
                and res.actor.num_mini_batches == 1 and cfg.actor.ppo_epochs == 1)

    def _reward_may_overlap(self) -> bool:
        """`reward.overlap` is on, the reward needs no worker (a reward model) and no decision waits on it (DAPO's
        group filter)."""
        return (self.cfg.reward.overlap and not self.res.use_reward_model
                and not self.cfg.algorithm.filter_groups.enable)

    def _has_worker_stages(self) -> bool:
        """Stages 3-5 exist: old-policy log-probs, reference log-probs or critic values."""
        res = self.res
        return res.recompute_old_log_prob or res.use_reference or res.use_critic

    def _worker_stages(self, batch: DataProto, timer: StageTimer, metrics: dict[str, float],
                       device: int | None = None, late_token: str | None = None) -> list[DataProto]:
        """3. log-probs of the sampling policy, 4. reference log-probs (only when KL is used), 5. critic values:
        the outputs to union into the batch (their metrics go to `metrics`). None of them reads the rewards, so
        with `reward.overlap` the driver scores beside them: `late_token` goes to the first stage, which calls the
        scoring once its forwards are queued; or they run on a thread (`device`: the CUDA device there)."""
        if device is not None:
            torch.cuda.set_device(device)
        sent = {"token": late_token}

        def arg() -> DataProto:  # the batch, carrying the token to the first stage only
            token, sent["token"] = sent["token"], None
            return batch if token is None else self._with_meta(batch, **{late.META_KEY: token})

        outs = []
        if self.res.recompute_old_log_prob:
            with timer("old_log_prob"):
                outs.append(self.actor.compute_log_prob(arg()))
            if (is_cfg := self.cfg.algorithm.rollout_is).mode is not None:  # the actor loss applies the weights
                metrics |= rollout_is_metrics(outs[-1].batch["old_log_probs"], batch.batch["rollout_log_probs"],
                                              batch.batch["response_mask"], mode=is_cfg.mode, cap=is_cfg.cap)
        if self.res.use_reference:
            with timer("ref"):
                outs.append(self.actor.compute_ref_log_prob(arg()))
        if self.res.use_critic:
            with timer("values"):
                outs.append(self.groups.critic.compute_values(arg()))
        return outs

    def _overlap_reward(self) -> bool:
        """Score on the host while the workers run stages 3-5: when asked, when there is such a stage, and when the
        reward needs no worker (a reward model) and no decision waits on it (DAPO's group filter)."""
        return self._reward_may_overlap() and self._has_worker_stages()

    def _generate(self, batch: DataProto, metrics: dict[str, float], timer: StageTimer) -> DataProto:
        batch = self._with_seeds(batch)
        out = self.actor.generate_sequences(batch)
        metrics |= reduce_metrics(out.meta_info.pop("metrics", []))  # timing/switch, timing/generate per rank
        if self.cfg.algorithm.adv_estimator == "remax":  # greedy baseline response per prompt
            greedy = self.actor.generate_sequences(self._with_meta(batch, do_sample=False, n=1))
            greedy.meta_info.pop("metrics", None)
            scores, _ = self.reward_fn(greedy)
            out.batch["baseline_rewards"] = scores.sum(-1).repeat_interleave(self.cfg.rollout.n)
        return out

    def _with_seeds(self, batch: DataProto) -> DataProto:
        """One sampling seed per prompt, from (rollout.seed, step, row): the same responses whatever the split
        across data-parallel ranks, so 1 and N ranks (or a resumed run) generate identically."""
        base = (self.cfg.rollout.seed * 1_000_003 + self.global_step * 7_919 + self._gen_calls) * 1_000_033
        self._gen_calls += 1
        view = batch[:]
        view.batch = {**batch.batch, "seeds": torch.arange(len(batch), dtype=torch.long) + base % (2**62)}
        return view

    @staticmethod
    def _with_meta(batch: DataProto, **meta: Any) -> DataProto:
        view = batch[:]
        view.meta_info = {**batch.meta_info, **meta}
        return view

    @keys.checked_stage(keys.REWARD)
    def _reward(self, batch: DataProto, metrics: dict[str, float]) -> DataProto:
        if self.res.use_reward_model:
            batch = batch.union(self.groups.reward_model.compute_rm_score(batch))
        scores, reward_metrics = self.reward_fn(batch)
        if keys.TURN_REWARDS.name in batch.batch:  # multi-turn: tool/interaction rewards at each turn's end
            turn = batch.batch[keys.TURN_REWARDS.name].to(scores.dtype)
            scores = scores + turn
            reward_metrics["reward/turn_rewards/mean"] = float(turn.sum(-1).mean())
        batch.batch["token_level_scores"] = scores
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
                batch = self._reward(batch, round_metrics := {})
            scored.append((len(batch), round_metrics))
            groups.add(batch)
            tries += 1
            if groups.full or tries >= self.cfg.algorithm.filter_groups.max_num_gen_batches:
                break
            with timer("gen"):
                batch = self._generate(next(self._extra_batches()), metrics, timer)
        metrics |= combine_reward_metrics(scored)
        return groups.batch(metrics, tries)

    def _extra_batches(self) -> Iterator[DataProto]:
        if not hasattr(self, "_extra_iter"):
            self._extra_iter = iter(self._batches_forever())
        return self._extra_iter

    def _batches_forever(self) -> Iterator[DataProto]:
        """DAPO's extra prompts: a loader of their own (shuffled with data.seed + 1, uids `<name>-extra-e<epoch>-i`),
        so extras neither repeat the batches the run trains next nor move its saved data position, and a prompt
        drawn twice into one batch never merges two groups."""
        from hybridflow.data import make_dataloader

        cfg = self.cfg.data
        loader = make_dataloader(self.train_ds, cfg, cfg.train_batch_size, shuffle=cfg.shuffle,
                                 drop_last=cfg.drop_last, seed=cfg.seed + 1, name=f"{self.loader.name}-extra")
        while True:
            yield from loader

    def _balance(self, batch: DataProto) -> DataProto:
        if self.res.world_size <= 1:
            return batch
        batch.reorder(balanced_order(batch.batch["attention_mask"].sum(-1), self.res.world_size))
        return batch

    @keys.checked_stage(keys.ADV)
    def _advantages(self, batch: DataProto) -> dict[str, float]:
        alg, b, metrics = self.cfg.algorithm, batch.batch, {}
        mask = b["response_mask"]
        if self.res.use_reference and keys.OLD_LOG_PROBS.name in b:  # else the KL loss's actor/kl_loss measures it
            kl = kl_penalty(b[keys.OLD_LOG_PROBS.name], b["ref_log_prob"], alg.kl_penalty)
            metrics["kl/actor_ref"] = float(masked_mean(kl, mask))
        if alg.use_kl_in_reward:
            rewards, kl_metrics = apply_kl_penalty(b["token_level_scores"], keys.sampling_log_probs(b),
                                                   b["ref_log_prob"], mask, self.kl_ctrl, alg.kl_penalty)
            b["token_level_rewards"] = rewards
            metrics |= kl_metrics
        else:
            b["token_level_rewards"] = b["token_level_scores"]
        metrics["kl/coef"] = float(self.kl_ctrl.value)
        adv, ret = compute_advantage(
            alg.adv_estimator, token_level_rewards=b["token_level_rewards"], response_mask=mask,
            index=batch.non_tensor_batch["uid"], values=b.get("values"), gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std=alg.norm_adv_by_std, baseline_rewards=b.get("baseline_rewards"),
        )
        b["advantages"], b["returns"] = adv, ret
        return metrics


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


def _cuda_device() -> int | None:
    """The driver thread's CUDA device (a new thread starts on device 0), or None without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
