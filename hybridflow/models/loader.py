"""Load HF causal LMs (or vision-language models, scalar-head critics / reward models) and tokenizers from local dirs or presets; save back.

Decision: only local directories (config.json + safetensors) or Hugging Face model ids already in the local HF
cache (resolved with `local_files_only`), never a hub download; presets are random-init from `presets.py` with a
fixed seed. Weights load in float32 (master weights); compute dtype is the engine's
business. Saving writes safetensors + config.json + the tokenizer so HF `from_pretrained` reads it back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from hybridflow.models.heads import SCALAR_HEAD_ROLES, scalar_head_from_config, scalar_head_from_pretrained
from hybridflow.models.presets import preset_config
from hybridflow.models.tiny_vl import PRESET as VL_PRESET
from hybridflow.models.tiny_vl import tiny_vl_image_processor, tiny_vl_tokenizer
from hybridflow.models.tokenizer import builtin_tokenizer

logger = logging.getLogger(__name__)

ROLES = ("actor", "ref", "critic", "reward")
HEADS = ("lm", "value")  # causal LM | backbone + scalar head
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


class ModelSource(Protocol):
    """The `model.*` keys the loader reads; `config.schema.ModelConfig` is the one implementation. A protocol, not
    an import, so that models/ sits below config/ (whose auto sizes read preset shapes from here)."""

    path: str | None
    preset: str
    tokenizer_path: str | None
    trust_remote_code: bool
    override_config: dict[str, Any]
    seed: int


_HF_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")  # "org/name", as the Hub spells repository ids


def resolve_path(path: str, key: str = "model.path") -> Path:
    """A local directory as given, else a Hugging Face model id ("Qwen/Qwen2.5-0.5B-Instruct") resolved to its
    snapshot in the local HF cache (`HF_HUB_CACHE`) with `local_files_only` — hybridflow never downloads."""
    p = Path(path).expanduser()
    if p.exists() or not _HF_ID.match(str(path)):
        return p
    from huggingface_hub import constants as hf_constants
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(path), local_files_only=True))
    except LocalEntryNotFoundError:
        raise ValueError(
            f"{key}={path!r} is neither a local directory nor a model in the local Hugging Face cache "
            f"({hf_constants.HF_HUB_CACHE}); hybridflow never downloads at run time: fetch it once with "
            f"`hf download {path}` (or `huggingface-cli download {path}`), or set {key} to a local directory"
        ) from None


def _check_dir(path: str, key: str) -> Path:
    p = resolve_path(path, key)
    if not (p / "config.json").is_file():
        raise ValueError(f"{key}={path!r} is not a local HF model directory (no config.json); give a directory "
                         "holding config.json + *.safetensors (or a cached Hugging Face model id), or set "
                         "model.path=null to use model.preset")
    return p


def load_tokenizer(cfg: ModelSource) -> PreTrainedTokenizerBase:
    """`model.tokenizer_path`, else `model.path`, else the built-in tokenizer (presets)."""
    path = cfg.tokenizer_path or cfg.path
    if path is None:
        return tiny_vl_tokenizer() if cfg.preset == VL_PRESET else builtin_tokenizer()
    key = "model.tokenizer_path" if cfg.tokenizer_path else "model.path"
    where = resolve_path(path, key)
    try:
        tok = _auto_tokenizer(where, cfg.trust_remote_code)
    except Exception as err:  # json, tokenizers (a bare Exception from Rust), OSError...: name the file, then re-raise
        raise ValueError(f"{key}={path!r}: cannot load the tokenizer: {tokenizer_culprit(where)}: "
                         f"{type(err).__name__}: {err}. Fix: restore the file (e.g. re-export the model or copy "
                         "the tokenizer files from the original model), or point model.tokenizer_path at a good "
                         "tokenizer directory") from err
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
        logger.warning("tokenizer at %s has no pad token; using eos %r", path, tok.eos_token)
    return tok


def tokenizer_culprit(path: Path) -> str:
    """The tokenizer file in `path` that is damaged: the first JSON file that does not parse, else tokenizer.json
    (valid JSON that the tokenizers library refuses), else the directory."""
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json")
    for name in names:
        f = path / name
        if f.is_file():
            try:
                json.loads(f.read_text())
            except (ValueError, UnicodeDecodeError):
                return f"{f} is not valid JSON"
    tok = path / "tokenizer.json"
    return f"{tok} was refused" if tok.is_file() else f"the tokenizer files in {path}"


def _auto_tokenizer(path: Path, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    """AutoTokenizer, except for generic fast tokenizers (the built-in one): transformers 5 would rebuild those
    as the model type's tokenizer class when a config.json sits next to them (e.g. Qwen2Tokenizer, which drops
    our spaces), so they load as what they are."""
    cfg_file = path / "tokenizer_config.json"
    if cfg_file.is_file():
        declared = json.loads(cfg_file.read_text()).get("tokenizer_class")
        if declared in GENERIC_TOKENIZER_CLASSES:
            return PreTrainedTokenizerFast.from_pretrained(str(path))
    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def model_config(cfg: ModelSource, path: str | None = None) -> PretrainedConfig:
    """The HF config of `path` (or `cfg.path`) or of `cfg.preset`, with `cfg.override_config` applied (to a
    vision-language model's text config when the key is not a top-level field, as the `tiny-vl` preset does)."""
    path = path or cfg.path
    if path is None:
        return preset_config(cfg.preset, **cfg.override_config)
    hf = AutoConfig.from_pretrained(str(_check_dir(path, "model.path")), trust_remote_code=cfg.trust_remote_code)
    for key, value in cfg.override_config.items():
        target = hf if hasattr(hf, key) or not is_vision_language(hf) else hf.get_text_config()
        if not hasattr(target, key):
            raise ValueError(f"model.override_config.{key}: {type(target).__name__} has no such field")
        setattr(target, key, value)
    return hf


def load_model(cfg: ModelSource, role: str = "actor", *, path: str | None = None,
               dtype: torch.dtype = torch.float32, attn_implementation: str | None = None,
               init_device: str | torch.device = "cpu") -> PreTrainedModel:
    """The model for `role`: a causal LM (actor/ref) or backbone + scalar head (critic/reward); see `load_module`."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}: must be one of {', '.join(ROLES)}")
    head = "value" if role in SCALAR_HEAD_ROLES else "lm"
    return load_module(cfg, head, path=path, dtype=dtype, attn_implementation=attn_implementation,
                       init_device=init_device)


def load_module(cfg: ModelSource, head: str = "lm", *, path: str | None = None,
                dtype: torch.dtype = torch.float32, attn_implementation: str | None = None,
                init_device: str | torch.device = "cpu") -> PreTrainedModel:
    """A causal LM (`head="lm"`) or backbone + scalar head (`head="value"`).

    `path` overrides `cfg.path` (critic.model_path, reward_model.path). Presets are initialised from `cfg.seed`
    directly on `init_device` (fast for billion-parameter shapes on a GPU), so the actor and reference start
    identical on a given device type; checkpoints always load on CPU.
    """
    if head not in HEADS:
        raise ValueError(f"head={head!r}: must be one of {', '.join(HEADS)}")
    scalar = head == "value"
    path = path or cfg.path
    hf_cfg = model_config(cfg, path)
    path = None if path is None else str(_check_dir(path, "model.path"))
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if path is None:
        with _seeded(cfg.seed, torch.device(init_device)), torch.device(init_device):
            if scalar:
                model = scalar_head_from_config(hf_cfg, dtype)
            else:
                model = _auto_class(hf_cfg).from_config(hf_cfg, dtype=dtype, **kwargs)
        if attn_implementation is not None:
            model.set_attn_implementation(attn_implementation)
    elif scalar:
        with _no_progress_bar():
            model = scalar_head_from_pretrained(path, dtype=dtype, trust_remote_code=cfg.trust_remote_code, **kwargs)
    else:
        with _no_progress_bar():
            model = _auto_class(hf_cfg).from_pretrained(
                str(Path(path).expanduser()), config=hf_cfg, dtype=dtype, trust_remote_code=cfg.trust_remote_code,
                **kwargs,
            )
    logger.info("loaded %s (%s head) from %s (%.1fM params)", type(model).__name__, head, path or cfg.preset,
                sum(p.numel() for p in model.parameters()) / 1e6)
    return model


def is_vision_language(hf_cfg: PretrainedConfig) -> bool:
    """A vision-language model (Qwen2.5-VL style: a vision tower beside the language model)."""
    return getattr(hf_cfg, "vision_config", None) is not None


def _auto_class(hf_cfg: PretrainedConfig) -> type:
    return AutoModelForImageTextToText if is_vision_language(hf_cfg) else AutoModelForCausalLM


def load_image_processor(cfg: ModelSource) -> Any | None:
    """The image processor of a vision-language model (None for a text model): `model.path`'s, or the `tiny-vl`
    preset's built-in one."""
    config = model_config(cfg)
    if not is_vision_language(config):
        return None
    if cfg.path is None:
        processor = tiny_vl_image_processor()
    else:
        processor = AutoImageProcessor.from_pretrained(str(resolve_path(cfg.path)), local_files_only=True,
                                                       trust_remote_code=cfg.trust_remote_code)
    model = f"model.path={cfg.path}" if cfg.path else f"model.preset={cfg.preset}"
    _check_patches(processor, config.vision_config, model)
    return processor


def _check_patches(processor: Any, vision: Any, model: str) -> None:
    """The image processor cuts the patches the vision tower takes: checked once, in the driver, so a mismatch fails
    before any worker starts rather than inside one rank's forward (the others would wait in its collectives)."""
    pairs = {"patch_size": "patch_size", "temporal_patch_size": "temporal_patch_size",
             "merge_size": "spatial_merge_size"}
    bad = [f"{p}={getattr(processor, p)} vs vision_config.{v}={getattr(vision, v)}" for p, v in pairs.items()
           if getattr(processor, p, None) is not None and getattr(vision, v, None) is not None
           and int(getattr(processor, p)) != int(getattr(vision, v))]
    if bad:
        raise ValueError(f"{model}: the image processor (preprocessor_config.json) does not match the "
                         f"model's vision tower ({'; '.join(bad)}); use the preprocessor_config.json that came with "
                         "the model")


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers draws a "Loading weights" bar per load, once per rank and role; our log line says it instead."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


class _seeded:
    """Fork the RNG so random init is reproducible without disturbing the caller's RNG stream."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.seed = seed
        self.devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []

    def __enter__(self) -> None:
        self._ctx = torch.random.fork_rng(devices=self.devices)
        self._ctx.__enter__()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc: object) -> None:
        self._ctx.__exit__(*exc)


def save_model(out_dir: str | Path, config: PretrainedConfig, state_dict: dict[str, torch.Tensor],
               tokenizer: PreTrainedTokenizerBase | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write `state_dict` (full, unsharded) as model.safetensors + config.json (+ tokenizer) into `out_dir`.

    Tied weights are written once (HF convention: the output embedding is dropped when tied).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in state_dict.items():
        if getattr(config, "tie_word_embeddings", False) and name == "lm_head.weight":
            continue
        t = t.detach().to("cpu")
        tensors[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    logger.info("saved %d tensors to %s", len(tensors), out)
    return out


def save_pretrained(model: PreTrainedModel, out_dir: str | Path,
                    tokenizer: PreTrainedTokenizerBase | None = None) -> Path:
    """Save an unsharded HF model (tests, exports of a single-process model)."""
    out = save_model(out_dir, model.config, model.state_dict(), tokenizer)
    # Record the architecture so AutoModel picks the right class.
    cfg_path = out / "config.json"
    data = json.loads(cfg_path.read_text())
    data["architectures"] = [type(model).__name__.removeprefix("FSDP")]
    cfg_path.write_text(json.dumps(data, indent=2))
    return out
