"""The built-in character-level tokenizer for the synthetic tasks and random-init presets.

Saved as a standard `tokenizer.json` (+ `tokenizer_config.json` with a chat template) so any HF tool loads it with
`AutoTokenizer.from_pretrained(dir)`. Characters are tokens: small vocab, exact round trips, no training needed.

Decision: it is a byte-level BPE with no merges (space is stored as "Ġ", newline as "Ċ", as GPT-2/Qwen vocabularies
do). Next to a Qwen2/Llama config.json, transformers 5 rebuilds a tokenizer as the model type's class (e.g.
Qwen2Tokenizer: byte-level BPE from our vocab and merges); in this form that rebuild encodes exactly as we do,
where a word-level vocab with a literal " " lost every space.
"""

from __future__ import annotations

import json
import string
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS = "<|pad|>", "<|endoftext|>", "<|bos|>"
SPECIAL_TOKENS = [PAD, EOS, BOS]
CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"
# Plain template: what the built-in tasks and quickstart use; `add_generation_prompt` ends with "Assistant:". A `tool`
# message is a user turn of one <tool_response> block: the layout of the `hermes_plain` tool-call format.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% elif m['role'] == 'tool' %}User: <tool_response>{{ m['content'] }}</tool_response>\n"
    "{% else %}Assistant: {{ m['content'] }}" + EOS + "\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}  # "Ġ", "Ċ": the byte-level alphabet's names for space and newline


def _vocab() -> dict[str, int]:
    tokens = SPECIAL_TOKENS + [BYTE_LEVEL.get(c, c) for c in CHARS]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer_json() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab=_vocab(), merges=[]))  # no merges: every character is its own token
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def save_builtin_tokenizer(out_dir: str | Path) -> Path:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer_json().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": PAD,
        "eos_token": EOS,
        "bos_token": BOS,
        "model_max_length": 4096,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({"pad_token": PAD, "eos_token": EOS, "bos_token": BOS}))
    return out


@lru_cache(maxsize=1)
def builtin_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in tokenizer as a transformers tokenizer (cached; treat as read-only)."""
    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer_json(),
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
