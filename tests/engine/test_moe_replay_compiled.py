"""Routing replay through `torch.compile`d decoder layers: routes given after a layer was traced without them must
still force the recorded experts (the routers' hooks are installed once, before any trace, and switched by state).
The backend is `eager` to stay fast on CPU; the graph reuse it checks happens before any backend runs."""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from hybridflow.engine.moe_aux import router_logits
from hybridflow.engine.moe_replay import routers, routing_replay


def test_replay_applies_after_compiled_forward_without_routes():
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    model = Qwen3MoeForCausalLM(cfg).eval()
    x = torch.randint(0, 64, (1, 6))
    routes = torch.randint(0, 4, (1, 6, len(routers(model)), 1)).repeat(1, 1, 1, 2)
    routes[..., 1] = (routes[..., 0] + 1) % 4
    mask = torch.ones(1, 6)

    def replayed(model, r=routes):
        with torch.no_grad(), routing_replay(model, r, mask, False, True, torch.device("cpu")) as agreement:
            logits = model(x).logits
            return logits, agreement()

    want, agree = replayed(model)
    with torch.no_grad():
        plain = model(x).logits
    assert not torch.allclose(want, plain)  # replay forces other experts than the router's own
    assert agree is not None and not agree.all()
    twin = Qwen3MoeForCausalLM(cfg).eval()
    twin.load_state_dict(model.state_dict())
    for m in (model, twin):
        for layer in m.model.layers:
            layer.compile(backend="eager")
    with torch.no_grad():
        model(x)  # `model`: traced with the hooks installed (by the replay above) and inactive
    # `twin`: its first forward ever is compiled, through routing_replay without routes, as the engine's first pass
    torch.testing.assert_close(replayed(twin, None)[0], plain)
    for m in (model, twin):
        got, agree_got = replayed(m)
        torch.testing.assert_close(got, want)
        assert torch.equal(agree_got, agree)
    with torch.no_grad():  # and back: no routes, the router's own choice
        torch.testing.assert_close(model(x).logits, plain)


def test_aux_loss_logits_recorded_after_a_compiled_pass_without_them():
    """The engine's order: a no-grad log-prob pass (loss off) traces the compiled layers, then a training forward
    wants the routers' logits for the load-balancing loss: they must be recorded (per-forward hooks added after the
    trace recorded nothing, and the loss then had no logits)."""
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1)
    model = Qwen3MoeForCausalLM(cfg)
    x = torch.randint(0, 64, (1, 6))
    with router_logits(model, True) as eager:
        model(x)
    for layer in model.model.layers:
        layer.compile(backend="eager")
    with torch.no_grad(), router_logits(model, False) as off:
        model(x)
    assert off == []
    for grad in (False, True):
        with torch.set_grad_enabled(grad), router_logits(model, True) as got:
            model(x)
        assert len(got) == 2
        for a, b in zip(got, eager):
            torch.testing.assert_close(a, b)
