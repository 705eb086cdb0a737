"""Multi-turn rollout throughput: 256 trajectories x 3 assistant turns with a simulated 50 ms tool,
against the single-turn engine on the same number of generated tokens, and KV reuse against re-prefilling history.

Run on one GPU:  PYTHONPATH=. python3 benchmarks/multi_turn.py --out $OUT/multi_turn.json
CPU smoke test:  python3 benchmarks/multi_turn.py --device cpu --preset tiny --prompts 2 --n 2 --prompt-len 8 \
                     --response-len 48 --turn-len 8 --tool-tokens 4 --tool-latency 0.005 --out /tmp/mt.json

Workload: random-init Qwen2.5 shape (no download), random prompts, sampling at temperature 1. A random model writes
no tool calls, so a test format calls the `sleep` tool after every turn (it sleeps `--tool-latency` and answers
`--tool-tokens` tokens); a turn ends on any of V / `--turn-len` stop ids (geometric turn lengths, mean ≈ turn-len),
the 3rd turn ends the trajectory. Three runs after one warm-up each:
- single-turn: the same prompts, `ignore_eos`, max_new = the multi-turn run's mean model tokens per trajectory;
- single-turn, length-matched: each row generates exactly as many tokens as its multi-turn trajectory sampled (the
  same ragged tail: the batch thins out as short rows finish), so the ratio isolates what the turns cost — pauses,
  tool waits and extensions — from the length spread the workload has either way;
- multi-turn, KV reuse (what the engine does): `ModelRunner.extend_many` prefills only the appended tool tokens, all
  slots whose tools finished together in one batched forward;
- multi-turn, re-prefill: `extend_many` replaced by a version that recomputes the whole history's K/V (prompt +
  every earlier turn + the tool tokens) each turn, one slot at a time — what an engine without KV reuse pays.
Tokens/s counts model-sampled tokens only (tool tokens are not generated).
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time
from typing import Any

import torch

from benchmarks.harness import add_workload_args, utc_now, write_json

# benchmarks/rollout.py builds the same random-init models
from benchmarks.rollout import make_model, sync
from hybridflow.agentic.formats import ToolCall, ToolFormat
from hybridflow.agentic.session import ToolSession
from hybridflow.agentic.tools import Tool, ToolContext, ToolResult
from hybridflow.config import load_config
from hybridflow.protocol import DataProto
from hybridflow.rollout import RolloutEngine, forward
from hybridflow.rollout.model_runner import ModelRunner
from hybridflow.rollout.sampling import SamplingParams


class WordTokenizer:
    """Enough of a tokenizer for the session: a turn decodes to '' (the format ignores it), a tool answer of k words
    encodes to k ids."""

    chat_template = None

    def __init__(self, vocab: int) -> None:
        self.span = min(1000, vocab // 2)

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return ""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [3 + (i % self.span) for i in range(len(text.split()))]


class AlwaysSleep(ToolFormat):
    name = "bench_always_sleep"

    def parse(self, text: str) -> list[ToolCall]:
        return [ToolCall("sleep", {})]

    def render(self, results: list[str]) -> str:
        return " ".join(results)


class SleepTool(Tool):
    name = "sleep"
    description = "waits, then answers a fixed number of words"

    def execute(self, arguments: dict[str, Any], context: ToolContext) -> ToolResult:
        time.sleep(float(self.config["latency"]))
        return ToolResult(" ".join(["w"] * int(self.config["tokens"])))


def reprefill_extend(prompt_ids: torch.Tensor):
    """A `ModelRunner.extend_many` that recomputes each slot's history instead of reusing the cache (prompts are
    unpadded and identical, so the history of any slot is `prompt_ids` + its response so far + the new ids); one
    slot per forward, as re-prefilling engines without varlen batching do."""

    def one(self: ModelRunner, slot: int, new_ids: list[int]) -> int:
        dev = self.device
        step, k, P = int(self.resp_len[slot]), len(new_ids), prompt_ids.numel()
        hist = torch.cat([prompt_ids.to(dev), self.out_tok[slot, :step],
                          torch.tensor(new_ids, dtype=torch.long, device=dev)])
        self.valid[slot, :] = False
        t = lambda v: torch.tensor([v], dtype=torch.long, device=dev)  # noqa: E731
        logits = forward.extend_batch(self.weights, self.spec, self.rope, hist[None],
                                      torch.arange(P + step + k, device=dev)[None], [hist.numel()], self.cache,
                                      t(slot), [0], self.valid)
        counter = t(step + k)
        tok, logp = self.sampler(logits, self.mode, self.temperature, self.top_k, self.top_p,
                                  self.seed[slot: slot + 1], counter)
        self.out_tok[slot, step: step + k] = hist[P + step:]
        self.out_logp[slot, step: step + k] = 0.0
        self.out_tok[slot, step + k], self.out_logp[slot, step + k] = tok[0], logp[0]
        new_len = step + k + 1
        self.tok[slot], self.resp_len[slot] = tok[0], new_len
        self.cidx[slot], self.pos[slot] = P + step + k, P + step + k
        self.done[slot] = self.is_stop[tok[0]] | (new_len >= self.max_new[slot])
        return new_len

    def extend_many(self: ModelRunner, items: list[tuple[int, list[int], int]], prompt_width: int,
                    **_host_known) -> list[int]:
        return [one(self, slot, new_ids) for slot, new_ids, _ in items]

    return extend_many


def length_matched_admit(lengths_by_seed: dict[int, int]):
    """A `ModelRunner.admit` that caps each admitted slot at its row's target length (rows found by their seed)."""
    original = ModelRunner.admit

    def admit(self: ModelRunner, slots, ids_BP, mask_BP, pos_BP, n, seeds, max_new):
        original(self, slots, ids_BP, mask_BP, pos_BP, n, seeds, max_new)
        cap = torch.tensor([min(max_new, lengths_by_seed[s]) for s in seeds], device=self.device)
        slot_t = torch.tensor(slots, device=self.device)
        self.max_new[slot_t] = cap
        self.done[slot_t] |= cap <= 1

    return admit


