"""Two gloo ranks generating with HF `generate` (the fallback, `rollout.name=hf`) from the actor's FSDP2 module, where
rank 0's rows meet an eos after a few tokens and rank 1's never do: rank 0 must keep stepping (HF's `synced_gpus`),
since every forward all-gathers the layers' weights, and each rank gets what it would get alone."""

import datetime
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from ranks_testlib import run_ranks
from torch.distributed.fsdp import FSDPModule

HERE = str(Path(__file__).parent)
B, P, R = 2, 8, 8


def _generate(module, eos_ids: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Greedy HF-fallback generation of this rank's prompts (seed = the rank)."""
    from rollout_helpers import PAD, make_prompts, rollout_cfg

    from hybridflow.rollout import RolloutEngine

    rollout = RolloutEngine(module, rollout_cfg(name="hf", free_cache_engine=False), eos_token_id=eos_ids,
                            pad_token_id=PAD, max_prompt_length=P, max_response_length=R)
    # sharded over both ranks, and only then, generate keeps stepping until both ranks' rows have stopped
    assert rollout._fallback.synced == isinstance(module, FSDPModule), type(module)
    out = rollout.generate(make_prompts(B, P, module.config.vocab_size, seed=seed, meta={"do_sample": False}))
    return {k: out.batch[k] for k in ("responses", "response_mask", "rollout_log_probs")}


def _plain_copy(module) -> torch.nn.Module:
    """The FSDP2 module's weights in an unsharded HF model (a collective: every rank calls it)."""
    from transformers import AutoModelForCausalLM

    full = {n: p.full_tensor().detach() for n, p in module.named_parameters()}
    plain = AutoModelForCausalLM.from_config(module.config).eval()
    missing, unexpected = plain.load_state_dict(full, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied: one name for both
    return plain


def _eos_for_rank0_only(plain, rank: int) -> list[int]:
    """Eos ids that end every rank-0 row after its first few tokens and none of rank 1's: both ranks' greedy
    continuations without an eos (each alone), gathered; the earliest step whose tokens rank 1 never produces."""
    from rollout_helpers import PAD

    own = _generate(plain, [PAD], seed=rank)["responses"].tolist()  # PAD never wins greedily: the full R tokens
    both: list[list[list[int]]] = [[], []]
    dist.all_gather_object(both, own)
    rank1 = {t for row in both[1] for t in row}
    for step in range(1, R - 2):
        eos = sorted({row[step] for row in both[0]})
        if not rank1 & set(eos) and PAD not in eos:
            return eos
    raise AssertionError(f"no step of rank 0's continuations {both[0]} avoids rank 1's tokens {sorted(rank1)}")


def _worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    # A rank left waiting in an all-gather fails after the timeout instead of hanging for good.
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    sys.path.insert(0, HERE)
    from hybridflow.config import load_config
    from hybridflow.engine import TrainEngine
    from hybridflow.workers.engine_specs import actor_spec

    cfg = load_config([], ["actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=1"])
    engine = TrainEngine(actor_spec(cfg), device="cpu")
    plain = _plain_copy(engine.module)
    eos = _eos_for_rank0_only(plain, rank)
    alone = _generate(plain, eos, seed=rank)
    sharded = _generate(engine.module, eos, seed=rank)
    torch.save({"alone": alone, "sharded": sharded}, f"{out}/rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_ranks_that_stop_at_different_steps_all_finish(tmp_path):
    run_ranks(_worker, (str(tmp_path),), 2, 120, "one kept all-gathering after the other stopped?")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    lengths = [g["alone"]["response_mask"].sum(-1) for g in got]
    assert (lengths[0] < R - 1).all() and (lengths[1] == R).all(), lengths  # rank 0 stops steps before rank 1
    for g in got:
        assert torch.equal(g["sharded"]["responses"], g["alone"]["responses"])
        assert torch.equal(g["sharded"]["response_mask"], g["alone"]["response_mask"])
        torch.testing.assert_close(g["sharded"]["rollout_log_probs"], g["alone"]["rollout_log_probs"],
                                   atol=1e-5, rtol=0)
