"""Agent server throughput: the workload of benchmarks/multi_turn.py (trajectories of 3 assistant turns, a simulated
tool after each), once in-engine (`rollout.multi_turn`) and once through the OpenAI-compatible endpoint
(`rollout.agent.mode=server`) with one `openai.AsyncOpenAI` agent per trajectory; tokens/s of both and their ratio.

Run on one GPU:  PYTHONPATH=. python3 benchmarks/agent_server.py --out $OUT/agent_server.json
CPU smoke test:  PYTHONPATH=. python3 benchmarks/agent_server.py --smoke --out /tmp/agent_server.json

Workload (multi_turn.py's): random-init Qwen2.5 shape, one random prompt for all rows, sampling at temperature 1, a
turn ends on any of V / `--turn-len` stop ids, the tool sleeps `--tool-latency` and answers `--tool-tokens` ids. The
agent speaks `/v1/completions` with token ids (a random model has no chat to render; sent in `extra_body`, see
`agent`): it sends the prompt, then the ids so far + the tool's ids, which the endpoint serves by extending the session's KV cache (the in-engine rollout's
reuse), and stops after `--turns` completions or when the response budget would overflow. Tokens/s counts
model-sampled tokens after one warm-up run of each; the samples differ between the two (other seeds), so both token
counts are reported. Output: the JSON at `--out` and a markdown table beside it (`.md`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.harness import apply_smoke, cell, environment, write_json, write_table
from benchmarks.multi_turn import AlwaysSleep, SleepTool, WordTokenizer, add_multi_turn_args, timed_generate
from benchmarks.rollout import make_model
from hybridflow.agentic.agent_pool import auto_workers
from hybridflow.agentic.session import ToolSession
from hybridflow.config import load_config
from hybridflow.protocol import DataProto
from hybridflow.rollout import RolloutEngine
from hybridflow.rollout.agent_scheduler import AgentScheduler
from hybridflow.rollout.sampling import SamplingParams

SMOKE = {"device": "cpu", "preset": "tiny", "prompts": 2, "n": 2, "prompt_len": 8, "response_len": 48,
         "turn_len": 8, "tool_tokens": 4, "tool_latency": 0.005}

# where the server run's time goes (docs/metrics.md, agent/*)
SERVER_KEYS = ("agent/engine_idle_s", "agent/live_rows_per_step", "rollout/prefills", "agent/prefill_rows_per_call",
               "agent/extends", "agent/extend_rows_per_call", "agent/queued_ms", "agent/queued_first_ms",
               "agent/queued_next_ms", "agent/answer_ms",
               "agent/turn_gap_ms", "rollout/decode_steps", "agent/step_rows", "agent/first_prefill_ms",
               "agent/last_prefill_ms", "agent/first_task_start_ms", "agent/last_task_start_ms",
               "agent/first_arrival_ms", "agent/last_first_arrival_ms", "agent/loop_take_s",
               "agent/loop_admit_s", "agent/loop_prefill_s", "agent/loop_extend_s", "agent/loop_launch_s", "agent/loop_sync_s", "agent/loop_answer_s")


async def agent(client: Any, sample: dict[str, Any]) -> None:
    """The benchmark's agent (`rollout.agent.path` = this file, `name=agent`): `turns` completions with the tool's
    ids appended between them, all as token ids."""
    w = sample["workload"]
    ids, used = list(sample["prompt_ids"]), 0
    for turn in range(w["turns"]):
        # the ids go in `extra_body`: as `prompt=ids` the openai client walks every id against the parameter's
        # type union (~15 us an id: 13 of the 16 ms a 768-id request costs the agent's process)
        r = await client.completions.create(model="policy", prompt="", max_tokens=w["budget"] - used,
                                            extra_body={"prompt": ids})
        sampled = r.choices[0].model_extra["token_ids"]
        ids, used = ids + sampled, used + len(sampled)
        if turn + 1 == w["turns"] or used + w["tool_tokens"] + 1 >= w["budget"]:
            return
        await asyncio.sleep(w["tool_latency"])
        ids, used = ids + w["tool_ids"], used + len(w["tool_ids"])


FIRST_SEEN: list[tuple[float, float]] = []  # (arrived at the endpoint, taken by the engine), s from the call's start


def _trace_first_requests() -> None:
    """Record when each session's first request reached the endpoint and when the engine's loop took it."""
    real = AgentScheduler._job

    def job(self: AgentScheduler, call: Any) -> Any:
        if call.session not in self.sessions:
            FIRST_SEEN.append((call.arrived - self.t_start, time.monotonic() - self.t_start))
        return real(self, call)
    AgentScheduler._job = job


def _first_wave() -> dict[str, float]:
    if not FIRST_SEEN:
        return {}
    arrived, taken = (np.array(x) * 1e3 for x in zip(*FIRST_SEEN))
    FIRST_SEEN.clear()
    return {"arrived_ms_p50": float(np.median(arrived)), "arrived_ms_max": float(arrived.max()),
            "taken_ms_p50": float(np.median(taken)), "taken_ms_max": float(taken.max()),
            "wait_ms_max": float((taken - arrived).max())}


SYNCS: dict[str, int] = {}  # --sync-debug: the stack of each synchronizing CUDA call in the timed server run -> count


@contextlib.contextmanager
def _sync_debug(on: bool) -> Iterator[None]:
    """With `on`, record where the engine's thread makes the host wait for the device (torch's sync debug mode)."""
    if not on:
        yield
        return
    real = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "synchronizing" not in str(message):
            return real(message, category, filename, lineno, *rest)
        stack = "".join(traceback.format_stack(limit=12)[:-2])
        SYNCS[stack] = SYNCS.get(stack, 0) + 1
    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = real


def run_server(model: torch.nn.Module, rcfg: Any, prompts: DataProto, params: SamplingParams, args: argparse.Namespace,
               dtype: torch.dtype) -> tuple[DataProto, float]:
    B, n, vocab = args.prompts, args.n, model.config.vocab_size
    tool_ids = WordTokenizer(vocab).encode(" ".join(["w"] * args.tool_tokens))
    workload = {"turns": args.turns, "budget": args.response_len, "tool_tokens": args.tool_tokens,
                "tool_ids": tool_ids, "tool_latency": args.tool_latency}
    prompts = DataProto.from_single_dict({k: prompts.batch[k] for k in ("input_ids", "attention_mask", "position_ids")})
    prompts.non_tensor_batch = {"prompt_ids": np.array([None] * B, dtype=object),
                                "workload": np.array([workload] * B, dtype=object)}
    for i in range(B):
        prompts.non_tensor_batch["prompt_ids"][i] = prompts.batch["input_ids"][i].tolist()
    agent_cfg = dataclasses.replace(rcfg.agent, mode="server", path=str(Path(__file__).resolve()), name="agent",
                                    max_concurrency=B * n, timeout_s=600.0, workers=args.agent_workers)
    cfg = model.config
    engine = RolloutEngine(model, dataclasses.replace(rcfg, agent=agent_cfg), eos_token_id=cfg.eos_token_id,
                           pad_token_id=cfg.pad_token_id, max_prompt_length=args.prompt_len,
                           max_response_length=args.response_len, dtype=dtype, tokenizer=WordTokenizer(vocab))
    try:
        with _sync_debug(args.sync_debug):
            out, seconds = timed_generate(engine, prompts, params)
        del FIRST_SEEN[: -B * n]  # the warm-up call's
        out.meta_info["first_wave"] = _first_wave()
    finally:
        engine.close()
    m = out.meta_info["metrics"]
    bad = {k: m[k] for k in ("agent/errors", "agent/timeouts", "agent/rewritten_sessions") if m.get(k)}
    if bad:
        raise RuntimeError(f"the server run is not the workload: {bad}")
    return out, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_multi_turn_args(ap)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny model, 2 x 2 short trajectories")
    ap.add_argument("--agent-workers", type=int, default=0,
                    help="rollout.agent.workers (0 = auto: one process per 4 CPU cores, at most 8)")
    ap.add_argument("--sync-debug", action="store_true",
                    help="record the stacks of synchronizing CUDA calls during the server runs (warm-up and timed) "
                         "(slows them: diagnosis only); written as `syncs` in the JSON")
    ap.add_argument("--server-variants", default="",
                    help="';'-separated sets of space-separated rollout.agent.* overrides: one more server run "
                         "under each, e.g. 'rollout.agent.check_every=8 rollout.agent.switch_interval_ms=null'")
    args = ap.parse_args()
    apply_smoke(args, SMOKE)
    _trace_first_requests()

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = make_model(args.preset, dev, dtype)
    vocab = model.config.vocab_size
    B, n, P, R = args.prompts, args.n, args.prompt_len, args.response_len
    prompt = torch.randint(min(1000, vocab // 2), vocab, (P,), generator=torch.Generator().manual_seed(0))
    ids = prompt.expand(B, P).clone().to(dev)
    prompts = DataProto.from_single_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                          "position_ids": torch.arange(P, device=dev).expand(B, P).clone()})
    rcfg = dataclasses.replace(load_config([], ["trainer.device=" + dev.type]).rollout, n=n, max_num_seqs=B * n,
                               free_cache_engine=False, gpu_memory_utilization=0.5)
    n_stop = max(1, vocab // args.turn_len)
    params = SamplingParams(n=n, stop_token_ids=tuple(range(vocab - n_stop, vocab)), seed=1)

    cfg = model.config
    engine = RolloutEngine(model, rcfg, eos_token_id=cfg.eos_token_id, pad_token_id=cfg.pad_token_id,
                           max_prompt_length=P, max_response_length=R, dtype=dtype)
    engine.session = ToolSession({"sleep": SleepTool({"latency": args.tool_latency, "tokens": args.tool_tokens})},
                                 AlwaysSleep(), WordTokenizer(vocab), max_assistant_turns=args.turns,
                                 max_tool_response_length=args.tool_tokens + 8, tool_timeout_s=30.0,
                                 tool_workers=args.tool_workers)
    out_in, t_in = timed_generate(engine, prompts, params)
    engine.session.close()
    engine.close()
    del engine
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the in-engine run's KV cache, before the server run sizes its own
    out_srv, t_srv = run_server(model, rcfg, prompts, params, args, dtype)
    extra = []
    for variant in [v.split() for v in args.server_variants.split(";") if v.strip()]:
        vcfg = dataclasses.replace(rcfg, agent=load_config([], ["trainer.device=" + dev.type, *variant]).rollout.agent)
        name = "server " + " ".join(o.removeprefix("rollout.agent.") for o in variant)
        extra.append((name, *run_server(model, vcfg, prompts, params, args, dtype)))

    res: dict[str, Any] = {**environment(), "args": vars(args), "trajectories": B * n,
                           "agent_workers": auto_workers(args.agent_workers)}
    for name, out, seconds in (("in_engine", out_in, t_in), ("server", out_srv, t_srv), *extra):
        tokens = int(out.batch["response_mask"].sum())
        m = out.meta_info["metrics"]
        res[name] = {"seconds": seconds, "model_tokens": tokens, "tok_s": tokens / seconds,
                     "turns_mean": m.get("num_turns/mean", m.get("agent/requests_per_task")),
                     "extend_tokens": m.get("rollout/extend_tokens", m.get("agent/extend_tokens")),
                     "decode_steps": m.get("rollout/decode_steps"), "first_wave": out.meta_info.get("first_wave")}
    res["server_vs_in_engine"] = res["server"]["tok_s"] / res["in_engine"]["tok_s"]
    m = out_srv.meta_info["metrics"]
    res["server"]["engine"] = {k.split("/")[1]: m[k] for k in SERVER_KEYS if k in m}
    for name, out, _ in extra:
        res[name]["engine"] = {k.split("/")[1]: out.meta_info["metrics"][k] for k in SERVER_KEYS
                               if k in out.meta_info["metrics"]}
        res[name]["vs_in_engine"] = res[name]["tok_s"] / res["in_engine"]["tok_s"]
    if SYNCS:
        res["syncs"] = sorted(([n, stack] for stack, n in SYNCS.items()), reverse=True)
    write_json(args.out, res)
    rows = ["| rollout | trajectories | turns / trajectory | model tokens | seconds | tokens/s |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in ("in_engine", "server", *(e[0] for e in extra)):
        r = res[name]
        rows.append(f"| {name} | {B * n} | {cell(r['turns_mean'], '{:.2f}')} | {r['model_tokens']} | "
                    f"{r['seconds']:.2f} | {r['tok_s']:.0f} |")
    rows.append(f"\nserver ({res['agent_workers']} agent processes) / in-engine tokens/s: "
                f"**{res['server_vs_in_engine']:.2f}** "
                f"({res['date']}, {res['commit']}, {res['gpu']}, torch {res['torch']})")
    rows.append("\nserver: " + ", ".join(f"{k} {v:.3g}" for k, v in res["server"]["engine"].items()))
    write_table(Path(args.out).with_suffix(".md"), "\n".join(rows), append=False)


if __name__ == "__main__":
    main()
