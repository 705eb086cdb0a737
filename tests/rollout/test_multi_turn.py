"""Multi-turn rollouts in our engine: appended tool tokens are masked out of the loss, and the KV cache reused
across turns gives the same log-probs as one plain HF forward over the whole trajectory (a full re-prefill)."""

from __future__ import annotations

import pytest
import torch
from rollout_helpers import make_engine, make_model, make_prompts
from test_rollout_engine import hf_logprobs

from hybridflow.agentic.formats import ToolCall, ToolFormat
from hybridflow.agentic.session import ToolSession
from hybridflow.agentic.tools import Tool, ToolResult
from hybridflow.models.tokenizer import builtin_tokenizer

TOOL_TEXT = "ok"


class AlwaysCall(ToolFormat):
    """Every finished turn is one call to `echo` (a random model writes no real tool calls)."""

    name = "always"

    def parse(self, text):
        return [ToolCall("echo", {})]

    def render(self, results):
        return "|" + "".join(results) + "|"


class Echo(Tool):
    name = "echo"

    def execute(self, arguments, context):
        return ToolResult(TOOL_TEXT)


def _engine(model, R=40, turns=3, **kw):
    vocab = model.config.vocab_size
    # many stop ids, so turns end after a few tokens; none of them inside the tool text "|ok|"
    tool_ids = set(builtin_tokenizer().encode("|ok|", add_special_tokens=False))
    stops = [t for t in range(3, min(vocab, 99), 5) if t not in tool_ids]
    eng = make_engine(model, 12, R, stop_token_ids=stops, **kw)
    eng.session = ToolSession({"echo": Echo()}, AlwaysCall(), builtin_tokenizer(), max_assistant_turns=turns,
                              max_tool_response_length=16, tool_timeout_s=5.0, tool_workers=2)
    return eng


def _spans(mask_row, length):
    """[start, end) runs of 0 inside the first `length` tokens (the appended tool tokens)."""
    out, start = [], None
    for i in range(length):
        if mask_row[i] == 0 and start is None:
            start = i
        if mask_row[i] == 1 and start is not None:
            out.append((start, i))
            start = None
    return out


def test_tool_tokens_are_context_not_loss(model):
    out = _engine(model).generate(make_prompts(4, 12, model.config.vocab_size, meta={"n": 2}))
    b, tool_ids = out.batch, builtin_tokenizer().encode("|ok|", add_special_tokens=False)
    lengths = b["attention_mask"][:, 12:].sum(1)
    m = out.meta_info["metrics"]
    assert m["num_turns/max"] > 1 and m["tool_calls/max"] >= 1, m
    extensions = 0
    for row in range(len(out)):
        L = int(lengths[row])
        assert (b["attention_mask"][row, 12:][:L] == 1).all()  # attended: model and tool tokens
        spans = _spans(b["response_mask"][row], L)
        extensions += len(spans)
        for a, e in spans:
            assert b["responses"][row, a:e].tolist() == tool_ids
            assert (b["rollout_log_probs"][row, a:e] == 0).all()
        assert b["response_mask"][row, L - 1] == 1  # the trajectory ends on a model token
        assert (b["response_mask"][row, L:] == 0).all()
    assert extensions > 0
    # only the appended ids (and the one re-fed last token) were prefilled after the prompt: KV reused
    assert m["rollout/extend_tokens"] == extensions * (len(tool_ids) + 1), m
    assert m["rollout/prefills"] == 1


def test_kv_reuse_matches_full_reprefill(model):
    out = _engine(model, temperature=1.0).generate(make_prompts(5, 12, model.config.vocab_size, meta={"n": 2}))
    assert out.meta_info["metrics"]["tool_calls/mean"] > 0
    ref = hf_logprobs(model, out, 1.0)  # one forward over prompt + all turns, masked to model tokens
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=2e-4, rtol=0)


def test_greedy_multi_turn_tokens_match_full_forward_argmax(model):
    out = _engine(model).generate(make_prompts(3, 12, model.config.vocab_size, meta={"do_sample": False}))
    P, b = 12, out.batch
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits[:, P - 1:-1]
    top2 = logits.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-3  # skip near-ties
    sel = b["response_mask"].bool() & clear
    assert torch.equal(logits.argmax(-1)[sel], b["responses"][sel])


def test_turn_limit_and_budget_bound_the_trajectory(model):
    out = _engine(model, R=24, turns=2).generate(make_prompts(4, 12, model.config.vocab_size))
    assert out.meta_info["metrics"]["num_turns/max"] <= 2
    assert int(out.batch["attention_mask"][:, 12:].sum(1).max()) <= 24


class VarEcho(Tool):
    """Answers of 1-4 words, so slots extended together append different numbers of tokens (padding in the batch)."""

    name = "echo"

    def __init__(self):
        super().__init__()
        self.calls = 0

    def execute(self, arguments, context):
        self.calls += 1
        return ToolResult(" ".join(["ok"] * (1 + self.calls % 4)))


