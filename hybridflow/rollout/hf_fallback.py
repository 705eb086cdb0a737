"""HF `generate` behind the rollout interface: for architectures our runner does not cover, and `rollout.name=hf`.

Slow but general. Log-probs come from the *processed* scores (after temperature/top-k/top-p), i.e. the sampling
distribution, like the native engine. Per-request seeds are not supported here: one global seed per call.
Vision-language models generate here: each row's images (`multi_modal_inputs`, repeated for its n samples) go to
HF generate, which runs the vision tower once in prefill and continues the 3-D rope positions while decoding.
Their vision tokens (image pad, vision start/end) are never sampled: a response holding an image pad would no
longer match its images when the trainer feeds the sequence back (the log-probs are those of the sampler, as above).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import GenerationConfig

from hybridflow.data.vision import batch_vision_inputs
from hybridflow.rollout.sampling import SamplingParams
from hybridflow.rollout.scheduler import GenerateResult
from hybridflow.rollout.vision import suppressed_ids

logger = logging.getLogger(__name__)


def synced_ranks(module: nn.Module) -> bool:
    """HF's `synced_gpus` for `module`: FSDP2 all-gathers each layer's weights in every forward, so a rank whose rows
    have all stopped must keep stepping until every rank's have, or the others wait in an all-gather for good.
    Passed explicitly: left unset, transformers infers it from `_is_fsdp_managed_module`, a private attribute that
    torch's `fully_shard` sets for Dynamo. HF's stop vote is an all-reduce over the default group, which is also our
    FSDP mesh (engine/fsdp.py `build_mesh`)."""
    return isinstance(module, FSDPModule) and dist.is_initialized() and dist.get_world_size() > 1


class HFGenerate:
    def __init__(self, module: nn.Module, reason: str, *, eos_ids: list[int], pad_id: int, max_new_tokens: int) -> None:
        logger.warning("rollout: falling back to transformers generate (slow) because %s", reason)
        self.module, self.eos_ids, self.pad_id, self.R = module, eos_ids, pad_id, max_new_tokens
        self.suppress = suppressed_ids(module.config)
        self.synced = synced_ranks(module)

    def _config(self, p: SamplingParams, max_new: int) -> GenerationConfig:
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_ids)
        kw: dict = dict(max_new_tokens=max_new, do_sample=p.do_sample, pad_token_id=self.pad_id,
                        eos_token_id=sorted(set(stops)) or None, output_scores=True, return_dict_in_generate=True)
        if self.suppress:
            kw["suppress_tokens"] = self.suppress
        if p.do_sample:
            kw.update(temperature=p.temperature, top_k=p.top_k if p.top_k > 0 else 0, top_p=p.top_p)
        return GenerationConfig(**kw)

    @torch.no_grad()
    def run(self, ids_BP: torch.Tensor, mask_BP: torch.Tensor, n: int, params: SamplingParams, seeds: list[int],
            max_new: int, images: list[dict[str, torch.Tensor]] | None = None) -> GenerateResult:
        """`images`: each prompt's `multi_modal_inputs` (vision-language models)."""
        if params.do_sample:
            logger.debug("HF fallback: per-request seeds unsupported; seeding the global RNG with %d", seeds[0])
            torch.manual_seed(seeds[0])
        ids, mask = ids_BP.repeat_interleave(n, 0), mask_BP.repeat_interleave(n, 0)
        rows = None if images is None else [row for row in images for _ in range(n)]
        vision = batch_vision_inputs(rows, ids, getattr(self.module.config, "image_token_id", None))
        vision = {k: v.to(ids.device) for k, v in vision.items()}
        # HF generate runs the vision tower before the root module's first forward: gather the root's parameters
        # (the vision tower's among them) first when FSDP2 shards them
        sharded = bool(vision) and isinstance(self.module, FSDPModule)
        if sharded:
            self.module.unshard()
        try:
            out = self.module.generate(input_ids=ids, attention_mask=mask, synced_gpus=self.synced,
                                       generation_config=self._config(params, max_new), **vision)
        finally:
            if sharded:
                self.module.reshard()
        gen = out.sequences[:, ids.shape[1]:]
        L = gen.shape[1]
        logp = torch.stack(out.scores, dim=1).float().log_softmax(-1).gather(-1, gen[..., None]).squeeze(-1)
        stops = torch.tensor(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))),
                             dtype=torch.long, device=gen.device)
        is_stop = torch.isin(gen, stops) if stops.numel() else torch.zeros_like(gen, dtype=torch.bool)
        first = torch.where(is_stop.any(1), is_stop.float().argmax(1) + 1, torch.full_like(gen[:, 0], L))
        keep = torch.arange(L, device=gen.device)[None] < first[:, None]
        tokens = torch.full((gen.shape[0], self.R), self.pad_id, dtype=torch.long, device=gen.device)
        log_probs = torch.zeros(gen.shape[0], self.R, dtype=torch.float32, device=gen.device)
        tokens[:, :L] = torch.where(keep, gen, self.pad_id)
        log_probs[:, :L] = torch.where(keep, logp, 0.0)
        return GenerateResult(tokens, log_probs, first, decode_steps=L, prefills=1)
