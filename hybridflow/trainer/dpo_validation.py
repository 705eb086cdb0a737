"""The prompts on which `hybridflow dpo` measures the policy's greedy task accuracy, when a scorer can grade them.

Decision: a preference accuracy measured on pairs (implicit reward, or log π(chosen) > log π(rejected)) says
nothing about what the policy generates — it can reach 0.9 while greedy answers are half degenerate. So validation
also generates, on the trained model's own parameters and exactly as `hybridflow train` validates
(`trainer/validation.py`, `rollout.val_kwargs`, `reward.*`), whenever the validation prompts carry a
`data_source` with a scorer: the built-in tasks always do; parquet pairs do when `data.val_files` have a prompt
column, `data_source` and `reward_model` (verl's columns). Otherwise — or with `dpo.val_generate=false` — only
the pair metrics are reported, and the reason is logged once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hybridflow.config import Config
from hybridflow.data import read_rows, task_splits
from hybridflow.data.contract import ground_truth_required
from hybridflow.data.preference_columns import resolve_columns
from hybridflow.data.rl_dataset import RLHFDataset
from hybridflow.protocol import keys
from hybridflow.rewards.manager import MODEL_SOURCE
from hybridflow.rewards.registry import reward_fn_name

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

NAME = "dpo-val-prompts"


def _val_rows(cfg: Config) -> tuple[list[dict[str, Any]], str | None, str]:
    """(rows, prompt column, why not) of the validation prompts: the task's validation rows, or the val files'."""

    d = cfg.data
    if not d.train_files:
        return task_splits(d.task, d.train_size, d.val_size, d.seed)[1], "prompt", ""
    if not d.val_files:
        return [], None, "no data.val_files"
    rows = read_rows(d.val_files)
    columns = list(rows[0]) if rows else []
    prompt = resolve_columns(columns, d.prompt_key, d.chosen_key, d.rejected_key, "dpo-val").prompt
    missing = [c for c in (keys.DATA_SOURCE, keys.REWARD_MODEL) if c not in columns] + ([] if prompt else ["a prompt"])
    if missing:
        return [], None, f"data.val_files have no {' / '.join(missing)} column"
    unique = {repr((r.get(prompt), r.get(keys.DATA_SOURCE), r.get(keys.REWARD_MODEL))): r for r in rows}
    return list(unique.values()), prompt, ""


def _unscored(cfg: Config, rows: list[dict[str, Any]]) -> str:
    """Why the rows cannot be scored by `reward.*` ("" when they can)."""
    names = [s.name for s in cfg.reward.sources]
    if MODEL_SOURCE in names:
        return "reward.sources uses the reward model, which hybridflow dpo does not build"
    if "rule" in names:
        for source in sorted({str(r.get(keys.DATA_SOURCE)) for r in rows}):
            try:
                reward_fn_name(source)
            except ValueError:
                return f"no rule scorer for data_source {source!r}"
    return ""


def scored_val_prompts(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> RLHFDataset | None:
    """The validation prompts greedy accuracy is measured on, or None (the reason is logged)."""
    if not cfg.dpo.val_generate:
        return None
    rows, prompt, why = _val_rows(cfg)
    why = why or _unscored(cfg, rows)
    if why:
        logger.info("dpo: validation reports the pair metrics only, no greedy val/accuracy: %s", why)
        return None
    d = cfg.data
    try:
        return RLHFDataset(rows, tokenizer, max_prompt_length=d.max_prompt_length, truncation=d.truncation,
                           prompt_key=prompt, strict=d.strict, chat_template=d.chat_template, name=NAME,
                           require_ground_truth=ground_truth_required(d, cfg.reward))
    except ValueError as err:
        raise ValueError(f"{err} (greedy validation of hybridflow dpo; set dpo.val_generate=false to validate on "
                         "the pairs only)") from err
