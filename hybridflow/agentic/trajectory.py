"""A multi-turn trajectory as turns: the response row split where `response_mask` switches between sampled tokens
(assistant turns) and appended ones (tool responses, user messages: `context`). Validation logs it this way."""

from __future__ import annotations

from hybridflow.utils.tokenizer_protocol import Tokenizer


def split_turns(response_ids: list[int], model_mask: list[int]) -> list[tuple[str, list[int]]]:
    """[(role, ids)] in order; role is `assistant` for a run of sampled tokens, `context` for a run of appended
    ones. `response_ids`/`model_mask` cover the real tokens only (no right padding)."""
    if len(response_ids) != len(model_mask):
        raise ValueError(f"response has {len(response_ids)} tokens but its mask {len(model_mask)}")
    turns: list[tuple[str, list[int]]] = []
    for tok, m in zip(response_ids, model_mask):
        role = "assistant" if m else "context"
        if turns and turns[-1][0] == role:
            turns[-1][1].append(tok)
        else:
            turns.append((role, [tok]))
    return turns


def decoded_turns(tokenizer: Tokenizer, response_ids: list[int], model_mask: list[int]) -> list[dict[str, str]]:
    """`split_turns` with each run decoded (special tokens kept, so turn markers show)."""
    return [{"role": role, "text": tokenizer.decode(ids, skip_special_tokens=False)}
            for role, ids in split_turns(response_ids, model_mask)]


def format_turns(turns: list[dict[str, str]]) -> str:
    """One line per turn: `[assistant] ...` / `[context] ...` (text repr'd, so newlines stay on one line)."""
    return "\n".join(f"  [{t['role']}] {t['text']!r}" for t in turns)
