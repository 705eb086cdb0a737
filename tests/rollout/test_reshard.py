"""FSDP2 shards → TP slices (gloo, spawned ranks): every rank gets exactly `take(full, param_slice(...))` of the
unsharded model — after an optimizer step and with LoRA merged too — and receives only the elements of its slice that
its own shard lacks (counted here with index masks, not from the implementation's plan)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from ranks_testlib import start_ranks
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from hybridflow.config.schema import LoraConfig
from hybridflow.engine.fsdp import apply_fsdp2, build_mesh
from hybridflow.engine.lora import apply_lora, merged_state_dict
from hybridflow.protocol import DataProto
from hybridflow.rollout.reshard import Resharder, generation_layout, tp_group_ranks
from hybridflow.rollout.tp_layout import param_slice, take
from hybridflow.rollout.weights import arch_spec
from hybridflow.workers.hybrid_generate import TPGeneration, generate_on, tp_group

LORA = LoraConfig(rank=4, alpha=8.0)


def _model(kind: str, lora: bool = False) -> torch.nn.Module:
    """Vocabularies that neither 2 nor 4 divide (uneven FSDP2 shards, padded vocab shards); Qwen2: tied, q/k/v
    biases, 2 KV heads (fewer than tp=4); Llama: untied, one KV head."""
    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = Qwen2Config(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    else:
        cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False)
    cfg.initializer_range = 0.2
    model = AutoModelForCausalLM.from_config(cfg)
    if lora:
        apply_lora(model, LORA, seed=0)
        with torch.no_grad():  # B as after training (PEFT starts it at zero)
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0, 0.3)
    return model


def _full(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded parameters (an all-gather per parameter: the reference, not the method under test)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters(remove_duplicate=False)}


def _expected_bytes_in(model: torch.nn.Module, full: dict[str, torch.Tensor], world: int, rank: int, tp: int) -> int:
    """Elements of each slice (vocab padding excluded) that are not in this rank's FSDP2 shard (`torch.chunk` rows),
    counted on tensors of element ids; 4 bytes each (fp32)."""
    spec, layout = arch_spec(model), generation_layout(rank, tp)
    total = 0
    for name, _ in model.named_parameters():  # a tied weight once
        t = full[name]
        ids = torch.arange(1, t.numel() + 1).view(t.shape)  # 0 = a padded vocabulary row
        wanted = take(ids, param_slice(name.replace(".base_layer.", "."), t.shape, spec, layout))
        chunks = torch.chunk(ids, world, dim=0)
        held = chunks[rank] if rank < len(chunks) else ids[:0]
        total += int((~torch.isin(wanted[wanted > 0], held)).sum())
    return 4 * total


def _check(model: torch.nn.Module, ref: dict[str, torch.Tensor], tp: int, exact: bool = True) -> dict[str, float]:
    from torch.distributed.tensor.debug import CommDebugMode

    resharder = Resharder(model, tp, torch.float32)
    with CommDebugMode() as comm:  # only the planned exchanges: no DTensor op may gather a whole parameter
        got, metrics = resharder.reshard()
    gathers = {str(op): n for op, n in comm.get_comm_counts().items() if "all_gather" in str(op)}
    assert not gathers, gathers
    again, _ = resharder.reshard()  # the next switch refills the same tensors (the engine's CUDA graphs stay valid)
    assert all(again[k].data_ptr() == got[k].data_ptr() and torch.equal(again[k], got[k]) for k in got)
    spec, layout = arch_spec(model), generation_layout(resharder.rank, tp)
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    for name, full in ref.items():
        want = take(full, param_slice(name, full.shape, spec, layout))
        if exact:
            assert got[name].dtype == torch.float32 and torch.equal(got[name], want), (name, tp, resharder.rank)
        else:
            torch.testing.assert_close(got[name], want, atol=1e-6, rtol=1e-6, msg=name)
    return metrics


def _checks(mesh, tps: tuple[int, ...]) -> None:
    world, rank = mesh.size(), mesh.get_local_rank()
    for kind in ("qwen2", "llama"):
        model = _model(kind)
        ref = _full(model)
        apply_fsdp2(model, mesh, torch.float32, torch.float32)
        model_bytes = 4 * sum(p.numel() for p in model.parameters())
        for tp in tps:
            metrics = _check(model, ref, tp)
            expected = _expected_bytes_in(model, ref, world, rank, tp)
            assert metrics["rollout/reshard_bytes_in"] == expected, (kind, tp, rank, metrics, expected)
            moved = torch.tensor([metrics["rollout/reshard_bytes_out"], metrics["rollout/reshard_bytes_in"]])
            dist.all_reduce(moved, group=mesh.get_group())
            assert moved[0] == moved[1], moved  # every byte sent is received once
            # no gather of the model: what lands on a rank is at most its 1/tp share (+ small replicated norms)
            assert metrics["rollout/reshard_bytes_in"] < model_bytes / tp + 4 * 2000, (metrics, model_bytes)
            layer_bytes = 4 * sum(p.numel() for p in model.model.layers[0].parameters())
            assert metrics["rollout/reshard_peak_mb"] * 2**20 < layer_bytes, (metrics, layer_bytes)
        # after an optimizer step the slices follow the new weights
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(rank))
        model(input_ids=ids).logits.pow(2).mean().backward()
        opt.step()
        stepped = _full(model)
        name = "model.layers.0.mlp.down_proj.weight"
        assert not torch.equal(stepped[name], ref[name])
        _check(model, stepped, tps[-1])
    model = _model("llama", lora=True)
    plain = merged_state_dict(_full(model), LORA.alpha / LORA.rank)
    apply_fsdp2(model, mesh, torch.float32, torch.float32)
    for tp in tps:  # addmm_ on a slice of A can round the last bit unlike the full product: close, not bitwise
        _check(model, plain, tp, exact=False)


class _Engine:
    def to_mode(self, mode: str) -> None:
        pass


class _Resharder:
    def reshard(self) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return {"w": torch.ones(1)}, {"rollout/reshard_bytes_in": 4.0}


class _Rollout:
    """Two responses per prompt, each its prompt's seed; remembers the seeds it was given."""

    def sync_weights(self, local: dict[str, torch.Tensor]) -> None:
        self.local = local

    def generate(self, prompts: DataProto) -> DataProto:
        self.seeds = torch.tensor(prompts.meta_info["seeds"])
        return DataProto.from_single_dict({"responses": self.seeds.repeat_interleave(2)[:, None]},
                                          meta_info=dict(prompts.meta_info))


