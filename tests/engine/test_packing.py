"""Packed (padding-free) forward == padded forward == a naive per-sequence reference, on the tiny model (fp32)."""

import pytest
import torch
from engine_testlib import make_batch, make_config

from hybridflow.engine.attention import register
from hybridflow.engine.model_forward import HeadRequest, install_engine_forward
from hybridflow.engine.packing import build_inputs, scatter_to_responses
from hybridflow.models import load_model


@pytest.fixture(scope="module")
def actor(dist_group):
    model = load_model(make_config().model, "actor", attn_implementation=register())
    install_engine_forward(model)
    return model


def _run(model, data, packed, req):
    b = data.batch
    R = b["responses"].shape[1]
    inputs = build_inputs(b["input_ids"], b["attention_mask"], b["position_ids"], R, packed)
    out = model(hf_inputs=inputs, hf_request=req)
    if req.kind == "score":
        return out
    return {k: scatter_to_responses(v, inputs.dst_K, len(data), R) for k, v in out.items()}


def _naive_logprobs(model, data, temperature):
    """Each sequence alone, unpadded, full-vocab log-softmax."""
    b = data.batch
    P = b["input_ids"].shape[1] - b["responses"].shape[1]
    out = torch.zeros(b["responses"].shape)
    for i in range(len(data)):
        keep = b["attention_mask"][i].bool()
        ids = b["input_ids"][i][keep]
        n_prompt = int(keep[:P].sum())
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float() / temperature, -1)
        for j in range(int(keep[P:].sum())):
            out[i, j] = logp[n_prompt + j - 1, ids[n_prompt + j]]
    return out


def test_build_inputs_layout():
    data = make_batch(batch=3, prompt=4, response=3, seed=1)
    b = data.batch
    inp = build_inputs(b["input_ids"], b["attention_mask"], b["position_ids"], 3, packed=True)
    lens = b["attention_mask"].sum(-1)
    assert inp.input_ids.shape == (1, int(lens.sum()))
    assert inp.cu_seqlens.tolist() == [0, *torch.cumsum(lens, 0).tolist()]
    # Positions restart at 0 for every packed sequence.
    assert (inp.position_ids[0, inp.cu_seqlens[:-1].long()] == 0).all()
    # The label at each gathered response position is the packed token right after the predicting position.
    assert torch.equal(inp.input_ids[0, inp.src_K + 1], inp.labels_K)


def test_packed_equals_padded_equals_naive_logprobs(actor):
    data = make_batch(seed=3)
    req = HeadRequest("lm", temperature=0.8, chunk_size=7, with_entropy=True)
    with torch.no_grad():
        packed = _run(actor, data, True, req)
        padded = _run(actor, data, False, req)
        naive = _naive_logprobs(actor, data, 0.8)
    torch.testing.assert_close(packed["log_probs"], padded["log_probs"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed["entropy"], padded["entropy"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed["log_probs"], naive, atol=1e-5, rtol=1e-5)
    assert (packed["log_probs"][data.batch["response_mask"] == 0] == 0).all()


def test_packed_equals_padded_gradients(actor):
    data = make_batch(seed=4)
    req = HeadRequest("lm", chunk_size=5, with_entropy=True)
    grads = []
    for packed in (True, False):
        actor.zero_grad()
        out = _run(actor, data, packed, req)
        (out["log_probs"].sum() + 0.1 * out["entropy"].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in actor.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_critic_values_and_reward_scores_packed_equal_padded(dist_group):
    model = load_model(make_config().model, "critic", attn_implementation=register())
    install_engine_forward(model)
    data = make_batch(seed=5)
    with torch.no_grad():
        v_packed = _run(model, data, True, HeadRequest("value"))["values"]
        v_padded = _run(model, data, False, HeadRequest("value"))["values"]
        s_packed = _run(model, data, True, HeadRequest("score"))["values"]
        s_padded = _run(model, data, False, HeadRequest("score"))["values"]
        # Naive: HF token-classification forward of each sequence alone.
        b = data.batch
        P = b["input_ids"].shape[1] - b["responses"].shape[1]
        for i in range(len(data)):
            keep = b["attention_mask"][i].bool()
            per_tok = model(input_ids=b["input_ids"][i][keep][None]).logits[0, :, 0]
            n_prompt, n_resp = int(keep[:P].sum()), int(keep[P:].sum())
            torch.testing.assert_close(v_packed[i, :n_resp], per_tok[n_prompt - 1:n_prompt + n_resp - 1],
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s_packed[i], per_tok[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_packed, v_padded, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_packed, s_padded, atol=1e-5, rtol=1e-5)
