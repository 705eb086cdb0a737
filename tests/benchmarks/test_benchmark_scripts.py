"""The benchmark scripts run on CPU end to end, so they do not rot between GPU rounds (a renamed helper broke the
two-GPU script's all-gather probe once, found only on the device). Numbers are not checked here, only that every
case finishes and reports what the GPU round reads."""

from __future__ import annotations

import importlib.util
import json

import pytest
from bench_testlib import SMALL, run_module


def test_grpo_step_benchmark_runs_on_cpu(tmp_path):
    run_module("benchmarks.run", "--preset", "tiny", "--device", "cpu", *SMALL, "--out", str(tmp_path), timeout=600)
    result = json.loads((tmp_path / "bench_tiny.json").read_text())["result"]
    assert result["step_s"] > 0 and result["median"]["timing/update_actor"] > 0
    assert "| tiny |" in (tmp_path / "bench.md").read_text()


def test_distillation_step_benchmark_runs_on_cpu(tmp_path):
    run_module("benchmarks.distill", "--student", "tiny", "--teacher", "tiny", "--device", "cpu", "--warmup", "0",
               "--no-tuned", *SMALL, "--out", str(tmp_path), timeout=600)
    results = json.loads((tmp_path / "distill.json").read_text())["results"]
    assert set(results) == {"grpo", "distill (tiny teacher)"}
    assert results["distill (tiny teacher)"]["median"]["timing/teacher"] > 0
    assert "timing/teacher" not in results["grpo"]["median"]


def test_weak_start_learning_benchmark_smoke(tmp_path):
    """Issue 19's weak-start benchmark in its smoke mode: a 4-step weak start, 2 GRPO steps of ours with the robust
    preset, the shared greedy evaluation on 16 held-out problems. The TRL side is not part of the smoke mode (TRL is
    not a dependency); the full run skips it with a message when `import trl` fails."""
    proc = run_module("benchmarks.learning", "--smoke", "--seeds", "0", "--out", str(tmp_path), timeout=600)
    rows = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [(r["side"], r["recipe"]) for r in rows] == [("ours", "robust")], rows
    row = rows[0]
    assert "error" not in row, row.get("error")
    assert 0.0 <= row["start"] <= 1.0 and 0.0 <= row["end"] <= 1.0 and row["samples"] == 2 * 4 * 4
    assert "| ours | robust | 1 |" in (tmp_path / "summary.md").read_text(), proc.stdout


def test_lora_gpu_benchmark_smoke(tmp_path):
    """Issue 24's device round on tiny shapes: hybridflow GRPO with LoRA (the 7B part's settings) and TRL's
    GRPOTrainer with the same PEFT config, each in its own process; rows and table as the GPU round writes them."""
    proc = run_module("benchmarks.lora_gpu", "--smoke", "--parts", "lora_7b,trl_7b", "--out", str(tmp_path), timeout=600)
    rows = {r["part"]: r for r in map(json.loads, (tmp_path / "lora_gpu.jsonl").read_text().splitlines())}
    ours = rows["lora_7b"]
    assert ours["status"] == "ok", ours.get("error")
    assert "model.lora.rank=4" in ours["result"]["overrides"] and ours["result"]["switch_ms"]["n"] == 1
    assert ours["result"]["median"]["timing/update_actor"] > 0
    trl = rows["trl_7b"]
    if importlib.util.find_spec("trl") is None:
        assert trl["status"].startswith("skipped: trl not importable")
    else:
        assert trl["status"] == "ok", trl.get("error")
        assert 0 < trl["result"]["trainable_params"] < trl["result"]["total_params"] / 10  # adapters only
        assert trl["result"]["median_step_s"] > 0
    assert "| lora_7b | ok |" in proc.stdout and (tmp_path / "lora_gpu.md").exists()


