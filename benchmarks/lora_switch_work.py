"""Work of one hybrid-engine switch, counted on CPU: the aten ops (≈ kernels on a GPU; a `_foreach_*` op
counts once though CUDA may launch it in a few chunks), bytes read / written and bytes of fresh temporaries of one
`WeightView.build` — the rollout's weight view, LoRA deltas merged — without a GPU.

    PYTHONPATH=. python3 -m benchmarks.lora_switch_work                       # 0.5B shape, LoRA rank 64 all-linear
    PYTHONPATH=. python3 -m benchmarks.lora_switch_work --layers 4 --full     # + the full fine-tuning switch

Set-up as in `benchmarks/lora_gpu.py`'s switch parts, on CPU and without FSDP (one rank: the view reads the local
tensors either way): LoRA = bf16 base + fp32 adapters (B nonzero) → bf16 generation weights; full = fp32 master →
bf16. The first build allocates the persistent buffers; the second one is counted (what every later switch does).
Bytes are those of the tensors each op reads and writes (a view counts its own elements, not its storage's).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_ALLOC = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
_WRITE_ONLY = {"copy_", "_foreach_copy_", "fill_", "zero_"}  # mutated arguments these ops do not read


def _nbytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))


class OpTally(TorchDispatchMode):
    """Counts aten ops (views and bare allocations excluded), bytes read and written, and the bytes and largest
    size of the fresh tensors ops return (temporaries and buffers alike)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.read = self.written = self.allocated = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name in ("detach", "alias", "lift_fresh", "_local_scalar_dense"):
            return out
        schema = func._schema
        values = {a.name: v for a, v in zip(schema.arguments, args)} | kwargs
        for a in schema.arguments:
            if a.name not in values:
                continue
            written = a.alias_info is not None and a.alias_info.is_write
            if written:
                self.written += _nbytes(values[a.name])
            if not written or name not in _WRITE_ONLY:
                self.read += _nbytes(values[a.name])
        fresh = [o for r, o in zip(schema.returns, out if isinstance(out, (tuple, list)) and len(schema.returns) > 1
                                   else [out]) if r.alias_info is None]
        size = _nbytes(fresh)
        self.allocated += size
        self.largest = max([self.largest] + [_nbytes(t) for t in tree_flatten(fresh)[0]])
        if name in _ALLOC:  # an allocation moves no bytes
            self.ops["(alloc)"] += 1
            return out
        self.written += size
        self.ops[name] += 1
        return out

    def kernels(self) -> int:
        return sum(n for k, n in self.ops.items() if k != "(alloc)")

    def summary(self) -> dict[str, Any]:
        return {"ops": self.kernels(), "by_op": dict(self.ops.most_common()), "read_mb": self.read / 2**20,
                "written_mb": self.written / 2**20, "fresh_mb": self.allocated / 2**20,
                "largest_fresh_mb": self.largest / 2**20}


def build_model(preset: str, layers: int, lora_rank: int, lora_alpha: float, seed: int = 0,
                targets: str | list[str] = "all-linear", base_dtype: torch.dtype = torch.bfloat16,
                b_std: float = 0.02) -> torch.nn.Module:
    """A random-init preset model on CPU: LoRA (rank > 0) = `base_dtype` base + fp32 adapters on `targets`, B
    nonzero (std `b_std`) as after training; rank 0 = fp32 weights (full fine-tuning's master weights)."""
    from transformers import AutoModelForCausalLM

    from hybridflow.config.schema import LoraConfig
    from hybridflow.engine.lora import apply_lora
    from hybridflow.models.presets import preset_config

    cfg = preset_config(preset, num_hidden_layers=layers)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=base_dtype if lora_rank else torch.float32)
    if lora_rank:
        apply_lora(model, LoraConfig(rank=lora_rank, alpha=lora_alpha, target_modules=targets), seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.normal_(0.0, b_std)
    return model.eval()


def switch_work(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """Op / byte counts of the second `WeightView.build` of `model` (the first allocates the buffers)."""
    from hybridflow.rollout.weights import WeightView

    view = WeightView(model, dtype, torch.device("cpu"))
    with torch.no_grad():
        view.build()
        tally = OpTally()
        t0 = time.perf_counter()
        with tally:
            weights = view.build()
    res = tally.summary()
    res["cpu_s"] = time.perf_counter() - t0
    res["weights_mb"] = weights.nbytes() / 2**20
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=64.0)
    ap.add_argument("--full", action="store_true", help="also count the full fine-tuning switch (fp32 → bf16)")
    args = ap.parse_args()
    if args.rank <= 0:
        raise SystemExit(f"--rank {args.rank}: must be > 0 (use --full for the switch without LoRA)")
    from hybridflow.models.presets import PRESETS

    layers = args.layers or PRESETS[args.preset]["num_hidden_layers"]
    runs = [("lora", args.rank)] + ([("full", 0)] if args.full else [])
    for label, rank in runs:
        res = switch_work(build_model(args.preset, layers, rank, args.alpha))
        ops = ", ".join(f"{k} {n}" for k, n in res["by_op"].items())
        print(f"{label} ({args.preset}, {layers} layers{f', rank {rank}' if rank else ''}): {res['ops']} ops "
              f"[{ops}]; read {res['read_mb']:.0f} MB, written {res['written_mb']:.0f} MB, fresh tensors "
              f"{res['fresh_mb']:.0f} MB (largest {res['largest_fresh_mb']:.0f} MB); rollout weights "
              f"{res['weights_mb']:.0f} MB; {res['cpu_s']:.2f} s on CPU under the tally", flush=True)


if __name__ == "__main__":
    main()
