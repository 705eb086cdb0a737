"""Models: HF causal LMs from local paths, random-init presets, the built-in tokenizer, value/reward heads."""

from hybridflow.models.heads import scalar_head_config, value_head
from hybridflow.models.loader import load_model, load_tokenizer, model_config, save_model, save_pretrained
from hybridflow.models.presets import PRESETS, preset_config
from hybridflow.models.tokenizer import builtin_tokenizer, save_builtin_tokenizer

__all__ = [
    "PRESETS", "builtin_tokenizer", "load_model", "load_tokenizer", "model_config", "preset_config",
    "save_builtin_tokenizer", "save_model", "save_pretrained", "scalar_head_config", "value_head",
]
