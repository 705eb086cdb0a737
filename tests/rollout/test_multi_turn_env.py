"""Multi-turn rollouts with an interaction (simulated user) in our engine, and verl-schema `tools_kwargs` from a
parquet row reaching the tools: the first user message extends the prompt, user messages are the chat template's
delta ids and carry no loss, per-turn rewards sit on each turn's last model token, and the KV cache reused across
user turns gives the log-probs of one forward over the whole trajectory."""

from __future__ import annotations

import torch
from rollout_helpers import EOS, PAD, make_engine, make_model
from test_multi_turn import _spans
from test_rollout_engine import hf_logprobs

from hybridflow.agentic.chat_delta import ChatDelta
from hybridflow.agentic.formats import ToolCall, ToolFormat
from hybridflow.agentic.interactions import Interaction, InteractionSpec, InteractionStep
from hybridflow.agentic.session import ToolSession
from hybridflow.agentic.tools import Tool, ToolResult
from hybridflow.data import RLHFDataset, write_rows
from hybridflow.models.tokenizer import builtin_tokenizer
from hybridflow.protocol import DataProto

TOK = builtin_tokenizer()
P_MAX = 40
STEP_REWARD, DONE_REWARD = 0.5, 1.0


class Scripted(Interaction):
    """Says "go" first; answers "more" (reward 0.5) twice, then ends the game (reward 1)."""

    def reset(self, kwargs):
        self.k = 0
        return "go"

    def step(self, assistant_message):
        self.k += 1
        if self.k < 3:
            return InteractionStep("more", STEP_REWARD)
        return InteractionStep("", DONE_REWARD, done=True)


def _stops(vocab, avoid_text):
    avoid = set(TOK.encode(avoid_text, add_special_tokens=False)) | {1}
    return [t for t in range(3, min(vocab, 99), 4) if t not in avoid]


