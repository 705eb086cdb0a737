"""`ToolSession`: the host side of multi-turn rollouts — parse a finished turn, run its tool calls in a thread
pool with a per-call timeout, and turn the results into the exact token ids appended to the trajectory.

The rollout scheduler (`rollout/multi_turn.py`) only sees token ids: `on_turn_end(row, turn_ids)` returns a
`PendingTools` (poll `ready()`, then `collect()` → ids) or None when the trajectory ends. Malformed calls, unknown
tools, tool exceptions and timeouts become an error text the model reads, and are counted. A timed-out call's thread
cannot be killed: it finishes in the background and its result is dropped (the `python` tool's sandbox has its own
time limit, so it ends).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybridflow.agentic.formats import ToolCall, ToolFormat, get_format
from hybridflow.agentic.tools import Tool, ToolContext, ToolResult, build_tools

logger = logging.getLogger(__name__)


@dataclass
class RowStats:
    turns: int = 0  # assistant turns
    tool_calls: int = 0
    errors: int = 0  # malformed calls, unknown tools, tool failures (exceptions or ToolResult.is_error)
    malformed: int = 0
    timeouts: int = 0
    tool_s: float = 0.0
    tool_reward: float = 0.0
    per_tool: dict[str, int] = field(default_factory=dict)
    created: set[str] = field(default_factory=set)


@dataclass
class _Call:
    call: ToolCall
    future: Future | None  # None: answered at once (malformed or unknown tool)
    immediate: ToolResult | None = None


class PendingTools:
    """The calls of one turn; ready when all finished or the timeout passed."""

    def __init__(self, calls: list[_Call], timeout_s: float) -> None:
        self.calls, self.deadline = calls, time.monotonic() + timeout_s

    def ready(self) -> bool:
        return time.monotonic() >= self.deadline or all(c.future is None or c.future.done() for c in self.calls)

    def futures(self) -> list[Future]:
        return [c.future for c in self.calls if c.future is not None and not c.future.done()]


class ToolSession:
    def __init__(self, tools: dict[str, Tool], fmt: ToolFormat, tokenizer: Any, *, max_assistant_turns: int,
                 max_tool_response_length: int, tool_timeout_s: float, tool_workers: int) -> None:
        self.tools, self.fmt, self.tokenizer = tools, fmt, tokenizer
        self.max_turns, self.max_tool_len, self.timeout_s = max_assistant_turns, max_tool_response_length, tool_timeout_s
        self.pool = ThreadPoolExecutor(max_workers=tool_workers, thread_name_prefix="hybridflow-tool")
        self.rows: list[RowStats] = []
        self.contexts: list[ToolContext] = []

    @classmethod
    def from_config(cls, mt_cfg: Any, tokenizer: Any) -> ToolSession:
        tools = build_tools(mt_cfg.tool_config_path, list(mt_cfg.tools))
        if not tools:
            raise ValueError("rollout.multi_turn.enable=true but no tools: list built-ins in rollout.multi_turn.tools "
                             "(e.g. [calculator]) or set rollout.multi_turn.tool_config_path")
        return cls(tools, get_format(mt_cfg.format), tokenizer, max_assistant_turns=mt_cfg.max_assistant_turns,
                   max_tool_response_length=mt_cfg.max_tool_response_length, tool_timeout_s=mt_cfg.tool_timeout_s,
                   tool_workers=mt_cfg.tool_workers)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # --------------------------------------------------------------------------------------------- per batch
    def begin(self, extra_info: list[Any]) -> None:
        """One entry per output row (already repeated n times); reads `extra_info.tools_kwargs`."""
        self.rows = [RowStats() for _ in extra_info]
        self.contexts = []
        for i, info in enumerate(extra_info):
            kwargs = info.get("tools_kwargs", {}) if isinstance(info, dict) else {}
            self.contexts.append(ToolContext(trajectory_id=str(i), kwargs=dict(kwargs or {})))

    def on_turn_end(self, row: int, turn_ids: list[int], turn_complete: bool) -> PendingTools | None:
        """A turn of `row` ended (`turn_complete`: on a stop token, not out of budget). Returns its tool calls,
        submitted, or None when the trajectory ends here."""
        st = self.rows[row]
        st.turns += 1
        if not turn_complete:
            return None
        calls = self.fmt.parse(self.tokenizer.decode(turn_ids, skip_special_tokens=True))
        if not calls or st.turns >= self.max_turns:
            return None
        out = []
        for call in calls:
            st.tool_calls += 1
            if call.error is None:
                st.per_tool[call.name] = st.per_tool.get(call.name, 0) + 1
            if call.error is not None:
                st.malformed += 1
                out.append(_Call(call, None, ToolResult(f"Error: {call.error}", is_error=True)))
            elif call.name not in self.tools:
                out.append(_Call(call, None, ToolResult(
                    f"Error: unknown tool {call.name!r}; available: {', '.join(self.tools)}", is_error=True)))
            else:
                out.append(_Call(call, self.pool.submit(self._run, row, call)))
        return PendingTools(out, self.timeout_s)

    def _run(self, row: int, call: ToolCall) -> tuple[ToolResult, float]:
        tool, ctx = self.tools[call.name], self.contexts[row]
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

    def collect(self, row: int, pending: PendingTools) -> list[int]:
        """The token ids appended after the turn: the rendered responses (each cut to max_tool_response_length)."""
        st, texts = self.rows[row], []
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
            st.tool_reward += res.reward or 0.0
            texts.append(self._truncate(res.text))
        return self.tokenizer.encode(self.fmt.render(texts), add_special_tokens=False)

    def _truncate(self, text: str) -> str:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= self.max_tool_len:
            return text
        return self.tokenizer.decode(ids[: self.max_tool_len], skip_special_tokens=True) + "..."

    def end(self, row: int) -> None:
        """The trajectory is over: release the stateful tools it created."""
        for name in sorted(self.rows[row].created):
            self.tools[name].release(self.contexts[row])

    def metrics(self) -> dict[str, float]:
        if not self.rows:
            return {}
        turns = np.array([r.turns for r in self.rows])
        calls = np.array([r.tool_calls for r in self.rows])
        per_tool: dict[str, float] = {}
        for r in self.rows:
            for name, k in r.per_tool.items():
                per_tool[f"tool_calls/by_tool/{name}"] = per_tool.get(f"tool_calls/by_tool/{name}", 0.0) + k
        return per_tool | {
            "num_turns/mean": float(turns.mean()), "num_turns/max": float(turns.max()),
            "tool_calls/mean": float(calls.mean()), "tool_calls/max": float(calls.max()),
            "tool_errors": float(sum(r.errors for r in self.rows)),
            "tool_calls/malformed": float(sum(r.malformed for r in self.rows)),
            "tool_timeouts": float(sum(r.timeouts for r in self.rows)),
            "tool_reward/mean": float(np.mean([r.tool_reward for r in self.rows])),
            "timing/tool": float(sum(r.tool_s for r in self.rows)),  # tool seconds summed over calls
        }