def test_cpu_step_7b_benchmark_smoke(tmp_path):
    """The 7B full fine-tuning benchmark's code path at tiny shapes: GRPO with the reference model and the KL loss,
    the optimizer step on the host, per-stage times and host memory in the JSON, one warm-up + 3 timed steps."""
    proc = run_module("benchmarks.cpu_step_7b", "--smoke", "--out", str(tmp_path), timeout=600)
    res = json.loads((tmp_path / "cpu_step_7b.json").read_text())
    assert "actor.fsdp.optimizer_offload=cpu_step" in res["overrides"] and res["trained_params"] > 0
    assert [s["timed"] for s in res["steps"]] == [False, True, True, True]
    for step in res["steps"]:
        assert step["host_step_s"] > 0 and step["timing/ref"] > 0 and "actor/kl_loss" in step, step
        assert step["host_peak_rss_gb"] > 0
    assert res["median"]["timing/update_actor"] > 0 and '"median"' in proc.stdout


def test_lora_switch_work_counts_one_merge_per_projection():
    """The CPU op/byte count of one hybrid switch: LoRA = one base copy + one baddbmm_ per adapted
    projection (7 with all-linear), full fine-tuning = one cast copy; both report the bytes moved."""
    proc = run_module("benchmarks.lora_switch_work", "--preset", "tiny", "--layers", "3", "--rank", "4", "--full",
                timeout=300)
    lora, full = proc.stdout.strip().splitlines()[-2:]
    assert lora.startswith("lora (tiny, 3 layers, rank 4):") and "baddbmm_ 7" in lora and "stack" not in lora, lora
    assert full.startswith("full (tiny, 3 layers): 1 ops [_foreach_copy_ 1]") and "read " in full, full


def test_lora_forward_cost_reports_the_low_rank_terms_of_a_rollout():
    """The low-rank-term alternative to merging: the script times the two GEMMs per adapted projection for
    every decode step and the prefill, and its rollout total is decode × response length + prefill."""
    proc = run_module("benchmarks.lora_forward_cost", "--device", "cpu", "--preset", "tiny", "--layers", "2", "--rank", "4",
                "--rows", "4", "--prompt-len", "8", "--response-len", "3", "--iters", "3", timeout=300)
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["adapted_pairs_per_step"] == 14 and row["decode_step_ms"] > 0 and row["prefill_ms"] > 0, row
    assert abs(row["rollout_ms"] - (3 * row["decode_step_ms"] + row["prefill_ms"])) < 0.02, row


def test_idle_gap_attribution_names_the_stage_and_host_ranges():
    """The profile step names what the host did during each idle GPU gap: the trainer stage (`stage/<name>` from
    StageTimer) and the host ranges that overlap the gap most."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.run import attribute_gap, host_ranges
    from hybridflow.trainer.timing import StageTimer

    timer = StageTimer(sync_cuda=False)
    x = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with timer("reward"):
            for _ in range(20):
                x = torch.tanh(x @ x)
    ranges = host_ranges(prof)
    stage = [r for r in ranges if r[2] == "stage/reward"]
    assert len(stage) == 1
    start, end, _ = stage[0]
    out = attribute_gap(start, end, ranges)
    assert list(out["stages"]) == ["stage/reward"] and out["stages"]["stage/reward"] > 0
    assert "aten::mm" in out["host"] and "aten::tanh" in out["host"]
    assert attribute_gap(end + 1, end + 2, ranges) == {"stages": {}, "host": {}}


def test_decode_fusion_benchmark_smoke():
    """Issue 25's decode-fusion benchmark in its CPU smoke mode: both compositions run one decode step, report
    step time and op counts, and give the same logits (eager on the CPU: the same ops in the same order)."""
    proc = run_module("benchmarks.decode_fusion", "--smoke", timeout=300)
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [r["composition"] for r in row["results"]] == ["engine", "unfused", "fused_norms", "plain_add",
                                                         "unfused+plain_add"], row
    assert all(r["step_ms"] > 0 and r["kernels_per_step"] > 0 for r in row["results"]), row
    assert row["max_abs_logit_diff"] == 0.0 and row["argmax_agree"] == 1.0, row


def test_fp8_gemm_benchmark_smoke(tmp_path, capsys):
    """The FP8 GEMM benchmark in its CPU smoke mode (in process: no second torch import): bf16 and each fp8 recipe's
    emulation run, report µs and an error against fp32 larger for fp8 than for bf16 but within e4m3's rounding."""
    from benchmarks import fp8_gemm

    fp8_gemm.main(["--smoke", "--out", str(tmp_path / "fp8.json")])
    out = capsys.readouterr().out
    assert "µs per call" in out and "relative error" in out and json.loads(out.strip().splitlines()[-1])["smoke"]
    variants = json.loads((tmp_path / "fp8.json").read_text())["results"][0]["variants"]
    assert len(variants) == 5 and all(v["us"] > 0 for v in variants.values()), variants
    bf16 = variants.pop("bf16")["rel_err"]
    assert all(bf16 < v["rel_err"] < 0.1 for v in variants.values()), (bf16, variants)


