"""`RolloutEngine`: generation on the actor's own parameters (hybrid engine) behind the DataProto contract.

In: `input_ids`/`attention_mask`/`position_ids` [B, P], left-padded; meta_info may override sampling (`n`,
`do_sample`, `temperature`, `top_k`, `top_p`, `max_new_tokens`, `seeds`, `validate`). Out (B*n rows, prompt i's
samples at rows i*n..i*n+n-1): `prompts`, `responses`, `response_mask`, `rollout_log_probs`, `input_ids`,
`attention_mask`, `position_ids`; with a `weight_check` (partial rollouts, rollout/versions.py) also
`rollout_policy_version` [B*n, R], the policy version that sampled each token; with an MoE model
`routed_experts`, the experts prefill and each decode step chose (multi-turn: `_routing`). With `rollout.agent.mode=server` the
rows come from agents talking to an OpenAI-compatible endpoint over this engine (`agent_rollout.py`). Mode switch: `sync_weights()` after each optimizer step (zero-copy views are
only re-checked; cast/gathered copies are refreshed), `release_cache()` when going back to training. With
`tp` (a `TPContext`, rollout.tensor_model_parallel_size ranks) each rank of the group holds its slices of the weights
and of the KV cache, and every rank of the group returns the same rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hybridflow.data.vision import vision_column
from hybridflow.protocol import DataProto, keys
from hybridflow.rollout import exact_forward, fp8, moe, vision
from hybridflow.rollout.forward import DecodeOps, RopeTable, prefill
from hybridflow.rollout.hf_fallback import HFGenerate
from hybridflow.rollout.kv_cache import KVCache, plan_slots
from hybridflow.rollout.model_runner import ModelRunner
from hybridflow.rollout.multi_turn import MultiTurnResult, MultiTurnScheduler
from hybridflow.rollout.sampling import SamplingParams, ShardedSampler, build_sampler, row_seed
from hybridflow.rollout.scheduler import GenerateResult, Scheduler
from hybridflow.rollout.tensor_parallel import TPContext, reference_slices
from hybridflow.rollout.weights import ModelWeights, WeightView, arch_spec, check_parallel, unsupported_reason
from hybridflow.utils.tokenizer_protocol import Tokenizer

if TYPE_CHECKING:
    from hybridflow.config.schema import RolloutConfig

logger = logging.getLogger(__name__)


def _module_device(module: nn.Module) -> torch.device:
    p = next(module.parameters())
    return p.to_local().device if hasattr(p, "to_local") else p.device


class RolloutEngine:
    """Continuous-batching generation over `module`'s parameters; falls back to HF generate when unsupported."""

    def __init__(self, module: nn.Module, rollout_cfg: RolloutConfig, *, eos_token_id: int | Sequence[int],
                 pad_token_id: int, max_prompt_length: int, max_response_length: int,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 compile_decode: bool | None = None, check_every: int | None = None,
                 tokenizer: Tokenizer | None = None, chat_template: str | None = None,
                 tp: TPContext | None = None, exact_logprobs: bool = False) -> None:
        self.cfg = rollout_cfg
        self.exact = exact_logprobs  # actor_rollout.exact_logprobs: the trainer's log-prob bits (exact_forward.py)
        size = 1 if tp is None else tp.size
        if size != rollout_cfg.tensor_model_parallel_size:
            raise ValueError(f"rollout.tensor_model_parallel_size={rollout_cfg.tensor_model_parallel_size} but the "
                             f"engine was given a tensor-parallel group of {size}: the workers build the group from "
                             "that key (pass tp=TPContext(...) of that size)")
        self.tp = tp if size > 1 else None
        check_parallel(module, rollout_cfg)
        # None unless rollout.multi_turn.enable; `chat_template` = data.chat_template (user/tool turns follow it)
        self.session = _tool_session(rollout_cfg, tokenizer, chat_template)
        self.agent = _agent_rollout(rollout_cfg, tokenizer, chat_template, pad_token_id, max_prompt_length,
                                    max_response_length)
        self.eos_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
        self.pad_id, self.P, self.R = int(pad_token_id), int(max_prompt_length), int(max_response_length)
        self.device = torch.device(device) if device is not None else _module_device(module)
        self._dtype_arg = dtype
        on_gpu = self.device.type == "cuda"
        self.use_graphs = on_gpu and not rollout_cfg.enforce_eager
        self.compile_decode = (on_gpu and not rollout_cfg.enforce_eager) if compile_decode is None else compile_decode
        self.check_every = check_every or (8 if on_gpu else 1)
        self._calls = 0
        self._weights_stamp = 0  # sync_weights calls: which weights the module holds, for partial rollouts
        self.timing: dict[str, float] = {}  # the last generate's timings (seconds), also in its meta_info["metrics"]
        self.bind(module)

    # ------------------------------------------------------------------------------------------- hybrid engine
    def bind(self, module: nn.Module) -> None:
        """Point the engine at a (possibly FSDP2-wrapped) HF causal LM; drops any previous cache and views."""
        self.release_cache()
        self.module = module
        self._view: WeightView | None = None
        reason = "rollout.name=hf" if self.cfg.name == "hf" else unsupported_reason(module, self.P + self.R)
        self._vl = reason is None and vision.is_vision_language(module)  # images through our prefill (vision.py)
        if self._vl:
            vision.check_options(self.cfg, exact=self.exact, multi_turn=self.session is not None)
        self._fallback = HFGenerate(module, reason, eos_ids=self.eos_ids, pad_id=self.pad_id,
                                    max_new_tokens=self.R) if reason else None
        if self._fallback is not None and self.agent is not None:
            raise ValueError(f"rollout.agent.mode=server needs our engine, but it falls back to HF generate "
                             f"({reason}); use a supported (Llama-family) model")
        if self.tp is not None and (self._fallback is not None or self.agent is not None):
            raise ValueError(f"rollout.tensor_model_parallel_size={self.tp.size} needs our engine on a "
                             f"Llama-family model ({reason or 'rollout.agent.mode=server is per rank'}); set it to 1")
        if self.exact and (self._fallback is not None or self.tp is not None):
            raise ValueError(f"actor_rollout.exact_logprobs=true needs our engine on one rank "
                             f"({reason or 'rollout.tensor_model_parallel_size > 1'}); set it to false")
        if self._fallback is not None and self.session is not None:
            raise ValueError(f"rollout.multi_turn.enable=true needs our engine, but it falls back to HF generate "
                             f"({reason}); disable multi_turn or use a supported (Llama-family) model")
        if self._fallback is None:
            param_dtype = next(module.parameters()).dtype
            self.dtype = self._dtype_arg or (torch.bfloat16 if self.device.type == "cuda" else param_dtype)
            if self.dtype != param_dtype:
                logger.info("rollout: generation in %s from %s parameters (cast into reused buffers at each "
                            "sync_weights)", self.dtype, param_dtype)
            self.spec = arch_spec(module, self.dtype) if self.tp is None else self.tp.local
            self._view = WeightView(module, self.dtype, self.device) if self.tp is None else None
        self._fp8: fp8.Fp8Weights | None = None
        if self.cfg.quantization == "fp8":
            gemm = fp8.select_gemm()
            fp8.check_supported(module, fallback_reason=reason, tp_size=self.cfg.tensor_model_parallel_size,
                                device=self.device, dtype=None if self._fallback else self.dtype, gemm=gemm)
            self._fp8 = fp8.Fp8Weights()
            logger.info("rollout: fp8 decoder projections (per-channel weight, per-token activation scales; "
                        "GEMM %s, %s)", gemm, fp8.GEMM_ENV)
        self._weights: ModelWeights | None = None
        self._runner: ModelRunner | None = None

    def sync_weights(self, local: dict[str, torch.Tensor] | None = None) -> float:
        """Make the next generate use the module's current parameters; returns seconds spent. (The worker's
        `timing/switch` times the whole train↔generate switch around it.) Tensor parallel: `local` = this rank's
        slices {HF parameter name: tensor} (`weights.tp_model_weights`); None = cut from the whole module (as a generate
        after `release_cache` does: give the slices again first when the module is sharded)."""
        self._weights_stamp += 1  # new weights: a partial rollout's images are encoded again (vision.py)
        return self._sync(local)

    def _sync(self, local: dict[str, torch.Tensor] | None = None) -> float:
        if self._fallback is not None:
            return 0.0
        t0 = time.perf_counter()
        with torch.no_grad():
            if self.tp is None:
                self._weights = self._view.build()
                if self._fp8 is not None:  # after the LoRA merge, into the same buffers each switch
                    self._weights = self._fp8.quantize(self._weights)
            else:
                local = reference_slices(self.module, self.tp) if local is None else local
                self._weights = self.tp.model_weights(local, self.dtype, self.device)
        if self._runner is not None:
            self._runner.set_weights(self._weights)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def release_cache(self) -> None:
        """Free the KV cache, CUDA graphs, cast/gather buffers and our references to the parameters (so an
        offloaded or resharded actor really frees its memory); the next generate rebuilds them."""
        if getattr(self, "_runner", None) is None and getattr(self, "_weights", None) is None:
            return
        self._runner = None
        self._weights = None
        if getattr(self, "_view", None) is not None:
            self._view.release()
        if getattr(self, "_fp8", None) is not None:  # the runner and its graphs are gone: give training the memory
            self._fp8.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def close(self) -> None:
        """Stop the agent endpoint (rollout.agent.mode=server) and free the cache."""
        if self.agent is not None:
            self.agent.close()
        self.release_cache()

    def _prepare(self) -> ModelRunner:
        if self._weights is None:
            self._sync()
        self.timing["timing/rollout_cache_alloc"] = 0.0
        if self._runner is None:
            t0 = time.perf_counter()
            max_len = self.P + self.R
            slots = plan_slots(self.spec, max_len, self.dtype, self.device, max_num_seqs=self.cfg.max_num_seqs,
                               kv_cache_tokens=self.cfg.kv_cache_tokens,
                               gpu_memory_utilization=self.cfg.gpu_memory_utilization)
            if self.tp is not None:
                slots = self.tp.agree_min(slots, self.device)
            cache = KVCache(self.spec, slots, max_len, self.dtype, self.device)
            rope = RopeTable(self.module, cache.max_len, self.dtype, self.device)
            # the forward's pieces and the sampler, chosen once for this device (torch, compiled, Triton)
            ops = DecodeOps.for_device(self.device, self.compile_decode)
            sampler = build_sampler(self.device, self.compile_decode) if self.tp is None else ShardedSampler(self.tp)
            if self.exact and (why := exact_forward.unsupported(self._weights, self.spec)):
                raise ValueError(f"actor_rollout.exact_logprobs=true does not support {why}; set it to false")
            cfg = self.module.config
            self._runner = ModelRunner(self.spec, self._weights, rope, cache, pad_id=self.pad_id, max_new_tokens=self.R,
                                       use_graphs=self.use_graphs, ops=ops, sampler=sampler, tp=self.tp,
                                       exact=self.exact, image_token_id=getattr(cfg, "image_token_id", None),
                                       suppress=vision.suppressed_ids(cfg) if self._vl else ())
            self.timing["timing/rollout_cache_alloc"] = time.perf_counter() - t0
        return self._runner

    def state_dict(self) -> dict[str, int]:
        """What resuming needs for bit-exact sampling: default seeds derive from the number of generate calls."""
        return {"calls": self._calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._calls = int(state["calls"])

    # ------------------------------------------------------------------------------------------------ generate
    def sampling_for(self, meta: dict[str, Any], sampling: SamplingParams | None) -> SamplingParams:
        base = sampling or SamplingParams.from_config(self.cfg, validate=bool(meta.get("validate", False)))
        return base.with_overrides(meta)

    def _row_seeds(self, meta: dict[str, Any], params: SamplingParams, B: int) -> list[int]:
        n = params.n
        seeds = meta.get(keys.SEEDS)
        if seeds is None:  # fresh per call and per data-parallel rank, reproducible from rollout.seed
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            rank = rank if self.tp is None else self.tp.first_rank  # one set of seeds per tensor-parallel group
            base = row_seed(row_seed(params.seed, self._calls), rank)
            return [row_seed(base, i * n + j) for i in range(B) for j in range(n)]
        seeds = [int(s) for s in (seeds.tolist() if hasattr(seeds, "tolist") else seeds)]
        if len(seeds) == B * n and n > 1:  # one seed per output row; equals per-prompt seeds when n == 1
            return [row_seed(s, 0) for s in seeds]
        if len(seeds) != B:
            raise ValueError(f"meta_info['seeds'] has {len(seeds)} entries; give one per prompt ({B}) "
                             f"or one per output row ({B * n})")
        return [row_seed(s, j) for s in seeds for j in range(n)]

    @property
    def uses_hf_fallback(self) -> bool:
        """True when this model generates through HF `generate` (an architecture our engine does not cover)."""
        return self._fallback is not None

    def generate(self, prompts: DataProto, sampling: SamplingParams | None = None,
                 weight_check: Callable[[], int] | None = None) -> DataProto:
        """`weight_check`: called before each decode chunk (every `check_every` steps); it may install new weights
        (the caller then ran `sync_weights`) and returns their policy version: sequences in flight continue under
        them. HF generate (the fallback) and the agent endpoint ask once, at the start."""
        meta = dict(prompts.meta_info)
        params = self.sampling_for(meta, sampling)
        ids, mask = prompts.batch[keys.INPUT_IDS], prompts.batch[keys.ATTENTION_MASK]
        pos = prompts.batch.get(keys.POSITION_IDS)
        if pos is None:
            pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
        B, P = ids.shape
        if P > self.P:
            raise ValueError(f"prompts are {P} tokens wide > max_prompt_length={self.P}; raise "
                             "data.max_prompt_length or truncate the prompts")
        bad = (mask[:, 1:].long() < mask[:, :-1].long()).any(-1).nonzero()
        if len(bad):
            raise ValueError(f"prompt row {int(bad[0])} is not left-padded (attention_mask has a 0 after a 1); "
                             "the rollout expects left padding — pad prompts on the left, as RLHFDataset does")
        images = vision_column(prompts.non_tensor_batch)
        if self._fallback is None and not self._vl and images is not None and any(images):
            raise ValueError("prompts carry images (multi_modal_inputs) but the model is text-only; use a "
                             "vision-language model (model.preset=tiny-vl or a Qwen2.5-VL directory)")
        max_new = min(params.max_new_tokens or self.R, self.R)
        seeds = self._row_seeds(meta, params, B)
        self._calls += 1
        dev_in = ids.device
        ids_d, mask_d, pos_d = (t.to(self.device) for t in (ids, mask, pos))
        t0 = time.perf_counter()
        self.timing = {}
        if self._fallback is not None:
            version = None if weight_check is None else int(weight_check())
            res = self._fallback.run(ids_d, mask_d, params.n, params, seeds, max_new, images)
            if version is not None:
                res.versions = torch.full_like(res.tokens, version)
        elif self.agent is not None:
            # the endpoint takes weights between generate calls only (partial_rollout=continue is refused at load):
            # asked once, at the start, as the fallback does
            version = None if weight_check is None else int(weight_check())
            out, metrics = self.agent.generate(self._prepare(), prompts, params, eos_ids=self.eos_ids,
                                               check_every=self.check_every)
            if version is not None:
                out.batch[keys.ROLLOUT_POLICY_VERSION] = torch.full_like(out.batch[keys.RESPONSES], version)
            self.timing["timing/generate"] = time.perf_counter() - t0
            out.meta_info = {**meta, "metrics": {**self.timing, **metrics}}
            if self.cfg.free_cache_engine:
                self.release_cache()
            return out.to(dev_in)
        else:
            kw = {}
            if self._vl:  # the vision tower, once per prompt, before the KV cache takes its share of the memory
                t_vis = time.perf_counter()
                stamp = None if weight_check is None else (lambda: self._weights_stamp)
                kw["images"] = vision.encode(self.module, ids_d, mask_d, images, self.dtype, stamp)
                self.timing["timing/rollout_vision"] = time.perf_counter() - t_vis
            runner = self._prepare()
            runner.set_sampling(params, self.eos_ids)
            sched = Scheduler(runner, max_num_batched_tokens=self.cfg.max_num_batched_tokens,
                              check_every=self.check_every)
            if self.session is not None:
                sched, (ids_d, mask_d, pos_d) = self._multi_turn_scheduler(runner, prompts, params.n,
                                                                            ids_d, mask_d, pos_d)
            runner.capture_s = 0.0
            res = sched.run(ids_d, mask_d, pos_d, params.n, seeds, max_new, weight_check, **kw)
            self.timing["timing/rollout_graph_capture"] = runner.capture_s
        self.timing["timing/generate"] = time.perf_counter() - t0
        out = self._assemble(ids_d, mask_d, pos_d, params.n, res)
        if res.routes is not None and not isinstance(res, MultiTurnResult):
            out.batch[keys.ROUTED_EXPERTS.name] = res.routes  # recorded by prefill and each decode step
        elif self._fallback is None and moe.has_moe(self._weights.layers):
            out.batch[keys.ROUTED_EXPERTS.name] = self._routing(out)
        out = out.to(dev_in)
        out.non_tensor_batch = {k: np.repeat(v, params.n, axis=0) for k, v in prompts.non_tensor_batch.items()}
        metrics = {**self.timing, "rollout/decode_steps": res.decode_steps, "rollout/prefills": res.prefills}
        if res.versions is not None:
            metrics["rollout/weight_swaps"] = res.weight_swaps
        if isinstance(res, MultiTurnResult):
            metrics |= self.session.metrics() | {"rollout/extend_tokens": res.extend_tokens,
                                                 "timing/tool_wait": res.tool_wait_s}
        out.meta_info = {**meta, "metrics": metrics}
        if self.cfg.free_cache_engine:
            self.release_cache()
        return out

    def _routing(self, out: DataProto) -> torch.Tensor:
        """`routed_experts` of multi-turn rows (whose extensions are not recorded): the experts this engine's
        forward picks for each token, recomputed by one prefill pass over the rows with the rollout's weights and
        dtype after decoding (decode's batch shapes may round differently: rare flips at near-ties)."""
        t0 = time.perf_counter()
        r, b = self._runner, out.batch
        none = torch.zeros(0, dtype=torch.long, device=self.device)
        rows = max(1, self.cfg.max_num_batched_tokens // b[keys.INPUT_IDS].shape[1])
        with torch.no_grad():
            routes = moe.record_routes(
                lambda ids, mask, pos: prefill(r.weights, r.spec, r.rope, ids, mask, pos, r.cache, none, none),
                r.weights.layers, b[keys.INPUT_IDS], b[keys.ATTENTION_MASK], b[keys.POSITION_IDS], rows)
        self.timing["timing/rollout_routing"] = time.perf_counter() - t0
        return routes

    def _assemble(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, n: int,
                  res: GenerateResult) -> DataProto:
        R = self.R
        ids_n, mask_n, pos_n = (t.repeat_interleave(n, 0) for t in (ids, mask, pos))
        resp_mask = (torch.arange(R, device=ids.device)[None] < res.lengths[:, None]).to(mask.dtype)
        resp_pos = pos_n[:, -1:] + torch.arange(1, R + 1, device=ids.device)[None]
        # multi-turn: appended tool/user tokens are context (attended to), not trained on
        loss_mask = res.model_mask.to(mask.dtype) if isinstance(res, MultiTurnResult) else resp_mask
        out = {
            keys.PROMPTS: ids_n,
            keys.RESPONSES: res.tokens,
            keys.RESPONSE_MASK: loss_mask,
            keys.ROLLOUT_LOG_PROBS: res.log_probs * loss_mask,
            keys.INPUT_IDS: torch.cat([ids_n, res.tokens], dim=1),
            keys.ATTENTION_MASK: torch.cat([mask_n, resp_mask], dim=1),
            keys.POSITION_IDS: torch.cat([pos_n, resp_pos], dim=1),
        }
        if isinstance(res, MultiTurnResult):
            out[keys.TURN_REWARDS] = res.turn_rewards
        if res.versions is not None:
            out[keys.ROLLOUT_POLICY_VERSION] = res.versions
        return DataProto.from_single_dict(out)

    def _multi_turn_scheduler(self, runner: ModelRunner, prompts: DataProto, n: int, ids: torch.Tensor,
                              mask: torch.Tensor, pos: torch.Tensor
                              ) -> tuple[MultiTurnScheduler, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Start the session's rows; with interactions configured, the prompts get each interaction's first user
        message and are left-padded to data.max_prompt_length (the same width on every rank)."""
        extra = prompts.non_tensor_batch.get(keys.EXTRA_INFO)
        rows = len(prompts) * n
        first = self.session.begin([None] * rows if extra is None else list(np.repeat(extra, n, axis=0)))
        if self.session.interactions:
            ids, mask, pos = self._with_first_messages(first, n, ids, mask)
        sched = MultiTurnScheduler(runner, self.session, max_num_batched_tokens=self.cfg.max_num_batched_tokens,
                                   check_every=self.check_every)
        return sched, (ids, mask, pos)

    def _with_first_messages(self, first: list[str | None], n: int, ids: torch.Tensor, mask: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = []
        for i in range(ids.shape[0]):
            group = set(first[i * n: (i + 1) * n])
            if len(group) > 1:
                raise ValueError(f"prompt {i}: Interaction.reset returned different first messages for its "
                                 f"{n} samples ({sorted(map(repr, group))[:2]}); GRPO compares the samples of one "
                                 "prompt, so derive the first message from interaction_kwargs only")
            prompt = ids[i][mask[i].bool()].tolist()
            msg = group.pop()
            rows.append(prompt if msg is None else self.session.first_message_ids(msg, prompt))
            if len(rows[-1]) > self.P:
                raise ValueError(f"prompt {i} with its interaction's first message is {len(rows[-1])} tokens > "
                                 f"data.max_prompt_length={self.P}; raise data.max_prompt_length (the first "
                                 "message becomes part of the prompt)")
        new_ids = torch.full((len(rows), self.P), self.pad_id, dtype=torch.long, device=ids.device)
        new_mask = torch.zeros((len(rows), self.P), dtype=mask.dtype, device=ids.device)
        for i, row in enumerate(rows):
            new_ids[i, self.P - len(row):] = torch.tensor(row, dtype=torch.long, device=ids.device)
            new_mask[i, self.P - len(row):] = 1
        return new_ids, new_mask, (new_mask.long().cumsum(-1) - 1).clamp(min=0)


def _tool_session(rollout_cfg: RolloutConfig, tokenizer: Tokenizer | None, chat_template: str | None = None):
    mt = getattr(rollout_cfg, "multi_turn", None)
    if mt is None or not mt.enable:
        return None
    if tokenizer is None:
        raise ValueError("rollout.multi_turn.enable=true needs the tokenizer (to read tool calls and encode tool "
                         "responses): pass tokenizer= to RolloutEngine/build_rollout")
    from hybridflow.agentic.session import ToolSession

    return ToolSession.from_config(mt, tokenizer, chat_template)


def _agent_rollout(rollout_cfg: RolloutConfig, tokenizer: Tokenizer | None, chat_template: str | None, pad_id: int,
                   P: int, R: int):
    agent = getattr(rollout_cfg, "agent", None)
    if agent is None or agent.mode != "server":
        return None
    from hybridflow.rollout.agent_rollout import AgentRollout  # imports openai and aiohttp, only when used

    return AgentRollout(agent, tokenizer, chat_template, pad_id=int(pad_id), P=int(P), R=int(R))


def build_rollout(module: nn.Module, rollout_cfg: RolloutConfig, **kwargs: Any) -> RolloutEngine:
    """Factory the workers call; keyword arguments as `RolloutEngine`."""
    return RolloutEngine(module, rollout_cfg, **kwargs)
