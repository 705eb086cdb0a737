"""Token deltas through the chat template: the ids to append after an assistant turn (or after the prompt) so that
the trajectory reads as if the whole conversation had been rendered by the template — without re-rendering or
re-tokenising what is already in the sequence (token in, token out).

How: render a fixed two-message conversation with and without the new messages; the template must reproduce the
shorter rendering as a prefix of the longer one (every common template does: Qwen/ChatML, Llama 3, the built-in
plain one). The new text is `full[len(base):]`, plus the end-of-turn text the template writes after an assistant
message minus what the model already generated (its stop token). Only that delta is tokenised.
"""

from __future__ import annotations

from typing import Any

from hybridflow.utils.chat_template import template_for
from hybridflow.utils.tokenizer_protocol import Tokenizer

_USER, _ASSISTANT = "hfq-user-7b1e", "hfq-assistant-4c2d"  # markers no template rewrites


class ChatDelta:
    """`after_turn(messages, stop_id)` and `after_prompt(messages, prompt_ids)` → ids to append."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.template = template_for(tokenizer, chat_template)
        self._end_marker: str | None = None

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _suffix(self, base_msgs: list[dict[str, Any]], new: list[dict[str, Any]]) -> str:
        base = self._render(base_msgs, False)
        full = self._render(base_msgs + new, True)
        if not full.startswith(base):
            raise ValueError("the chat template does not render a conversation as a prefix of its continuation, "
                             "so multi-turn deltas cannot be taken from it; set data.chat_template to a template "
                             "that does, or use a rollout.multi_turn.format that writes its own text")
        return full[len(base):]

    def end_marker(self) -> str:
        """The text the template writes right after an assistant message's content (e.g. "<|im_end|>\\n")."""
        if self._end_marker is None:
            base = self._render([{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}],
                                False)
            cut = base.rfind(_ASSISTANT)
            if cut < 0:
                raise ValueError("the chat template drops the assistant message's content; it cannot carry "
                                 "multi-turn conversations")
            self._end_marker = base[cut + len(_ASSISTANT):]
        return self._end_marker

    def after_turn(self, messages: list[dict[str, Any]], last_id: int | None) -> list[int]:
        """Ids that close an assistant turn whose last sampled token is `last_id` and open `messages` (user or
        tool), ending with the generation prompt of the next assistant turn."""
        conv = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}]
        close = self.end_marker()
        if last_id is not None:
            stop_text = self.tokenizer.decode([last_id], skip_special_tokens=False)
            if stop_text and close.startswith(stop_text):  # the model's stop token already closed the turn
                close = close[len(stop_text):]
        return self._encode(close + self._suffix(conv, messages))

    def after_prompt(self, messages: list[dict[str, Any]], prompt_ids: list[int]) -> list[int]:
        """A prompt (rendered with the generation prompt) extended by `messages`: the generation prompt's ids are
        taken off its end, the messages and a new generation prompt appended. Raises when the prompt does not end
        with the template's generation prompt."""
        conv = [{"role": "user", "content": _USER}]
        gen = self._render(conv, True)[len(self._render(conv, False)):]
        gen_ids = self._encode(gen)
        if gen_ids and list(prompt_ids[-len(gen_ids):]) != gen_ids:
            raise ValueError(f"the prompt does not end with the chat template's generation prompt {gen!r}, so an "
                             "interaction's first message cannot be added to it; render prompts with the same "
                             "template (data.chat_template) or let Interaction.reset return None")
        return list(prompt_ids[: len(prompt_ids) - len(gen_ids)]) + self._encode(self._suffix(conv, messages))
