"""LoRA adapters (through PEFT) on an engine's module: injection, the adapters-off reference, merged weights, and
the PEFT adapter directory format.

Decisions: adapters are injected in place (`peft.inject_adapter_in_model`), not by wrapping the model in a
`PeftModel`: the module keeps its class and `model.base_model.layers`, so FSDP2 wrapping (one `fully_shard` per
decoder layer), the engine's forward and the rollout's weight view see the same tree as without LoRA. Base
weights are frozen (in the compute dtype: no fp32 master copy, no optimizer state); adapters are fp32 masters. A
scalar head (`score`, critic / reward model) stays fully trained. `all-linear` is resolved here to the Linear
layers inside the decoder layers (PEFT's own `all-linear` would also pick up the value head). Merging is
W + (alpha/rank)·B·A, computed on plain state dicts (export, SFT hand-off) or into the rollout's buffers.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from hybridflow.config.schema import LoraConfig

ADAPTER = "default"  # PEFT's adapter name; hybridflow trains exactly one adapter
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # how a PeftModel names the wrapped model's parameters
SCALAR_HEAD = "score"  # the value / score head of scalar-head modules (models/heads.py)


def target_module_names(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """Leaf names of the Linear layers to adapt (sorted). `all-linear` = every Linear inside the decoder layers;
    a list must name Linear layers that exist there (an unknown name is a config error, not a silent no-op)."""
    layers = getattr(model.base_model, "layers", None)
    if layers is None:
        raise ValueError(f"model.lora: {type(model).__name__} has no decoder layers at model.base_model.layers")
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in layers.named_modules() if isinstance(m, nn.Linear)})
    if cfg.target_modules == "all-linear":
        return linear
    unknown = sorted(set(cfg.target_modules) - set(linear))
    if unknown:
        raise ValueError(f"model.lora.target_modules={list(cfg.target_modules)}: {unknown} are not Linear layers of "
                         f"the decoder layers; choose from {linear} or use all-linear")
    return sorted(set(cfg.target_modules))


def peft_config(cfg: LoraConfig, targets: list[str], base_model_path: str | None = None):
    """The `peft.LoraConfig` of `cfg` with resolved target names (what adapter_config.json records)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                          bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model_path)


def apply_lora(model: nn.Module, cfg: LoraConfig, seed: int) -> list[str]:
    """Inject adapters into `model` in place; freeze everything but the adapters (and a scalar head). Adapters
    (and the head) are fp32 whatever the base dtype; A is initialised from `seed` (B is zero, so the adapted model
    starts as the base model). Returns the adapted leaf names. Call before FSDP2 wrapping."""
    from peft import inject_adapter_in_model

    targets = target_module_names(model, cfg)
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):  # PEFT initialises A on the CPU; keep the caller's RNG stream intact
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config(cfg, targets), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        if is_adapter_param(name):
            p.data = p.data.float()  # PEFT creates adapters in the base layer's dtype
            p.requires_grad_(True)
    head = getattr(model, SCALAR_HEAD, None)
    if head is not None:
        head.float().requires_grad_(True)  # the value head is new: it is trained in full
    return targets


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, PEFT LoRA layer) for every adapted layer of `model`."""
    from peft.tuners.lora import LoraLayer

    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            yield name, m


def is_lora_layer(module: nn.Module | None) -> bool:
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def lora_factors(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(B [out, r], A [r, in], scale) of an active adapter (parameters as they are: DTensor, shard or full), or None
    when the adapters are disabled or merged."""
    if layer.disable_adapters or layer.merged or ADAPTER not in layer.lora_A:
        return None
    return layer.lora_B[ADAPTER].weight, layer.lora_A[ADAPTER].weight, float(layer.scaling[ADAPTER])


def lora_state(layer: nn.Module) -> tuple:
    """Everything `lora_factors(layer)` depends on besides the factor tensors' contents — the disabled / merged flags,
    the scale and the adapter's A and B modules — read without nn.Module's `__getattr__` fallback: a cheap key for
    callers that cache what `lora_factors` gave (the rollout's recorded weight build)."""
    mods = layer._modules
    return (layer._disable_adapters, tuple(layer.merged_adapters), layer.scaling.get(ADAPTER),
            mods["lora_A"]._modules.get(ADAPTER), mods["lora_B"]._modules.get(ADAPTER))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model: every LoRA layer computes only W·x inside (no weights touched). Sets the flag PEFT's
    `enable_adapters` sets, without its side effect on `requires_grad`: under FSDP2 that would land on whichever
    (sharded or unsharded) parameter objects happen to be registered at the time."""
    layers = [m for _, m in lora_layers(model)]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m in layers:
            m._disable_adapters = False


# --------------------------------------------------------------------------------------------- state dicts
def merged_state_dict(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full state dict of an adapted model (`x.base_layer.weight`, `x.lora_A.default.weight`, …) → the plain
    model's state dict with W + scale·B·A for every adapted layer."""
    base = {k.replace(".base_layer.", "."): v for k, v in state.items() if not is_adapter_param(k)}
    return merge_adapters(base, {k: v for k, v in state.items() if is_adapter_param(k)}, scale)


def merge_adapters(base: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor],
                   scale: float) -> dict[str, torch.Tensor]:
    """The plain model's state dict `base` with W + scale·B·A (computed in fp32, cast back to W's dtype) for each
    `x.lora_A.default.weight` / `x.lora_B.default.weight` pair of `adapters`; other tensors are passed through."""
    out = dict(base)
    for key, a in adapters.items():
        if ".lora_A." not in key:
            continue
        prefix = key.split(".lora_A.", 1)[0]
        b = adapters.get(f"{prefix}.lora_B.{ADAPTER}.weight")
        w = out.get(f"{prefix}.weight")
        if b is None or w is None:
            raise ValueError(f"adapter {key}: no matching {prefix}.lora_B.{ADAPTER}.weight or base {prefix}.weight")
        out[f"{prefix}.weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out


def adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors of a (trainable-only or full) state dict, named as PEFT saves them
    (`base_model.model.<name>.lora_A.weight`: the adapter name is dropped)."""
    return {PEFT_PREFIX + k.replace(f".{ADAPTER}.", "."): v.contiguous()
            for k, v in state.items() if is_adapter_param(k)}


def save_adapter_dir(out_dir: str | Path, state: dict[str, torch.Tensor], cfg: LoraConfig, targets: list[str],
                     base_model_path: str | None) -> Path:
    """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that
    `PeftModel.from_pretrained(base_model, out_dir)` loads."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    weights = adapter_state_dict(state)
    if not weights:
        raise ValueError("no LoRA adapter tensors (*.lora_A.* / *.lora_B.*) to export")
    peft_config(cfg, targets, base_model_path).save_pretrained(str(out))
    save_file(weights, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    json.loads((out / ADAPTER_CONFIG).read_text())  # written by PEFT; fail here, not in the user's loader
    return out


def targets_from_state(state: dict[str, torch.Tensor]) -> list[str]:
    """The adapted leaf names found in a state dict (what a checkpoint was trained with)."""
    return sorted({k.split(".lora_A.", 1)[0].rsplit(".", 1)[-1] for k in state if ".lora_A." in k})
