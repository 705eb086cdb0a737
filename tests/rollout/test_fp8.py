"""FP8 rollout (rollout/fp8.py): the quantization's error bound, the fp8 GEMM against a naive fp32 reference (the
emulation on CPU; `_scaled_mm` against the emulation on a GPU with fp8, the fast-accumulating recipes within a bound
of their accumulator's lost bits), generation on a tiny Qwen2 against the unquantized engine, the persistent
buffers, and the configuration errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging

import pytest
import torch
import torch.nn.functional as F
from rollout_helpers import CUDA, make_engine, make_model, make_prompts
from test_model_families import make_family
from transformers import GPT2Config, GPT2LMHeadModel

from benchmarks.lora_switch_work import build_model
from hybridflow.config import load_config, resolve
from hybridflow.engine.lora import lora_factors
from hybridflow.rollout import fp8
from hybridflow.rollout.weights import WeightView
from hybridflow.tracking.run_info import write_run_info

FP8_GPU = CUDA and torch.cuda.get_device_capability() >= fp8.MIN_CAPABILITY
EPS = 2.0 ** -4  # e4m3 keeps 3 mantissa bits: a normal value rounds within 1/16 of itself
SUB = 2.0 ** -10  # half the subnormal step (2^-9) of a code, in units of the scale


def _weight(rows: int = 48, cols: int = 96, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, rows)[:, None]  # rows of very different size
    w[3] = 0.0  # an all-zero row: zero codes, no NaN
    return w


def test_quantize_dequantize_round_trip_within_the_e4m3_bound():
    w = _weight()
    codes, scale = fp8.quantize_rows(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (48, 1) and scale.dtype == torch.float32
    back = fp8.dequantize(codes, scale.squeeze(-1))
    assert torch.isfinite(back).all() and (back[3] == 0).all()
    err = (back - w).abs()
    assert (err <= EPS * w.abs() + SUB * scale + 1e-30).all(), float((err / (w.abs() + 1e-30)).max())
    # each row's largest entry maps to ±448 (the whole e4m3 range is used)
    assert torch.allclose(codes.float().abs().amax(-1)[w.abs().amax(-1) > 0], torch.tensor(fp8.FP8_MAX))


def test_emulated_fp8_linear_within_the_fp8_bound_of_the_fp32_linear():
    g = torch.Generator().manual_seed(1)
    w, bias = _weight(), torch.randn(48, generator=g)
    x = torch.randn(2, 5, 96, generator=g) * torch.logspace(-2, 2, 5)[None, :, None]  # tokens of very different size
    got = fp8.fp8_linear(x, *_codes(w), bias)
    want = F.linear(x, w, bias)
    bound = (2 * EPS + EPS * EPS) * (x.abs() @ w.abs().t()) + 1e-6  # both operands rounded, fp32 accumulation
    assert got.shape == want.shape and ((got - want).abs() <= bound).all()
    assert (got - want).abs().max() > 0  # the quantization is really applied
    # the emulation is its definition: per-token codes times per-channel codes, in fp32, then both scales
    xq, xs = fp8.quantize_rows(x)
    wq, ws = _codes(w)
    xd, wd = fp8.dequantize(xq, xs.squeeze(-1)), fp8.dequantize(wq, ws)
    assert ((got - F.linear(xd, wd, bias)).abs() <= 1e-5 * (xd.abs() @ wd.abs().t()) + 1e-6).all()  # fp32 rounding


@pytest.mark.parametrize("gemm", fp8.GEMMS)
def test_each_gemm_through_scaled_mm_matches_its_emulation(gemm):
    """The `_scaled_mm` branch on the CPU (CUDA: the test below) against the emulation of the same GEMM in bf16: the tensorwise
    GEMMs round the unscaled sum to bf16 before the scales (two roundings), the rowwise ones round once."""
    g = torch.Generator().manual_seed(4)
    w, bias = _weight(), torch.randn(48, generator=g).bfloat16()
    x = (torch.randn(7, 96, generator=g) * torch.logspace(-2, 2, 7)[:, None]).bfloat16()
    codes, scale = _codes(w)
    emu = fp8.fp8_linear(x, codes, scale, bias, emulate=True, gemm=gemm)
    try:
        got = fp8.fp8_linear(x, codes, scale, bias, emulate=False, gemm=gemm)
    except RuntimeError as err:  # torch <= 2.11's CPU kernel: "only supports per-tensor scaling for CPU backend"
        if "per-tensor" not in str(err):
            raise
        pytest.skip(f"this torch's CPU _scaled_mm takes per-tensor scales only ({gemm} needs row scales)")
    assert got.dtype == emu.dtype == torch.bfloat16
    # a CPU kernel may sum in another order (a bf16 ulp or two); wrong scales would miss by far more, row by row
    tol = 2 ** -6 * emu.float().abs().amax(-1, keepdim=True)
    assert ((got.float() - emu.float()).abs() <= tol).all()
    xq, xs = fp8.quantize_rows(x)
    acc = xq.float() @ codes.float().t()
    if gemm.startswith("tensorwise"):
        acc = acc.bfloat16().float()
    assert torch.equal(emu, (acc * xs * scale[None]).bfloat16() + bias)


def test_fp8_gemm_env_names_the_choices(monkeypatch):
    monkeypatch.setenv(fp8.GEMM_ENV, "rowwise_fast")
    assert fp8.gemm_from_env() == "rowwise_fast"
    monkeypatch.setenv(fp8.GEMM_ENV, "")  # set but empty: the default, as unset
    assert fp8.gemm_from_env() == "tensorwise_fast"
    monkeypatch.setenv(fp8.GEMM_ENV, "blockwise")
    with pytest.raises(ValueError, match="HYBRIDFLOW_FP8_GEMM='blockwise'.*use one of tensorwise_fast, tensorwise, "
                                         "rowwise_fast, rowwise"):
        fp8.gemm_from_env()


def test_a_bad_fp8_gemm_env_breaks_only_fp8_engines(monkeypatch):
    monkeypatch.setenv(fp8.GEMM_ENV, "blockwise")
    # importing the module does not read it (a fresh copy, so the imported one and its users stay as they are)
    spec = importlib.util.spec_from_file_location("fp8_fresh_copy", fp8.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert fresh.GEMM == "tensorwise_fast"
    model = _qwen(seed=0)
    prompts = make_prompts(2, 6, model.config.vocab_size, meta={"do_sample": False})
    assert make_engine(model, 6, 3).generate(prompts).batch["responses"].shape == (2, 3)  # unquantized: unaffected
    with pytest.raises(ValueError, match="HYBRIDFLOW_FP8_GEMM='blockwise' .*rollout.quantization=fp8.*use one of "
                                         "tensorwise_fast"):
        make_engine(model, 6, 3, quantization="fp8")
    assert fp8.GEMM == "tensorwise_fast"  # refused before it was selected


def _codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = fp8.quantize_rows(w)
    return codes, scale.squeeze(-1)


def _agreement(a, b) -> tuple[float, int]:
    """(fraction of response tokens equal position by position, rows equal throughout)."""
    mask = a.batch["response_mask"].bool() & b.batch["response_mask"].bool()
    same = a.batch["responses"] == b.batch["responses"]
    return float(same[mask].float().mean()), int((same | ~mask).all(-1).sum())


def _qwen(seed: int) -> torch.nn.Module:
    """The small Qwen2 shape at a real model's weight scale (std 0.02): make_model's peaky std 0.2 makes this 3-layer
    model so sensitive that even weight-only fp8 moves its logits by 20% (a third of greedy first tokens flip)."""
    model = make_model("qwen", seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model


def test_fp8_engine_greedy_tokens_and_logprobs_close_to_the_unquantized_engine(caplog):
    model = _qwen(seed=1)
    prompts = make_prompts(16, 12, model.config.vocab_size, seed=3, meta={"do_sample": False})
    ref = make_engine(model, 12, 10).generate(prompts)
    engine = make_engine(model, 12, 10, quantization="fp8")
    out = engine.generate(prompts)
    lw = engine._weights.layers[0]
    assert lw.qkv.dtype == torch.float8_e4m3fn and lw.down.dtype == torch.float8_e4m3fn
    assert engine._weights.lm_head.dtype == engine._weights.embed.dtype == engine.dtype  # not quantized
    frac, rows = _agreement(out, ref)
    # greedy rows agree until a near-tie flips: on this model 8/8 first tokens and ~0.9 of all tokens (measured)
    assert (out.batch["responses"][:, 0] == ref.batch["responses"][:, 0]).all()
    assert frac >= 0.75, frac
    # log-prob gap on the tokens both engines chose from the same context (the prefix before the first flip)
    same_prefix = (out.batch["responses"] == ref.batch["responses"]).long().cumprod(-1).bool()
    same_prefix &= out.batch["response_mask"].bool()
    gap = (out.batch["rollout_log_probs"] - ref.batch["rollout_log_probs"])[same_prefix].abs()
    logging.getLogger(__name__).info("fp8 vs unquantized: %.3f tokens equal, %d/16 rows equal, |Δlogp| mean %.4f "
                                     "max %.4f", frac, rows, gap.mean(), gap.max())
    assert 0 < gap.mean() < 0.05 and gap.max() < 0.3, (gap.mean(), gap.max())


def test_fp8_buffers_keep_their_storage_and_follow_an_optimizer_step():
    model = _qwen(seed=2)
    engine = make_engine(model, 8, 6, quantization="fp8")
    prompts = make_prompts(4, 8, model.config.vocab_size, meta={"do_sample": False})
    engine.generate(prompts)
    ptrs, codes = engine._weights.ptrs, engine._weights.layers[1].qkv.float().clone()
    scales = engine._weights.layers[1].down_scale.clone()
    engine.sync_weights()  # a switch with the same weights: same storage, same codes
    assert engine._weights.ptrs == ptrs and torch.equal(engine._weights.layers[1].qkv.float(), codes)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out = model(input_ids=prompts.batch["input_ids"]).logits
    out.logsumexp(-1).mean().backward()
    opt.step()
    engine.sync_weights()
    lw = engine._weights.layers[1]
    assert engine._weights.ptrs == ptrs  # refilled in place: captured CUDA graphs stay valid
    assert not torch.equal(lw.qkv.float(), codes) and not torch.equal(lw.down_scale, scales)
    want, want_scale = _codes(torch.cat([model.model.layers[1].self_attn.q_proj.weight,
                                         model.model.layers[1].self_attn.k_proj.weight,
                                         model.model.layers[1].self_attn.v_proj.weight]).detach())
    assert torch.equal(lw.qkv.float(), want.float()) and torch.equal(lw.qkv_scale, want_scale)
    engine.release_cache()  # back to training: the fp8 stacks are freed, and rebuilt by the next generate
    assert not engine._fp8._stacks
    assert engine.generate(prompts).batch["responses"].shape == (4, 6) and engine._fp8._stacks


def test_fp8_quantizes_the_lora_merged_weights():
    model = build_model("tiny", 2, lora_rank=4, lora_alpha=8.0, targets="all-linear", base_dtype=torch.float32,
                        b_std=0.3)
    with torch.no_grad():
        lw = fp8.Fp8Weights().quantize(WeightView(model, torch.float32, torch.device("cpu")).build()).layers[1]
    owner = model.model.layers[1].mlp.down_proj
    b, a, scale = lora_factors(owner)
    merged = (owner.weight + scale * b @ a).detach()
    got = fp8.dequantize(lw.down, lw.down_scale)
    assert ((got - merged).abs() <= EPS * merged.abs() + SUB * lw.down_scale[:, None] + 1e-6).all()
    assert (got - merged).norm() < 0.2 * (got - owner.weight).norm()  # the adapter's delta is in the codes


def test_fp8_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="rollout.quantization='fp8'.*MoE"):
        make_engine(make_family("qwen3_moe"), 8, 6, quantization="fp8")
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match="rollout.quantization='fp8'.*HF generate.*gpt2"):
        make_engine(gpt2, 8, 6, quantization="fp8")
    with pytest.raises(ValueError, match="rollout.tensor_model_parallel_size=2"):
        load_config([], ["rollout.quantization=fp8", "rollout.tensor_model_parallel_size=2"])
    with pytest.raises(ValueError, match="rollout.name='hf'"):
        load_config([], ["rollout.quantization=fp8", "rollout.name=hf"])
    with pytest.raises(ValueError, match="rollout.quantization='fp8'.*float16.*overflow"):
        fp8.check_supported(_qwen(0), fallback_reason=None, tp_size=1, device=torch.device("cpu"), dtype=torch.float16)


def _is_mode(files=(), overrides=()) -> str | None:
    """The rollout-IS mode a run of this config applies (None: off)."""
    is_cfg = resolve(load_config(list(files), list(overrides))).rollout_is
    return None if is_cfg is None else is_cfg.mode


def test_fp8_turns_truncated_importance_sampling_on_unless_set(caplog):
    assert _is_mode() is None
    assert _is_mode(overrides=["rollout.quantization=fp8"]) == "tis"
    assert _is_mode(overrides=["rollout.quantization=fp8", "algorithm.rollout_is.mode=mask"]) == "mask"
    assert _is_mode(overrides=["algorithm.rollout_is.mode=mask", "rollout.quantization=fp8"]) == "mask"
    assert _is_mode(overrides=["algorithm.rollout_is.mode=tis"]) == "tis"  # set without fp8: kept too
    with caplog.at_level(logging.WARNING):
        assert _is_mode(overrides=["rollout.quantization=fp8", "algorithm.rollout_is.mode=null"]) is None
    assert "not corrected" in caplog.text


def test_fp8_tis_default_follows_the_quantization_the_run_ends_up_with(tmp_path):
    """auto is decided from the final config: fp8 set by an override over a file, by an override of a run's saved
    config.yaml, or after loading, turns TIS on; an explicit mode in a file survives an fp8 override."""
    fp8_file = tmp_path / "fp8.yaml"
    fp8_file.write_text("rollout:\n  quantization: fp8\n")
    assert _is_mode([fp8_file]) == "tis"
    assert _is_mode([fp8_file], ["rollout.quantization='none'"]) is None
    for quantization, want in (("none", "tis"), ("fp8", None)):  # a saved run's config, rerun with the other one
        write_run_info(tmp_path / quantization, load_config([], [f"rollout.quantization='{quantization}'"]))
        saved = tmp_path / quantization / "config.yaml"
        other = "fp8" if quantization == "none" else "none"
        assert _is_mode([saved]) == (None if quantization == "none" else "tis")
        assert _is_mode([saved], [f"rollout.quantization='{other}'"]) == want
    cfg = load_config()
    fp8_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, quantization="fp8"))
    assert resolve(cfg).rollout_is is None and resolve(fp8_cfg).rollout_is.mode == "tis"
    assert resolve(fp8_cfg).recompute_old_log_prob  # TIS needs the old log-probs
    for mode in ("mask", "null"):  # set in a file: never replaced by the fp8 default
        user = tmp_path / f"{mode}.yaml"
        user.write_text(f"algorithm:\n  rollout_is:\n    mode: {mode}\n")
        assert _is_mode([user], ["rollout.quantization=fp8"]) == (None if mode == "null" else mode)


ACC_BITS = 13  # fraction bits of the fp8 MMA's accumulator (~fp22; DeepSeek-V3 measured ~14 significant bits)
MMA_K = 32  # products one Hopper fp8 MMA instruction adds into its accumulator


def _products(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """[M, N, K / MMA_K, MMA_K] fp64: the products of each output's sum, in the MMA's blocks (zero-padded)."""
    p = xq.float().double()[:, None, :] * wq.float().double()[None]  # via fp32, as the emulation casts
    return F.pad(p, (0, -p.shape[-1] % MMA_K)).unflatten(-1, (-1, MMA_K))


def _fast_accum_bound(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """[M, N]: a bound, in code units (before the scales), on |the fast-accumulated xq @ wq.T - the exact sum|.

    The model (NVIDIA documents none; DeepSeek-V3 section 3.3.2 measured it): with `use_fast_accum` the sum stays in
    the MMA's accumulator over the whole of K instead of being added into fp32 registers every few instructions.
    Each instruction adds MMA_K products (exact: an e4m3 product has 8 significant bits) to the accumulator s_b, all
    right-shifted to the exponent of the largest of them, m_b = max(|s_b|, |p_bj|), keeping ACC_BITS fraction bits
    (truncation): each of the MMA_K + 1 terms loses under 2^-ACC_BITS m_b, and the result is cut to ACC_BITS bits of
    its own, under 2^-ACC_BITS |s_b+1|. Summed over the blocks of K, then doubled: the s_b here are the exact
    partial sums (the hardware's are off by the error so far, a few % at most), and the kernel's order over K is
    not known. The bound is loose on purpose: on the test's random rows of K = 512 it is ~11% of the median output
    (3% at least), the modelled accumulator errs by under 2% of the bound, and DeepSeek's measured error at K = 4096
    (~2% of the output) would fit it too; a doubled scale errs by the whole output."""
    p = _products(xq, wq)
    after = p.sum(-1).cumsum(-1)  # [M, N, blocks]: s_b+1
    before = F.pad(after[..., :-1], (1, 0))  # s_b
    m = torch.maximum(before.abs(), p.abs().amax(-1))
    per_block = (MMA_K + 1) * m + after.abs()
    return 2 * 2.0 ** -ACC_BITS * per_block.sum(-1)


def _fast_accum_tolerance(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor) -> torch.Tensor:
    """[M, N]: how far a fast-accumulating `fp8_linear(x, codes, scale, bias)` (bf16) may be from its emulation: the
    accumulation bound times both scales, plus one bf16 ulp (<= 2^-7 of the value) per rounding where the two may
    round apart: the unscaled sum (tensorwise), the scaled product, the bias add."""
    xq, xs = fp8.quantize_rows(x)
    acc_err = _fast_accum_bound(xq, codes).float() * xs * scale[None]
    pre = (xq.float() @ codes.float().t() * xs * scale[None]).abs() + acc_err
    return acc_err + 2.0 ** -7 * (3 * pre + bias.float().abs()[None]) + 1e-6


def _simulated_fast_accum(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """xq @ wq.T through the accumulator `_fast_accum_bound` models (fp64, truncating to ACC_BITS fraction bits)."""
    p = _products(xq, wq)
    acc = torch.zeros(p.shape[:2], dtype=torch.float64)

    def cut(v: torch.Tensor, top: torch.Tensor) -> torch.Tensor:  # keep ACC_BITS fraction bits below 2^floor(log2 top)
        q = torch.exp2(torch.floor(torch.log2(top.clamp(min=1e-300))) - ACC_BITS)
        return torch.trunc(v / q) * q

    for b in range(p.shape[2]):
        terms = torch.cat([acc[..., None], p[:, :, b]], -1)
        total = cut(terms, terms.abs().amax(-1, keepdim=True)).sum(-1)
        acc = cut(total, total.abs())
    return acc


def _cuda_case() -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(384, 512, device="cuda", generator=g) * 0.05
    x = (torch.randn(37, 512, device="cuda", generator=g) * 3).bfloat16()  # M not a multiple of 16
    bias = torch.randn(384, device="cuda", generator=g).bfloat16()
    return x, w, bias


def test_fast_accumulation_tolerance_holds_for_the_modelled_accumulator_and_refuses_a_wrong_scale():
    """The CUDA test's tolerance for the _fast recipes, on the CPU: a tensorwise_fast output computed through the
    modelled accumulator is within it of the emulation; the same with the weight scales doubled is not."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 512, generator=g) * 0.05
    x = (torch.randn(37, 512, generator=g) * 3).bfloat16()
    bias = torch.randn(384, generator=g).bfloat16()
    codes, scale = _codes(w)
    want = fp8.fp8_linear(x, codes, scale, bias, emulate=True, gemm="tensorwise_fast")
    tol = _fast_accum_tolerance(x, codes, scale, bias)
    xq, xs = fp8.quantize_rows(x)
    acc = _simulated_fast_accum(xq, codes)
    exact = xq.double() @ codes.double().t()
    assert ((acc - exact).abs() <= _fast_accum_bound(xq, codes)).all()
    assert (acc - exact).abs().max() > 0  # the model really loses bits at this K

    def through(acc: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (acc.bfloat16().float() * xs * s[None]).bfloat16() + bias

    assert ((through(acc, scale).float() - want.float()).abs() <= tol).all()
    assert tol.median() < 0.2 * want.float().abs().median()  # tight enough to see a wrong scale or transposition
    assert ((through(acc, 2 * scale).float() - want.float()).abs() > tol).float().mean() > 0.5
    assert ((through(acc, scale.flip(0)).float() - want.float()).abs() > tol).any()


@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with compute capability >= 8.9 (torch._scaled_mm in fp8)")
@pytest.mark.parametrize("gemm", fp8.GEMMS)
def test_scaled_mm_matches_the_emulation_on_cuda(gemm):
    x, w, bias = _cuda_case()
    codes, scale = _codes(w)
    got = fp8.fp8_linear(x, codes, scale, bias, emulate=False, gemm=gemm)
    want = fp8.fp8_linear(x, codes, scale, bias, emulate=True, gemm=gemm)
    assert got.dtype == torch.bfloat16
    if gemm.endswith("_fast"):  # the accumulator's lost bits: bounded from K and the data (`_fast_accum_bound`)
        tol = _fast_accum_tolerance(x, codes, scale, bias)
        err = (got.float() - want.float()).abs()
        assert (err <= tol).all(), (float(err.max()), float((err / tol).max()))
        wrong = fp8.fp8_linear(x, codes, 2 * scale, bias, emulate=False, gemm=gemm)
        assert ((wrong.float() - want.float()).abs() > tol).float().mean() > 0.5
    else:  # same codes, scales and roundings: only the summation order differs
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
    ref = F.linear(x.float(), w, bias.float())
    assert (got.float() - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.skipif(not FP8_GPU, reason="needs a GPU with compute capability >= 8.9 (torch._scaled_mm in fp8)")
def test_fp8_engine_on_cuda_keeps_its_graphs_across_switches_and_tracks_bf16():
    model = _qwen(seed=1).cuda()  # fp32 master weights: bf16 cast buffers, then the fp8 stacks
    prompts = make_prompts(16, 12, model.config.vocab_size, seed=3, meta={"do_sample": False})
    ref = make_engine(model, 12, 10).generate(prompts)
    engine = make_engine(model, 12, 10, quantization="fp8")
    first = engine.generate(prompts)
    graphs = dict(engine._runner.graphs)
    assert graphs and engine._weights.layers[0].qkv.dtype == torch.float8_e4m3fn
    engine.sync_weights()
    assert engine._runner.graphs == graphs  # refilled in place: nothing recaptured
    again = engine.generate(prompts)
    assert torch.equal(again.batch["responses"], first.batch["responses"])
    frac, _ = _agreement(first, ref)
    assert frac >= 0.75, frac
