"""Steering on the pretrained models shipped in PyPI packages (MiniLM encoder, SmolLM2 decoder).

Skipped (with the reason) when a model cannot be loaded in this environment.
"""
import numpy as np
import jax.numpy as jnp
import pytest

from powerlens._src.steering import (alignment_alpha, entering_states, optimize_steering, output_effects,
                                parse_direction, rank1)
from powerlens._src.steering.optimize import run_tail

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "I like green tea in the morning."]


def _load(name):
    try:
        import powerlens._src.models as M
        return M.load(name)
    except Exception as exc:  # noqa: BLE001 - any failure to load means: skip, saying why
        pytest.skip(f"cannot load {name!r} here: {type(exc).__name__}: {exc}")


@pytest.fixture(scope="module")
def minilm():
    import powerlens._src.models as M
    m = _load("minilm")
    x0, valid = M.embed(m, TEXTS)
    u = parse_direction("token:king", model=m)
    return m, np.asarray(x0), np.asarray(valid), u


def _paper_final_cos(layers, x0, valid, u):
    Y = np.asarray(run_tail(layers, jnp.asarray(x0), jnp.asarray(valid), layers.schedule, rule="paper",
                            attention="softmax", keep_bias=False), np.float64)
    cos = (Y @ u) / np.linalg.norm(Y, axis=-1)
    return cos[valid]


def test_minilm_token_direction(minilm):
    from transformers import AutoTokenizer
    m, _, _, u = minilm
    tok = AutoTokenizer.from_pretrained(m.info.tokenizer)
    tid = tok.convert_tokens_to_ids("king")
    assert u.token_id == tid
    W = np.asarray(m.embeddings["word"], np.float64)
    np.testing.assert_allclose(u.vector, W[tid] / np.linalg.norm(W[tid]), atol=1e-12)
    with pytest.raises(ValueError, match="token:antidisestablishmentarianism does not name a single known token"):
        parse_direction("token:antidisestablishmentarianism", model=m)
    with pytest.raises(ValueError, match="unknown token"):
        parse_direction("token:\u2603\u2604", model=m)


def test_minilm_one_step_relation_and_gradient(minilm):
    m, x0, valid, u = minilm
    target = 0.9
    X, vb = entering_states(m.layers, x0, valid)          # output of the first 5 layers (paper rule)
    aa = alignment_alpha(m.layers, X, u.vector, target=target, valid=vb, w="value")
    steered = rank1(m.layers, u.vector, alpha=aa.alpha, w="value", spectrum=False)
    cos = _paper_final_cos(steered.layers, x0, valid, u.vector)
    assert cos.min() == pytest.approx(target, abs=1e-4)
    assert _paper_final_cos(rank1(m.layers, u.vector, alpha=0.99 * aa.alpha, w="value", spectrum=False).layers,
                            x0, valid, u.vector).min() < target
    res = optimize_steering(m.layers, x0, u.vector, valid=valid, target=target, reduce="min", param="w_alpha",
                            w="value", steps=150)
    assert res.closed_norm[0] == pytest.approx(steered.delta_norm, rel=1e-3)
    assert res.feasible[0]
    Lp = m.layers.replace(W_o=m.layers.W_o.at[-1].add(jnp.asarray(res.delta_O[0])))
    assert _paper_final_cos(Lp, x0, valid, u.vector).min() >= target - 1e-3
    assert res.norm[0] <= steered.delta_norm


def test_minilm_effects(minilm):
    import powerlens._src.models as M
    m, x0, valid, u = minilm
    r = rank1(m.layers, u.vector, alpha=50.0, w="value", spectrum=False)
    eff = output_effects(m, u.vector, r.delta_O, TEXTS)
    assert not eff["decoder"]
    h = np.asarray(M.hidden_states(m, jnp.asarray(x0), jnp.asarray(valid))[-1], np.float64)
    for b in range(len(TEXTS)):
        pooled = h[b][valid[b]].mean(0)
        assert eff["conditions"]["before"]["pooled_cos"][b] == pytest.approx(
            pooled @ u.vector / np.linalg.norm(pooled), abs=1e-4)
    c = eff["conditions"]
    assert c["activation_addition"]["alignment"] > c["before"]["alignment"]
    assert eff["paper_rule_alignment"]["rank1"]["mean"] > eff["paper_rule_alignment"]["before"]["mean"]


def test_smollm2_steer_toward_token():
    m = _load("smollm2")
    d = parse_direction("token:Paris", model=m)
    assert d.token == " Paris"
    from powerlens._src.models.embed import tokenizer
    assert tokenizer(m).decode([d.token_id]).strip() == "Paris"
    r = rank1(m.layers, d.vector, alpha=20.0, w="value", spectrum=False)
    eff = output_effects(m, d.vector, r.delta_O, ["My favourite city is"], target_id=d.token_id, k=3,
                         neutral=["The weather is nice today."])
    c = eff["conditions"]
    before = c["before"]["target_prob_mean"]
    assert c["rank1"]["target_prob_mean"] > before
    assert c["activation_addition"]["target_prob_mean"] > before
    for name in c:
        assert 1.0 < c[name]["perplexity"] < 1e4
        probs = [t["prob"] for t in c[name]["topk"][0]]
        assert probs == sorted(probs, reverse=True)
    with pytest.raises(ValueError, match="single known token"):
        parse_direction("token:antidisestablishmentarianism", model=m)
