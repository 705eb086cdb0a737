"""`hybridflow plan [CONFIG.yaml ...] [a.b=c ...] [--gpus N] [--gpu-memory GIB] [--gpu h200|h100|a100] [--json]`.

Predicts, without loading a model, each stage's GPU memory per component and the step time of a PPO/GRPO config on
the given GPUs, then the fastest settings the planner finds that fit (as overrides). Everything it prints is a
prediction (hybridflow/planning/, docs/plan.md).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hybridflow.commands.common import add_config_args, split_args
from hybridflow.config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hybridflow.planning.step_time import GPUS

    parser.add_argument("--gpus", type=int, default=None,
                        help="GPUs of one node (default: trainer.nnodes x trainer.n_gpus_per_node)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="GPU kind: peak FLOP/s and bandwidth")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="memory per GPU in GiB as torch reports it (an 80 GB card: ~79.1); default: the kind's")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_config_args(parser)


def plan_dict(choice_given: Any, gpu: Any, best: Any, error: str | None, gpus_per_node: int) -> dict[str, Any]:
    from hybridflow.planning.memory import GiB, needed_bytes

    mem, time = choice_given
    gib = lambda b: round(b / GiB, 2)  # noqa: E731
    out: dict[str, Any] = {
        "prediction": True, "gpu": gpu.name, "gpu_memory_gib": gpu.memory_gib,
        "stages": {s.stage: {"components_gib": {k: gib(v) for k, v in s.components.items() if v},
                             "total_gib": gib(s.total)} for s in mem.stages},
        "peak_stage": mem.peak.stage, "peak_gib": gib(mem.peak.total), "needed_gib": gib(needed_bytes(mem)),
        "host_gib_per_rank": gib(mem.host_bytes), "host_gib_per_node": gib(mem.host_bytes * gpus_per_node),
        "kv_slots": mem.kv_slots, "notes": mem.notes,
        "step_seconds": {k: round(v, 3) for k, v in time.seconds.items()}, "step_total_seconds": round(time.total, 3),
        "update_mfu": round(time.mfu, 3), "decode_fraction_of_copy_bandwidth": round(time.decode_fraction, 3),
    }
    out["fits"] = needed_bytes(mem) <= gpu.memory_gib * GiB
    if best is not None:
        out["choice"] = {"overrides": best.overrides, "peak_gib": gib(best.memory.peak.total),
                         "needed_gib": gib(needed_bytes(best.memory)),
                         "step_total_seconds": round(best.time.total, 3),
                         "host_gib_per_rank": gib(best.memory.host_bytes)}
    if error:
        out["error"] = error
    return out


def render(d: dict[str, Any], world: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    stages = list(d["stages"])
    table = Table(title=f"Predicted GPU memory per rank (GiB), {world} x {d['gpu']} ({d['gpu_memory_gib']:.1f} GiB)")
    table.add_column("component")
    for s in stages:
        table.add_column(s, justify="right")
    comps: list[str] = []
    for s in stages:
        comps += [c for c in d["stages"][s]["components_gib"] if c not in comps]
    for c in comps:
        table.add_row(c, *(f"{d['stages'][s]['components_gib'].get(c, 0.0):.2f}" for s in stages))
    table.add_row("[bold]total (allocated)", *(f"[bold]{d['stages'][s]['total_gib']:.2f}" for s in stages))
    table.add_row("predicted seconds", *(f"{d['step_seconds'].get(s, 0.0):.2f}" for s in stages))
    console.print(table)
    for note in d["notes"]:
        console.print(note)
    verdict = "[green]fits[/]" if d["fits"] else "[red]does not fit[/]"
    if d["fits"] and d["needed_gib"] > 0.9 * d["gpu_memory_gib"]:
        verdict += " (within 10% of the limit, the planner's error band: tight)"
    console.print(f"peak {d['peak_gib']:.1f} GiB at {d['peak_stage']}; with allocator and CUDA overhead "
                  f"{d['needed_gib']:.1f} GiB: {verdict}. Host memory {d['host_gib_per_rank']:.1f} GiB per rank "
                  f"({d['host_gib_per_node']:.1f} per node). "
                  f"KV cache: {d['kv_slots']} sequences. Predicted step {d['step_total_seconds']:.2f} s (update MFU "
                  f"{d['update_mfu']:.0%}, decode at {d['decode_fraction_of_copy_bandwidth']:.0%} of copy bandwidth).")
    if "choice" in d:
        c = d["choice"]
        what = " ".join(c["overrides"]) or "(the config as given)"
        console.print(f"fastest that fits: {what}\n  -> peak {c['peak_gib']:.1f} GiB (needs {c['needed_gib']:.1f}), "
                      f"step {c['step_total_seconds']:.2f} s, host {c['host_gib_per_rank']:.1f} GiB per rank")
    if "error" in d:
        console.print(f"[red]{d['error']}")
    console.print("All numbers are predictions (docs/plan.md), not measurements.")


def _fewest_gpus(files: list[str], overrides: list[str], gpu: Any, world: int, most: int = 64) -> str:
    """Which GPU count (doubling from `world`, up to `most`) the planner finds a fitting choice for."""
    from hybridflow.planning.choose import DoesNotFit, choose
    from hybridflow.planning.from_config import load_for_gpu, plan_inputs

    n = world * 2
    while n <= most:
        try:
            best = choose(plan_inputs(load_for_gpu(files, overrides, gpu.memory_gib, n)), gpu)
        except DoesNotFit:
            n *= 2
            continue
        return f"--gpus {n} fits ({' '.join(best.overrides) or 'as configured'})"
    return f"no GPU count up to {most} fits"


def run(args: argparse.Namespace) -> int:
    from hybridflow.planning.choose import DoesNotFit, choose, evaluate
    from hybridflow.planning.from_config import load_for_gpu, plan_inputs
    from hybridflow.planning.step_time import GPUS

    gpu = GPUS[args.gpu]
    if args.gpu_memory is not None:
        if args.gpu_memory <= 0:
            raise ConfigError(f"--gpu-memory={args.gpu_memory}: must be > 0 GiB, e.g. --gpu-memory 79.1")
        gpu = type(gpu)(gpu.name, args.gpu_memory, gpu.bf16_flops, gpu.copy_bytes_per_s)
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus={args.gpus}: must be >= 1")
    files, overrides = split_args(args.args)
    cfg = load_for_gpu(files, overrides, gpu.memory_gib, args.gpus)
    inputs = plan_inputs(cfg)
    best, error = None, None
    try:
        best = choose(inputs, gpu, {"actor": cfg.actor.use_dynamic_bsz, "critic": cfg.critic.use_dynamic_bsz})
    except DoesNotFit as err:
        error = f"{err}; {_fewest_gpus(files, overrides, gpu, inputs.world)}"
    d = plan_dict(evaluate(inputs, gpu), gpu, best, error, min(inputs.world, cfg.trainer.n_gpus_per_node))
    if args.json:
        print(json.dumps(d, indent=1))
    else:
        render(d, inputs.world)
    return 0 if best is not None else 1