def test_batched_extensions_of_different_lengths_match_full_reprefill(model, monkeypatch):
    from hybridflow.rollout.model_runner import ModelRunner

    eng = _engine(model, R=48, temperature=1.0)
    eng.session = ToolSession({"echo": VarEcho()}, AlwaysCall(), builtin_tokenizer(), max_assistant_turns=3,
                              max_tool_response_length=16, tool_timeout_s=5.0, tool_workers=1)
    batches = []
    real = ModelRunner.extend_many

    def spy(self, items, prompt_width, **kw):
        batches.append(sorted({len(ids) for _, ids, _ in items}) if len(items) > 1 else None)
        return real(self, items, prompt_width, **kw)

    monkeypatch.setattr(ModelRunner, "extend_many", spy)
    out = eng.generate(make_prompts(6, 12, model.config.vocab_size, meta={"n": 2}))
    mixed = [b for b in batches if b is not None and len(b) > 1]
    assert mixed, f"no batch of extensions with different lengths: {batches}"
    ref = hf_logprobs(model, out, 1.0)
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref, atol=2e-4, rtol=0)


class RowEcho(Tool):  # 1-4 words by trajectory and turn: the same answers whatever order the calls run in
    name = "echo"

    def execute(self, arguments, context):
        context.state["turn"] = context.state.get("turn", 0) + 1
        return ToolResult(" ".join(["ok"] * (1 + (int(context.trajectory_id) + context.state["turn"]) % 4)))


def test_ranged_extension_matches_the_sdpa_extension(model, monkeypatch):
    """The GPU extension path (flat tokens, a row map into the cache, range attention) — here with the kernels'
    torch references — gives the SDPA path's tokens and log-probs, with batches of different lengths, and both
    match one full forward over the trajectories."""
    from hybridflow.rollout import forward
    from hybridflow.rollout.decode_attention import decode_attention_ref
    from hybridflow.rollout.kv_store_kernel import store_kv_ref
    from hybridflow.rollout.model_runner import ModelRunner

    def run():
        eng = _engine(model, R=48, temperature=1.0)
        eng.session = ToolSession({"echo": RowEcho()}, AlwaysCall(), builtin_tokenizer(), max_assistant_turns=3,
                                  max_tool_response_length=16, tool_timeout_s=5.0, tool_workers=1)
        return eng, eng.generate(make_prompts(6, 12, model.config.vocab_size, meta={"n": 2, "seeds": list(range(6))}))

    _, sdpa = run()
    calls = []
    real = ModelRunner._extend_ranged
    monkeypatch.setattr(forward, "_triton_attention", lambda device: decode_attention_ref)
    monkeypatch.setattr(forward, "_triton_kv_store", lambda device: store_kv_ref)
    monkeypatch.setattr(ModelRunner, "_extend_ranged", lambda self, *a: calls.append(len(a[0])) or real(self, *a))
    eng, ranged = run()
    assert eng._runner.ops.attention is decode_attention_ref and calls and max(calls) > 1, calls
    assert torch.equal(ranged.batch["responses"], sdpa.batch["responses"])
    assert torch.equal(ranged.batch["response_mask"], sdpa.batch["response_mask"])
    # 1e-5 held here; 1.3e-5 on another CPU (summation order differs between the two attention paths)
    torch.testing.assert_close(ranged.batch["rollout_log_probs"], sdpa.batch["rollout_log_probs"], atol=1e-4, rtol=0)
    torch.testing.assert_close(ranged.batch["rollout_log_probs"], hf_logprobs(model, ranged, 1.0), atol=2e-4, rtol=0)

    # The GPU layout without the graph: tokens padded to a power-of-two bucket by repeating the last one, slots
    # padded by repeating the last slot's row — the same results.
    from hybridflow.rollout import model_runner

    init = ModelRunner.__init__

    def padded_init(self, *a, **kw):
        init(self, *a, **kw)
        self.ext_graph_tokens = model_runner.EXT_GRAPH_TOKENS

    monkeypatch.setattr(ModelRunner, "__init__", padded_init)
    monkeypatch.setattr(model_runner, "EXT_CAPTURE_AFTER_USES", 10**9)
    calls.clear()
    eng, padded = run()
    assert eng._runner._ext_uses and calls, "the padded layout was not used"
    assert torch.equal(padded.batch["responses"], sdpa.batch["responses"])
    torch.testing.assert_close(padded.batch["rollout_log_probs"], sdpa.batch["rollout_log_probs"], atol=1e-4, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_extension_graphs_replay_the_eager_extension(monkeypatch):
    """On a GPU, extensions replay captured graphs (padded buckets); tokens and log-probs equal the same padded
    extension run eagerly, on the first call (captures) and on a second one (replays only)."""
    from hybridflow.rollout import model_runner

    model = make_model("qwen").cuda()
    prompts = make_prompts(6, 12, model.config.vocab_size, meta={"n": 2, "seeds": list(range(6))})

    def engine():
        eng = _engine(model, R=48, temperature=1.0)
        eng.session = ToolSession({"echo": RowEcho()}, AlwaysCall(), builtin_tokenizer(), max_assistant_turns=3,
                                  max_tool_response_length=16, tool_timeout_s=5.0, tool_workers=1)
        return eng

    monkeypatch.setattr(model_runner, "EXT_CAPTURE_AFTER_USES", 1)
    graphed = engine()
    first, second = graphed.generate(prompts), graphed.generate(prompts)
    assert graphed._runner.ext_graphs, "no extension graph was captured"
    monkeypatch.setattr(model_runner, "EXT_CAPTURE_AFTER_USES", 10**9)  # the same padded shapes, never captured
    eager = engine()
    ref = eager.generate(prompts)
    assert not eager._runner.ext_graphs and eager._runner._ext_uses
    for out in (first, second):
        assert torch.equal(out.batch["responses"], ref.batch["responses"])
        torch.testing.assert_close(out.batch["rollout_log_probs"], ref.batch["rollout_log_probs"], atol=1e-4, rtol=0)