def _check_generation_groups(rank: int) -> None:
    """Ranks {0, 1} and {2, 3} generate their joined prompts (same prompts and seeds); each returns its own rows."""
    group = tp_group(rank, 4, 2)
    own = torch.arange(3) + 10 * rank
    rollout = _Rollout()
    out = generate_on(_Engine(), rollout, DataProto.from_single_dict({"seeds": own}),
                      TPGeneration(group, None, _Resharder()))
    assert list(rollout.local) == ["w"] and out.meta_info["metrics"]["rollout/reshard_bytes_in"] == 4.0
    first = rank - rank % 2
    assert rollout.seeds.tolist() == [*range(10 * first, 10 * first + 3), *range(10 * first + 10, 10 * first + 13)]
    assert out.batch["responses"][:, 0].tolist() == own.repeat_interleave(2).tolist(), (rank, out.batch)


def _worker(rank: int, store: str) -> None:
    """Four ranks: FSDP2 over all four (tp 2 and 4), then over pairs {0, 1} and {2, 3} (N = 2, tp = 2); then the
    generation groups of the training workers."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4)
    try:
        _checks(build_mesh(torch.device("cpu")), (2, 4))
        pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "dp"))
        _checks(pairs["dp"], (2,))
        _check_generation_groups(rank)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_reshard_to_tp_slices(tmp_path):
    start_ranks(_worker, (str(tmp_path / "store"),), 4)


def test_generation_groups_are_consecutive_ranks():
    assert tp_group_ranks(4, 2) == [[0, 1], [2, 3]]
    assert [generation_layout(k, 2).rank for k in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3"):
        tp_group_ranks(4, 3)
