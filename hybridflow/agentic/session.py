"""`ToolSession`: the host side of multi-turn rollouts — parse a finished turn, run its tool calls (or the
interaction's step) in a thread pool with a timeout, and turn the results into the exact token ids appended to the
trajectory.

The rollout scheduler (`rollout/multi_turn.py`) only sees token ids: `begin(extra_info)` starts the rows (and returns
each interaction's first user message), `on_turn_end(row, turn_ids)` returns a `Pending` (poll `ready()`, then
`collect()` → `TurnResult(ids, reward)`; `ids` None = the trajectory ends) or None when the trajectory ends at once.

A turn with tool calls runs the tools; a turn without calls goes to the row's interaction, if one is configured
(`step(text) -> (observation, reward, done)`), else ends the trajectory. Malformed calls, unknown tools, tool
exceptions and timeouts become an error text the model reads, and are counted. An interaction that raises is a bug
in its code and fails the rollout (named); one that times out ends its trajectory (counted). A timed-out call's
thread cannot be killed: it finishes in the background and its result is dropped (the `python` tool's sandbox has
its own time limit, so it ends).

Per-turn rewards: `ToolResult.reward` (summed over a turn's calls) and `InteractionStep.reward` are the reward of
the assistant turn that made the calls / was judged; the scheduler puts it on that turn's last model token
(`turn_rewards`), and the trainer adds it to the outcome's token-level scores.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from hybridflow.agentic.chat_delta import ChatDelta
from hybridflow.agentic.formats import ToolCall, ToolFormat, get_format
from hybridflow.agentic.interactions import (
    Interaction,
    InteractionSpec,
    InteractionStep,
    load_interactions,
    pick,
)
from hybridflow.agentic.tools import Tool, ToolContext, ToolResult, build_tools
from hybridflow.utils.tokenizer_protocol import Tokenizer

if TYPE_CHECKING:
    from hybridflow.config.schema import MultiTurnConfig

logger = logging.getLogger(__name__)


@dataclass
class RowStats:
    turns: int = 0  # assistant turns
    user_turns: int = 0  # interaction observations appended (the first message from reset is not counted)
    tool_calls: int = 0
    errors: int = 0  # malformed calls, unknown tools, tool failures (exceptions or ToolResult.is_error)
    malformed: int = 0
    timeouts: int = 0
    interaction_timeouts: int = 0
    tool_s: float = 0.0
    tool_reward: float = 0.0
    interaction_reward: float = 0.0
    per_tool: dict[str, int] = field(default_factory=dict)
    created: set[str] = field(default_factory=set)


@dataclass
class _Call:
    call: ToolCall
    future: Future | None  # None: answered at once (malformed or unknown tool)
    immediate: ToolResult | None = None


@dataclass(frozen=True)
class TurnResult:
    ids: list[int] | None  # ids appended after the turn; None = the trajectory ends after it
    reward: float = 0.0  # the turn's reward from its tool calls or the interaction's judgement


class Pending:
    """What one finished turn waits for — its tool calls, or the interaction's step; ready when all finished or
    the timeout passed. `final`: the trajectory ends after collecting (a limit was reached; the step only
    scores the turn)."""

    def __init__(self, calls: list[_Call], timeout_s: float, last_id: int | None, *,
                 interaction: Future | None = None, final: bool = False) -> None:
        self.calls, self.deadline, self.last_id = calls, time.monotonic() + timeout_s, last_id
        self.interaction, self.final = interaction, final

    def _futures(self) -> list[Future]:
        fs = [c.future for c in self.calls if c.future is not None]
        return fs + ([self.interaction] if self.interaction is not None else [])

    def ready(self) -> bool:
        return time.monotonic() >= self.deadline or all(f.done() for f in self._futures())

    def futures(self) -> list[Future]:
        return [f for f in self._futures() if not f.done()]


PendingTools = Pending  # the name the first slice used


class ToolSession:
    def __init__(self, tools: dict[str, Tool], fmt: ToolFormat, tokenizer: Tokenizer, *, max_assistant_turns: int,
                 max_tool_response_length: int, tool_timeout_s: float, tool_workers: int,
                 interactions: dict[str, InteractionSpec] | None = None, max_user_turns: int = 0,
                 chat_template: str | None = None) -> None:
        self.tools, self.fmt, self.tokenizer = tools, fmt, tokenizer
        self.max_turns, self.max_tool_len, self.timeout_s = max_assistant_turns, max_tool_response_length, tool_timeout_s
        self.interactions, self.max_user_turns = dict(interactions or {}), max_user_turns
        self.chat = ChatDelta(tokenizer, chat_template)
        self.pool = ThreadPoolExecutor(max_workers=tool_workers, thread_name_prefix="hybridflow-tool")
        self.rows: list[RowStats] = []
        self.contexts: list[dict[str, ToolContext]] = []  # row -> tool name -> context
        self.envs: list[Interaction | None] = []

    @classmethod
    def from_config(cls, mt_cfg: MultiTurnConfig, tokenizer: Tokenizer, chat_template: str | None = None
                    ) -> ToolSession:
        tools = build_tools(mt_cfg.tool_config_path, list(mt_cfg.tools))
        interactions = load_interactions(mt_cfg.interaction_config_path) if mt_cfg.interaction_config_path else {}
        if not tools and not interactions:
            raise ValueError("rollout.multi_turn.enable=true but no tools and no interaction: list built-ins in "
                             "rollout.multi_turn.tools (e.g. [calculator]), or set rollout.multi_turn."
                             "tool_config_path or rollout.multi_turn.interaction_config_path")
        return cls(tools, get_format(mt_cfg.format), tokenizer, max_assistant_turns=mt_cfg.max_assistant_turns,
                   max_tool_response_length=mt_cfg.max_tool_response_length, tool_timeout_s=mt_cfg.tool_timeout_s,
                   tool_workers=mt_cfg.tool_workers, interactions=interactions,
                   max_user_turns=mt_cfg.max_user_turns, chat_template=chat_template)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # --------------------------------------------------------------------------------------------- per batch
    def begin(self, extra_info: list[Any]) -> list[str | None]:
        """One entry per output row (already repeated n times). Reads `extra_info.tools_kwargs[<tool>]` (each
        tool's context) and `extra_info.interaction_kwargs` (resets the row's interaction); returns each row's
        first user message from `Interaction.reset` (None: none)."""
        self.rows = [RowStats() for _ in extra_info]
        self.contexts, self.envs, first = [], [], []
        for i, info in enumerate(extra_info):
            info = info if isinstance(info, dict) else {}
            tools_kwargs = _mapping(info.get("tools_kwargs"), f"row {i}: extra_info.tools_kwargs")
            self.contexts.append({name: ToolContext(trajectory_id=str(i), kwargs=_mapping(
                tools_kwargs.get(name), f"row {i}: extra_info.tools_kwargs.{name}")) for name in self.tools})
            kwargs = _mapping(info.get("interaction_kwargs"), f"row {i}: extra_info.interaction_kwargs")
            spec = pick(self.interactions, kwargs, i)
            env = spec.new() if spec is not None else None
            self.envs.append(env)
            first.append(env.reset({k: v for k, v in kwargs.items() if k != "name"}) if env is not None else None)
        return first

    def on_turn_end(self, row: int, turn_ids: list[int], turn_complete: bool) -> Pending | None:
        """A turn of `row` ended (`turn_complete`: on a stop token, not out of budget). Returns what it waits
        for, submitted, or None when the trajectory ends here."""
        st = self.rows[row]
        st.turns += 1
        if not turn_complete:
            return None
        text = self.tokenizer.decode(turn_ids, skip_special_tokens=True)
        last_id = turn_ids[-1] if turn_ids else None
        calls = self.fmt.parse(text) if self.tools else []
        if calls:
            return self._submit_calls(row, calls, last_id) if st.turns < self.max_turns else None
        env = self.envs[row] if self.envs else None
        if env is None:
            return None
        final = st.turns >= self.max_turns or st.user_turns >= self.max_user_turns
        return Pending([], self.timeout_s, last_id, interaction=self.pool.submit(self._step, row, env, text),
                       final=final)

    def _submit_calls(self, row: int, calls: list[ToolCall], last_id: int | None) -> Pending:
        st, out = self.rows[row], []
        for call in calls:
            st.tool_calls += 1
            if call.error is not None:
                st.malformed += 1
                out.append(_Call(call, None, ToolResult(f"Error: {call.error}", is_error=True)))
                continue
            st.per_tool[call.name] = st.per_tool.get(call.name, 0) + 1
            if call.name not in self.tools:
                out.append(_Call(call, None, ToolResult(
                    f"Error: unknown tool {call.name!r}; available: {', '.join(self.tools)}", is_error=True)))
            else:
                out.append(_Call(call, self.pool.submit(self._run, row, call)))
        return Pending(out, self.timeout_s, last_id)

    def _run(self, row: int, call: ToolCall) -> tuple[ToolResult, float]:
        tool, ctx = self.tools[call.name], self.contexts[row][call.name]
        t0 = time.perf_counter()
        try:
            if call.name not in self.rows[row].created:
                tool.create(ctx)
                self.rows[row].created.add(call.name)
            res = tool.execute(call.arguments, ctx)
        except Exception as err:  # noqa: BLE001 — a user tool may raise anything; the model reads the error
            logger.debug("tool %s raised %s: %s", call.name, type(err).__name__, err)
            res = ToolResult(f"Error: {type(err).__name__}: {err}", is_error=True)
        return res, time.perf_counter() - t0

    @staticmethod
    def _step(row: int, env: Interaction, text: str) -> InteractionStep:
        try:
            res = env.step(text)
        except Exception as err:
            raise RuntimeError(f"interaction {type(env).__name__}.step raised on row {row}: "
                               f"{type(err).__name__}: {err}") from err
        if isinstance(res, tuple) and len(res) == 3:
            res = InteractionStep(str(res[0]), float(res[1]), bool(res[2]))
        if not isinstance(res, InteractionStep):
            raise TypeError(f"interaction {type(env).__name__}.step returned {type(res).__name__}; return "
                            "InteractionStep(observation, reward, done) or an (observation, reward, done) tuple")
        return res

    def collect(self, row: int, pending: Pending) -> TurnResult:
        """The turn's outcome: the ids appended after it (the rendered responses, each cut to
        max_tool_response_length tokens) and its reward."""
        if pending.interaction is not None:
            return self._collect_step(row, pending)
        st, texts, reward = self.rows[row], [], 0.0
        for c in pending.calls:
            if c.future is None:
                res = c.immediate
            elif not c.future.done():
                c.future.cancel()
                st.timeouts += 1
                res = ToolResult(f"Error: tool {c.call.name!r} timed out after {self.timeout_s}s", is_error=True)
            else:
                res, seconds = c.future.result()
                st.tool_s += seconds
            assert res is not None, "an immediate call has its result"
            st.errors += int(res.is_error)
            reward += res.reward or 0.0
            texts.append(self._truncate(res.text))
        st.tool_reward += reward
        if self.fmt.via_template:
            ids = self.chat.after_turn([{"role": "tool", "content": t} for t in texts], pending.last_id)
        else:
            ids = self.tokenizer.encode(self.fmt.render(texts), add_special_tokens=False)
        return TurnResult(list(ids), reward)

    def _collect_step(self, row: int, pending: Pending) -> TurnResult:
        st, fut = self.rows[row], pending.interaction
        if not fut.done():
            fut.cancel()
            st.interaction_timeouts += 1
            return TurnResult(None, 0.0)
        res = fut.result()  # an interaction's exception propagates: a bug in its code, named by _step
        st.interaction_reward += res.reward
        if res.done or pending.final:
            return TurnResult(None, res.reward)
        st.user_turns += 1
        ids = self.chat.after_turn([{"role": "user", "content": self._truncate(res.observation)}], pending.last_id)
        return TurnResult(ids, res.reward)

    def first_message_ids(self, message: str, prompt_ids: list[int]) -> list[int]:
        """A prompt extended by an interaction's first user message (through the chat template)."""
        return self.chat.after_prompt([{"role": "user", "content": message}], prompt_ids)

    def _truncate(self, text: str) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= self.max_tool_len:
            return text
        return self.tokenizer.decode(ids[: self.max_tool_len], skip_special_tokens=True) + "..."

    def end(self, row: int) -> None:
        """The trajectory is over: release the stateful tools it created."""
        for name in sorted(self.rows[row].created):
            self.tools[name].release(self.contexts[row][name])

    def metrics(self) -> dict[str, float]:
        if not self.rows:
            return {}
        turns = np.array([r.turns for r in self.rows])
        calls = np.array([r.tool_calls for r in self.rows])
        per_tool: dict[str, float] = {}
        for r in self.rows:
            for name, k in r.per_tool.items():
                per_tool[f"tool_calls/by_tool/{name}"] = per_tool.get(f"tool_calls/by_tool/{name}", 0.0) + k
        out = per_tool | {
            "num_turns/mean": float(turns.mean()), "num_turns/max": float(turns.max()),
            "tool_calls/mean": float(calls.mean()), "tool_calls/max": float(calls.max()),
            "tool_errors": float(sum(r.errors for r in self.rows)),
            "tool_calls/malformed": float(sum(r.malformed for r in self.rows)),
            "tool_timeouts": float(sum(r.timeouts for r in self.rows)),
            "tool_reward/mean": float(np.mean([r.tool_reward for r in self.rows])),
            "timing/tool": float(sum(r.tool_s for r in self.rows)),  # tool seconds summed over calls
        }
        if self.interactions:
            user = np.array([r.user_turns for r in self.rows])
            out |= {"num_user_turns/mean": float(user.mean()), "num_user_turns/max": float(user.max()),
                    "interaction_reward/mean": float(np.mean([r.interaction_reward for r in self.rows])),
                    "interaction_timeouts": float(sum(r.interaction_timeouts for r in self.rows))}
        return out


def _mapping(value: Any, where: str) -> dict[str, Any]:
    """A verl-schema dict cell (parquet fills keys other rows have with None) → a dict; anything else raises."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a dict (verl schema), got {type(value).__name__}: {value!r}")
    return {k: v for k, v in value.items() if v is not None}
