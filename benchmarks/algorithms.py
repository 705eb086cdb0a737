"""Micro-benchmarks of hybridflow.algorithms on CPU (scripts, not tests).

GAE over [4096, 2048]: the library's chunked-matmul scan vs a loop over T with batch-vectorised ops (the usual
verl-style implementation), plus GRPO advantages and policy/value loss forward+backward at the same shape.

Run: .venv/bin/python benchmarks/algorithms.py [--batch 4096] [--length 2048] [--repeats 5] [--threads N]
     [--device cuda]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

from hybridflow.algorithms import compute_advantage, compute_value_loss, vanilla_policy_loss
from hybridflow.algorithms.discounted import discounted_reverse_cumsum
from hybridflow.algorithms.masked import masked_whiten


def gae_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """Reference GAE: Python loop over time, vectorised over the batch (skip semantics for masked tokens)."""
    B, T = rewards.shape
    lastgaelam = torch.zeros(B, device=rewards.device)
    nextvalues = torch.zeros(B, device=rewards.device)
    adv = torch.empty_like(rewards)
    for t in reversed(range(T)):
        mt = mask[:, t]
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_new = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mt + (1 - mt) * nextvalues
        lastgaelam = lastgaelam_new * mt + (1 - mt) * lastgaelam
        adv[:, t] = lastgaelam
    returns = (adv + values) * mask
    return masked_whiten(adv, mask) * mask, returns


def bench(fn: Callable[[], object], repeats: int, device: str) -> tuple[float, float]:
    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    fn()  # warm-up
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(np.min(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = torch default)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    B, T = args.batch, args.length
    lengths = torch.randint(T // 4, T + 1, (B,))
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), lengths - 1] = torch.randn(B)
    values = torch.randn(B, T) * mask
    mask, rewards, values = (x.to(args.device) for x in (mask, rewards, values))
    index = np.repeat(np.arange(B // 8), 8)
    kw = dict(token_level_rewards=rewards, response_mask=mask, values=values, index=index, gamma=0.99, lam=0.95)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu, {torch.get_num_threads()} threads"
    print(f"shape [{B}, {T}], torch {torch.__version__}, {where}")

    a_lib, _ = compute_advantage("gae", **kw)
    a_loop, _ = gae_loop(rewards, values, mask, 0.99, 0.95)
    print(f"gae scan vs loop max |diff| = {(a_lib - a_loop).abs().max().item():.2e}")
    rows = [("gae (chunked scan, library)", lambda: compute_advantage("gae", **kw))]
    for k in (32, 64, 128, 256):
        rows.append((f"  discounted_reverse_cumsum K={k}", lambda k=k: discounted_reverse_cumsum(rewards, 0.9405, k)))
    rows += [
        ("gae (loop over T, batch-vectorised)", lambda: gae_loop(rewards, values, mask, 0.99, 0.95)),
        ("grpo", lambda: compute_advantage("grpo", **kw)),
        ("reinforce_plus_plus", lambda: compute_advantage("reinforce_plus_plus", **kw)),
    ]
    logp = torch.randn(B, T, device=args.device, requires_grad=True)
    old = logp.detach() + 0.05 * torch.randn(B, T, device=args.device)

    def pg_step() -> None:
        loss, _ = vanilla_policy_loss(old, logp, a_lib, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
        loss.backward()

    vp = values.clone().requires_grad_(True)

    def vf_step() -> None:
        loss, _ = compute_value_loss(vp, values + 0.1, values, mask, cliprange_value=0.2)
        loss.backward()

    rows += [("ppo policy loss fwd+bwd", pg_step), ("value loss fwd+bwd", vf_step)]
    for name, fn in rows:
        med, best = bench(fn, args.repeats, args.device)
        print(f"{name:42s} median {med * 1e3:9.1f} ms   min {best * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