def _prompts(texts, n=1, do_sample=True):
    rows = [TOK.encode(TOK.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False) for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_single_dict({"input_ids": ids, "attention_mask": mask, "position_ids": pos},
                                      meta_info={"n": n, "do_sample": do_sample, "temperature": 1.0})


def _engine(model, R, stops, max_user_turns=2):
    eng = make_engine(model, P_MAX, R, stop_token_ids=stops, temperature=1.0)
    eng.session = ToolSession({}, ToolFormat(), TOK, max_assistant_turns=6, max_tool_response_length=16,
                              tool_timeout_s=5.0, tool_workers=2,
                              interactions={"s": InteractionSpec("s", Scripted, {})}, max_user_turns=max_user_turns)
    return eng


def test_interaction_turns_masks_rewards_and_kv_reuse():
    model = make_model("tiny")
    stops = _stops(model.config.vocab_size, "\nUser: more\nAssistant:go")
    texts = ["abc", "hello there", "x", "count 123"]
    R = 64
    out = _engine(model, R, stops).generate(_prompts(texts, n=2))
    b, m = out.batch, out.meta_info["metrics"]
    assert m["num_user_turns/max"] == 2 and m["interaction_reward/mean"] > 0, m
    # the first user message extends each prompt through the template (its generation prompt moved after it)
    for row in range(len(out)):
        p = b["prompts"][row][b["attention_mask"][row, :P_MAX].bool()]
        assert TOK.decode(p) == f"User: {texts[row // 2]}\nUser: go\nAssistant:"
    assert b["prompts"].shape[1] == P_MAX  # interactions: prompts padded to data.max_prompt_length on every rank
    stops = stops + [EOS]  # the engine's EOS stops a turn too
    delta_after = {sid: ChatDelta(TOK).after_turn([{"role": "user", "content": "more"}], sid) for sid in stops}
    lengths = b["attention_mask"][:, P_MAX:].sum(1)
    full_games = 0
    for row in range(len(out)):
        L, resp, mask, rew = int(lengths[row]), b["responses"][row], b["response_mask"][row], b["turn_rewards"][row]
        spans = _spans(mask, L)
        for a, e in spans:  # user turns: the template's delta after the turn's stop token, no loss, no log-prob
            assert resp[a:e].tolist() == delta_after[int(resp[a - 1])]
            assert (b["rollout_log_probs"][row, a:e] == 0).all() and rew[a - 1] == STEP_REWARD
        assert (rew[mask == 0] == 0).all()
        # the last turn is judged when it ended on a stop token inside the budget (its observation may not fit)
        judged = len(spans) + int(int(resp[L - 1]) in stops and L < R)
        if judged == 3:  # the third judged turn ends the game with its reward
            assert rew[L - 1] == DONE_REWARD
            full_games += 1
        expected = sum(STEP_REWARD if k < 3 else DONE_REWARD for k in range(1, judged + 1))
        assert float(rew.sum()) == expected, (row, spans, L)
    assert full_games > 0
    # KV reuse across user turns = one plain forward over prompt + all turns
    torch.testing.assert_close(b["rollout_log_probs"], hf_logprobs(model, out, 1.0), atol=2e-4, rtol=0)


def test_max_user_turns_zero_only_scores_the_first_turn():
    model = make_model("tiny")
    stops = _stops(model.config.vocab_size, "\nUser: go\nAssistant:")
    out = _engine(model, 32, stops, max_user_turns=0).generate(_prompts(["abc", "defg"], n=2))
    b, stops = out.batch, stops + [EOS]
    assert out.meta_info["metrics"]["num_turns/max"] == 1
    assert torch.equal(b["response_mask"], b["attention_mask"][:, P_MAX:])  # no appended tokens
    ended = torch.tensor([int(r[int(n) - 1]) in stops and n < 32
                          for r, n in zip(b["responses"], b["response_mask"].sum(1))])
    assert torch.equal(b["turn_rewards"].sum(1) > 0, ended)  # a judged (complete) first turn got its step reward


# ------------------------------------------------------------------------------------- tools_kwargs from parquet
class AlwaysRecorder(ToolFormat):
    name = "always_recorder"

    def parse(self, text):
        return [ToolCall("recorder", {"x": 1})]

    def render(self, results):
        return "|" + "".join(results) + "|"


class Recorder(Tool):
    """Records, per trajectory, the create/execute kwargs it was given; its state lives in the context."""

    name = "recorder"
    seen: dict[str, list] = {}

    def create(self, context):
        context.state["secret"] = context.create_kwargs["secret"]

    def execute(self, arguments, context):
        Recorder.seen.setdefault(context.trajectory_id, []).append(
            (context.state["secret"], context.execute_kwargs, arguments))
        return ToolResult("ok", reward=float(context.execute_kwargs.get("bonus", 0.0)))

    def release(self, context):
        Recorder.seen[context.trajectory_id].append("released")


def test_tools_kwargs_from_a_parquet_row_reach_create_and_execute(tmp_path):
    rows = [{"data_source": "t", "prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"style": "rule", "ground_truth": str(i)},
             "extra_info": {"index": i, "tools_kwargs": {"recorder": {
                 "create_kwargs": {"secret": 100 + i},
                 # keys differ between rows: parquet fills the missing ones with None, which the context drops
                 "execute_kwargs": {"bonus": 0.25} if i % 2 else {"unit": "cm"}}}}} for i in range(3)]
    path = write_rows(rows, tmp_path / "train.parquet")
    ds = RLHFDataset.from_files(str(path), TOK, max_prompt_length=P_MAX)
    batch = ds.collate([ds[i] for i in range(len(ds))])
    batch.meta_info = {"n": 2}
    model = make_model("tiny")
    eng = make_engine(model, P_MAX, 48, stop_token_ids=_stops(model.config.vocab_size, "|ok|"))
    eng.session = ToolSession({"recorder": Recorder()}, AlwaysRecorder(), TOK, max_assistant_turns=2,
                              max_tool_response_length=8, tool_timeout_s=5.0, tool_workers=2)
    Recorder.seen = {}
    out = eng.generate(batch)
    assert Recorder.seen, "no trajectory called the tool"
    for traj, calls in Recorder.seen.items():
        i = int(traj) // 2  # output row -> parquet row (n = 2 samples each)
        assert calls[-1] == "released"
        for secret, exec_kwargs, args in calls[:-1]:
            assert secret == 100 + i and args == {"x": 1}
            assert exec_kwargs == ({"bonus": 0.25} if i % 2 else {"unit": "cm"})
    # ToolResult.reward is the calling turn's reward, on its last model token
    rewards = out.batch["turn_rewards"].sum(1)
    for traj, calls in Recorder.seen.items():
        assert float(rewards[int(traj)]) == (0.25 * (len(calls) - 1) if (int(traj) // 2) % 2 else 0.0)