def timed_generate(engine: RolloutEngine, prompts: DataProto, params: SamplingParams) -> tuple[DataProto, float]:
    engine.generate(prompts, params)  # warm-up: graphs, compiled kernels, cache
    sync(engine.device)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    sync(engine.device)
    return out, time.perf_counter() - t0


def add_multi_turn_args(ap: argparse.ArgumentParser) -> None:
    """The workload's flags (this script's and benchmarks/agent_server.py's)."""
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    add_workload_args(ap, response_len=512)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-len", type=int, default=96, help="mean tokens per assistant turn (stop-id share)")
    ap.add_argument("--tool-tokens", type=int, default=32)
    ap.add_argument("--tool-latency", type=float, default=0.05)
    ap.add_argument("--tool-workers", type=int, default=64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_multi_turn_args(ap)
    args = ap.parse_args()

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = make_model(args.preset, dev, dtype)
    vocab = model.config.vocab_size
    B, n, P, R = args.prompts, args.n, args.prompt_len, args.response_len
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(min(1000, vocab // 2), vocab, (P,), generator=g)
    ids = prompt.expand(B, P).clone().to(dev)
    prompts = DataProto.from_single_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                          "position_ids": torch.arange(P, device=dev).expand(B, P).clone()})
    prompts.meta_info["seeds"] = list(range(B))  # the same samples in every run (warm-up, reuse, re-prefill)
    rcfg = dataclasses.replace(load_config([], ["trainer.device=" + dev.type]).rollout, n=n, max_num_seqs=B * n,
                               free_cache_engine=False, gpu_memory_utilization=0.5)
    cfg = model.config
    engine = RolloutEngine(model, rcfg, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                           max_prompt_length=P, max_response_length=R, dtype=dtype)
    n_stop = max(1, vocab // args.turn_len)
    stops = tuple(range(vocab - n_stop, vocab))
    multi = SamplingParams(n=n, stop_token_ids=stops, seed=1)
    tool = SleepTool({"latency": args.tool_latency, "tokens": args.tool_tokens})
    session = ToolSession({"sleep": tool}, AlwaysSleep(), WordTokenizer(vocab), max_assistant_turns=args.turns,
                          max_tool_response_length=args.tool_tokens + 8, tool_timeout_s=30.0,
                          tool_workers=args.tool_workers)
    engine.session = session
    out, t_reuse = timed_generate(engine, prompts, multi)
    m = out.meta_info["metrics"]
    model_tokens = int(out.batch["response_mask"].sum())
    lengths = out.batch["attention_mask"][:, P:].sum(1).float()
    original = ModelRunner.extend_many
    ModelRunner.extend_many = reprefill_extend(prompt)
    try:
        out_re, t_re = timed_generate(engine, prompts, multi)
    finally:
        ModelRunner.extend_many = original
    same_seq = bool(torch.equal(out_re.batch["responses"], out.batch["responses"]))
    logp_diff = float((out_re.batch["rollout_log_probs"] - out.batch["rollout_log_probs"]).abs().max())
    re_tokens = int(out_re.batch["response_mask"].sum())
    engine.session = None
    per_traj = max(1, round(model_tokens / (B * n)))
    single = SamplingParams(n=n, ignore_eos=True, max_new_tokens=per_traj, seed=1)
    out_st, t_single = timed_generate(engine, prompts, single)
    single_tokens = int(out_st.batch["response_mask"].sum())
    row_seeds = engine._row_seeds(prompts.meta_info, multi, B)
    per_row = out.batch["response_mask"].sum(1).tolist()
    original_admit = ModelRunner.admit
    ModelRunner.admit = length_matched_admit({s: int(t) for s, t in zip(row_seeds, per_row)})
    try:
        out_lm, t_lm = timed_generate(engine, prompts, dataclasses.replace(single, max_new_tokens=R))
    finally:
        ModelRunner.admit = original_admit
    lm_tokens = int(out_lm.batch["response_mask"].sum())
    lm_same_lengths = bool(torch.equal(out_lm.batch["response_mask"].sum(1).cpu(),
                                       out.batch["response_mask"].sum(1).cpu()))
    session.close()

    res = {
        "date": utc_now(), "host": platform.node(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "args": vars(args),
        "trajectories": B * n, "turns_mean": m.get("num_turns/mean"), "tool_calls_mean": m.get("tool_calls/mean"),
        "model_tokens": model_tokens, "response_len_mean": float(lengths.mean()),
        "response_len_max": float(lengths.max()), "extend_tokens": m.get("rollout/extend_tokens"),
        "tool_wait_s": m.get("timing/tool_wait"),
        "multi_turn_reuse_s": t_reuse, "multi_turn_reuse_tok_s": model_tokens / t_reuse,
        "multi_turn_reprefill_s": t_re, "multi_turn_reprefill_tok_s": re_tokens / t_re,
        "reprefill_same_tokens": same_seq, "reprefill_max_logp_diff": logp_diff,
        "single_turn_s": t_single, "single_turn_tokens": single_tokens, "single_turn_tok_s": single_tokens / t_single,
        "single_matched_s": t_lm, "single_matched_tokens": lm_tokens, "single_matched_tok_s": lm_tokens / t_lm,
        "single_matched_same_lengths": lm_same_lengths,
    }
    res["multi_vs_single_matched"] = res["multi_turn_reuse_tok_s"] / res["single_matched_tok_s"]
    res["multi_vs_single"] = res["multi_turn_reuse_tok_s"] / res["single_turn_tok_s"]
    res["reuse_vs_reprefill"] = res["multi_turn_reuse_tok_s"] / res["multi_turn_reprefill_tok_s"]
    write_json(args.out, res)
    for k in ("turns_mean", "model_tokens", "response_len_mean", "multi_turn_reuse_s", "multi_turn_reuse_tok_s",
              "multi_turn_reprefill_tok_s", "reprefill_same_tokens", "reprefill_max_logp_diff", "single_turn_tok_s", "multi_vs_single",
              "single_matched_tok_s", "single_matched_same_lengths", "multi_vs_single_matched",
              "reuse_vs_reprefill", "tool_wait_s"):
        print(f"{k:28s} {res[k]}")


if __name__ == "__main__":
    main()
