"""`hybridflow generate --input prompts.parquet --output out.parquet [CONFIG.yaml ...] [a.b=c ...]`.

Offline generation with the rollout engine: each input row keeps its columns and gains `responses` (list of
`rollout.n` strings) and `response_lengths` (tokens). The prompt column (`data.prompt_key`) holds chat messages or
a string (one user message), built into a prompt exactly as training does (`data.chat_template`, see
`hybridflow.data.templates`). Prompt i is seeded with rollout.seed and i, so the output does not depend on
--batch-size.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from typing import Any

import torch

from hybridflow.commands.common import add_config_args, fail, load_from_args
from hybridflow.commands.tracked import add_run_flags
from hybridflow.config.schema import Config
from hybridflow.protocol import keys
from hybridflow.utils.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="parquet file of prompts (column data.prompt_key)")
    parser.add_argument("--output", required=True, help="parquet file to write")
    parser.add_argument("--batch-size", type=int, default=256, help="prompts per generate call")
    parser.add_argument("--validate", action="store_true", help="sample with rollout.val_kwargs (greedy by default)")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    add_config_args(parser)
    add_run_flags(parser)  # accepted as by every command that runs a model (generate prints no metrics)


def _prompt_ids(tokenizer: Tokenizer, value: Any, key: str, row: int, chat_template: str | None) -> list[int]:
    from hybridflow.data.templates import MalformedRow, prompt_ids

    try:
        return prompt_ids(tokenizer, value, chat_template)
    except MalformedRow as err:
        raise ValueError(f"row {row}, column data.prompt_key={key!r}: {err}; give text or a list of "
                         "{role, content} messages") from None


def run(args: argparse.Namespace) -> int:
    cfg = load_from_args(args.args, preflight=True, data=False, reward=False, runs=True)
    if args.batch_size < 1:
        return fail(ValueError(f"--batch-size={args.batch_size} must be >= 1"))
    try:
        n_rows = _generate(cfg, args)
    except ValueError as err:
        return fail(err)
    print(f"wrote {n_rows} rows to {args.output}")
    return 0


def _generate(cfg: Config, args: argparse.Namespace) -> int:
    from hybridflow.data.collate import pad_sequences, position_ids_from_mask
    from hybridflow.data.parquet_io import read_rows, write_rows
    from hybridflow.models.loader import load_model, load_tokenizer
    from hybridflow.protocol import DataProto
    from hybridflow.rollout import RolloutEngine, SamplingParams

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, "actor", dtype=dtype).to(device).eval()
    rows = read_rows(args.input)
    key, max_p = cfg.data.prompt_key, cfg.data.max_prompt_length
    if rows and key not in rows[0]:
        raise ValueError(f"{args.input} has no column data.prompt_key={key!r}; columns: {sorted(rows[0])}")
    ids = [_prompt_ids(tokenizer, r[key], key, i, cfg.data.chat_template) for i, r in enumerate(rows)]
    too_long = [i for i, x in enumerate(ids) if len(x) > max_p]
    if too_long:
        raise ValueError(f"{len(too_long)} prompts exceed data.max_prompt_length={max_p} tokens (first: row "
                         f"{too_long[0]}, {len(ids[too_long[0]])} tokens, data.chat_template={cfg.data.chat_template!r}); raise "
                         "data.max_prompt_length, or pass the data.chat_template the model was trained with")
    rollout_cfg = dataclasses.replace(cfg.rollout, free_cache_engine=False)
    engine = RolloutEngine(model, rollout_cfg, eos_token_id=tokenizer.eos_token_id,
                           pad_token_id=tokenizer.pad_token_id, max_prompt_length=max_p,
                           max_response_length=cfg.data.max_response_length, device=device)
    sampling = SamplingParams.from_config(cfg.rollout, validate=args.validate)
    out_rows = []
    for start in range(0, len(rows), args.batch_size):
        chunk = ids[start: start + args.batch_size]
        p_ids, mask = pad_sequences(chunk, tokenizer.pad_token_id, "left")
        seeds = [cfg.rollout.seed * 1_000_003 + start + i for i in range(len(chunk))]
        batch = DataProto.from_single_dict(
            {keys.INPUT_IDS: p_ids, keys.ATTENTION_MASK: mask, keys.POSITION_IDS: position_ids_from_mask(mask)},
            meta_info={keys.SEEDS: seeds})
        out = engine.generate(batch, sampling)
        lengths = out.batch[keys.RESPONSE_MASK].sum(-1).tolist()
        texts = [tokenizer.decode(r[:n].tolist(), skip_special_tokens=True)
                 for r, n in zip(out.batch[keys.RESPONSES], lengths)]
        for i in range(len(chunk)):
            sl = slice(i * sampling.n, (i + 1) * sampling.n)
            out_rows.append({**rows[start + i], keys.RESPONSES: texts[sl], "response_lengths": lengths[sl]})
        logger.info("generated %d / %d prompts", min(start + args.batch_size, len(rows)), len(rows))
    engine.release_cache()
    write_rows(out_rows, args.output)
    return len(out_rows)