def test_exact_ops_benchmark_smoke(tmp_path, capsys):
    """The exact-ops benchmark in its CPU smoke mode (in process): every op of every phase timed in its invariant and
    default form, the per-layer totals of each mode (the fused rollout layer for the rollout phases only), the
    forward ratios in the last line and the markdown table."""
    from benchmarks import exact_ops

    out = tmp_path / "exact_ops.json"
    exact_ops.main(["--smoke", "--out", str(out)])
    res = json.loads(out.read_text())
    layer_ops = ["rms_norm", "q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down"]
    want = {"decode4": [*layer_ops, "attention@16", "attention@32"], "prefill": [*layer_ops, "attention"],
            "trainer": [*layer_ops, "attention"]}
    got = {}
    for r in res["results"]:
        got.setdefault(r["phase"], []).append(r["op"])
        assert r["exact_us"] > 0 and r["default_us"] > 0 and r["ratio"] > 0, r
    assert got == {p: [*ops, "lm_head", "logprob"] for p, ops in want.items()}, got
    for t in res["totals"]:
        rollout = t["phase"] != "trainer"
        assert ("exact_fused" in t["layer_us"]) == rollout, t
        for mode, layer in (("default", "default"), ("exact", "exact_fused" if rollout else "exact_separate")):
            assert abs(t["forward_us"][mode] - t["layers"] * t["layer_us"][layer] - t["head_us"][mode]) < 0.1, t
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["smoke"] and set(summary["forward_ratio"]) == {f"tiny {p}" for p in want}, summary
    assert "| tiny | decode4 | qkv | 4 |" in (tmp_path / "exact_ops.md").read_text()


def test_decode_gemm_benchmark_smoke():
    """Issue 25's skinny-GEMM benchmark in its CPU smoke mode: the Triton GEMM (with and without split-K) runs under
    the interpreter and matches x @ w^T."""
    pytest.importorskip("triton")
    proc = run_module("benchmarks.decode_gemm", "--smoke", env={"TRITON_INTERPRET": "1"}, timeout=300)
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["smoke"] and row["max_abs_err"] < 1e-4, row


def test_vlm_step_benchmark_smoke(tmp_path):
    """The vision-language GRPO step at tiny shapes: a warm-up and a timed step on our engine (the vision tower in
    prefill), each stage timed, then the HF fallback's generation of the same prompts."""
    out = tmp_path / "vlm_step.json"
    run_module("benchmarks.vlm_step", "--smoke", "--out", str(out), timeout=600)
    res = json.loads(out.read_text())
    ours = res["ours"]
    assert res["image_tokens"] > 0 and ours["timing/rollout_vision"] > 0 and ours["timing/update_actor"] > 0
    assert ours["response_tokens"] == res["hf_response_tokens"] == 3 * 2 * 6 and res["hf_gen_s"] > 0
