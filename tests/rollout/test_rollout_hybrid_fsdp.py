"""Hybrid engine on the FSDP2 TrainEngine (world size 1, gloo): zero-copy views, trainer-equal log-probs, and a
training step that changes the next generation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from rollout_helpers import EOS, PAD, make_prompts

from hybridflow.config import load_config
from hybridflow.engine import HeadRequest, TrainEngine, UpdatePlan, train_update
from hybridflow.rollout import RolloutEngine
from hybridflow.workers.engine_specs import actor_spec


@pytest.fixture(scope="module")
def train_engine():
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = load_config([], ["actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8"])
    yield cfg, TrainEngine(actor_spec(cfg), device="cpu")
    if own:
        dist.destroy_process_group()


def test_hybrid_engine_on_fsdp2(train_engine):
    cfg, engine = train_engine
    module = engine.module
    rollout = RolloutEngine(module, dataclasses.replace(cfg.rollout, free_cache_engine=False), eos_token_id=EOS,
                            pad_token_id=PAD, max_prompt_length=12, max_response_length=10)
    rollout.sync_weights()
    q = module.model.layers[0].self_attn.q_proj.weight
    assert hasattr(q, "to_local")  # really an FSDP2 DTensor parameter
    assert rollout._weights.layers[0].q.data_ptr() == q.to_local().data_ptr()  # zero copy on one rank

    prompts = make_prompts(4, 12, module.config.vocab_size, meta={"n": 2, "temperature": 0.8, "seeds": [1, 2, 3, 4]})
    out = rollout.generate(prompts)
    ref = engine.infer(out, HeadRequest("lm", temperature=0.8))["log_probs"]
    mask = out.batch["response_mask"]
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref * mask, atol=1e-4, rtol=0)

    def loss_fn(outputs, micro, norm):  # push up the sampled responses: a deliberate weight update
        logp = outputs["log_probs"]
        return -(logp * micro.batch["response_mask"]).sum() / norm["token-mean"], {}

    train_update(engine, out, loss_fn, HeadRequest("lm", temperature=1.0), UpdatePlan(8, shuffle=True))
    rollout.sync_weights()
    assert rollout._weights.layers[0].q.data_ptr() == q.to_local().data_ptr()
    again = rollout.generate(prompts)
    assert not torch.allclose(again.batch["rollout_log_probs"], out.batch["rollout_log_probs"])
    ref2 = engine.infer(again, HeadRequest("lm", temperature=0.8))["log_probs"]
    torch.testing.assert_close(again.batch["rollout_log_probs"], ref2 * again.batch["response_mask"],
                               atol=1e-4, rtol=0)
