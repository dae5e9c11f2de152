"""``pl.generate`` with its key/value cache: batching, sampling, edits, progress, bad options.

Greedy decoding of every tiny decoder family against transformers is tests/test_generate.py
(which runs the cached loop); here:

* Batching: each row of a batch of prompts of different lengths gets exactly the tokens that
  prompt gets alone (greedy, and sampled with the same key for row 0), on families with
  learned positions (GPT-2; OPT, positions offset by 2) and local layers (Gemma 2, window 3 <
  the prompts).
* The cache: its arrays have the shape the module says, T x B x G x (n + K - 1) x e per
  keys and values, and nothing else grows with the prompts.
* Edits: a model edited by ``steered_model`` (W_o of one layer changed), and an activation
  addition (``add=``: a vector added to one layer's output at every token), against
  transformers with the same weight change (Llama; GPT-2, whose Conv1D stores W_o transposed),
  or a forward hook adding the same vector (Llama; Gemma 2, whose post-FFN norm makes a bias
  change inexact): token for token.
* Sampling: reproducible with a key; top_k = 1 is greedy; the first sampled token's
  empirical frequencies over 4,000 independent rows match softmax(logits / T) restricted to
  the top-k, then the top-p nucleus, renormalised (computed in float64 from ``pl.logits`` of the
  uncached forward), within 4.5 binomial standard deviations, and tokens outside that set
  are never drawn.
* SmolLM2: 64 new tokens on three prompts against transformers (slow-marked).
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

import jax  # noqa: E402

import hf_tiny_decoders as T  # noqa: E402
import powerlens as pl  # noqa: E402
from test_generate import MARGIN, SMOL_PROMPTS, hf_greedy, random_prompts, smol_pair  # noqa: E402,F401  (smol_pair: a fixture)

NEW = 12
CONFIGS = {
    "gpt2": ("gpt2", dict(n_positions=32)),
    "opt": ("opt", dict()),
    "llama": ("llama", dict(rope_theta=500.0)),
    "gemma2": ("gemma2", dict(final_logit_softcapping=30.0)),
}

case = T.case_fixture(CONFIGS, seed=70)


# ----------------------------------------------------------------------------- batching

@pytest.mark.parametrize("case", ["gpt2", "opt", "gemma2"], indirect=True)
def test_each_row_is_the_prompt_alone(case):
    model, prompts = case["model"], random_prompts(5)
    batch = pl.generate(model, prompts, max_new_tokens=NEW).new_ids
    alone = [pl.generate(model, [p], max_new_tokens=NEW).new_ids[0] for p in prompts]
    assert batch == alone
    ref, margin = hf_greedy(case["hf"], prompts)
    assert margin >= MARGIN and batch == ref


@pytest.mark.parametrize("case", ["gpt2", "gemma2"], indirect=True)
def test_layer_by_layer_step_is_the_scan(case):
    """The decoding step written out layer by layer (each layer's own buffers, the FFN held
    (in, out)) and the scan over the stacked layers give the same tokens as transformers,
    with an activation addition too; the layers' buffers are built once per set of weights."""
    from powerlens._src.dynamics.projections import prepared_projections
    from powerlens._src.models.kv_cache import decode_layers
    model, prompts = case["model"], random_prompts()
    ref, margin = hf_greedy(case["hf"], prompts)
    assert margin >= MARGIN
    assert pl.generate(model, prompts, max_new_tokens=NEW, unroll=True).new_ids == ref
    assert pl.generate(model, prompts, max_new_tokens=NEW, unroll=False).new_ids == ref
    v = np.full(model.layers.config.d_model, 0.5, np.float32)
    assert pl.generate(model, prompts, max_new_tokens=NEW, unroll=True, add=v, add_layer=1).new_ids == \
        pl.generate(model, prompts, max_new_tokens=NEW, unroll=False, add=v, add_layer=1).new_ids
    proj = prepared_projections(model.layers)
    split = decode_layers(model, proj, force=True)
    assert split is decode_layers(model, proj, force=True)          # kept, not rebuilt
    assert len(split) == model.layers.n_unique
    lp, _, (W_in, _, W_out) = split[0]
    assert lp.W_in is None and W_in.shape == model.layers.W_in.shape[:0:-1] and W_out.shape == model.layers.W_out.shape[:0:-1]


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_cache_has_one_fixed_size(case):
    """The loop's state: the cache "float[T B G N e]" with N = n + K - 1, and the ids."""
    from powerlens._src.dynamics.projections import prepared_projections
    from powerlens._src.models import generate as G
    model = case["model"]
    prompts = random_prompts()
    n, K, B = max(map(len, prompts)), 9, len(prompts)
    ids, valid = pl.embed_ids(model, *_padded(prompts))
    sampling = G._sampling(None, None, None, None)
    args = (np.asarray([len(p) for p in prompts], np.int32), np.zeros((0,), np.int32),
            prepared_projections(model.layers), sampling, None, None)
    state = G._start(model, ids, valid, *args, size=n + K - 1, n_new=K, chunk=None, pad=0, top_k=None)
    cfg = model.layers.config
    shape = (len(model.layers.schedule), B, cfg.n_kv_heads, n + K - 1, cfg.d_head)
    assert state[2].k.shape == state[2].v.shape == shape
    assert state[2].k.nbytes + state[2].v.nbytes == 2 * 4 * int(np.prod(shape))
    # besides the cache, the state is the step, the last tokens, the new ids, the stop flags and the counts
    assert sum(a.nbytes for a in jax.tree_util.tree_leaves(state)) == \
        2 * 4 * int(np.prod(shape)) + 4 + 4 * B + 4 * B * K + B + 4 * B
    out = G._steps(model, state, np.int32(K), *args, pad=0, top_k=None)
    assert [list(map(int, r)) for r in np.asarray(out[3])] == pl.generate(model, prompts, max_new_tokens=K).new_ids


def _padded(prompts):
    n = max(map(len, prompts))
    ids = np.zeros((len(prompts), n), np.int32)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    return ids, np.arange(n)[None] < np.asarray([len(p) for p in prompts])[:, None]


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_bf16_weights_generate_as_their_float32_values(case):
    """Weights held in bfloat16 and computed in float32, a layer cast at a time, generate the
    tokens of the float32 model holding the same (bf16-rounded) values; bf16 compute runs too."""
    import dataclasses

    import jax.numpy as jnp
    prompts = random_prompts()
    half = pl.load(case["folder"], dtype="bfloat16")
    assert half.layers.W_v.dtype == jnp.bfloat16 and half.layers.dtype == jnp.float32
    up = lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a
    ref = jax.tree_util.tree_map(up, half)
    ref = ref.replace(layers=ref.layers.replace(config=dataclasses.replace(ref.layers.config, compute_dtype=None)))
    assert ref.layers.storage_dtype == jnp.float32
    want = pl.generate(ref, prompts, max_new_tokens=NEW).new_ids
    assert pl.generate(half, prompts, max_new_tokens=NEW).new_ids == want
    low = half.replace(layers=half.layers.replace(config=dataclasses.replace(half.layers.config, compute_dtype=None)))
    out = pl.generate(low, prompts, max_new_tokens=NEW).new_ids
    assert [len(r) for r in out] == [NEW] * 3 and all(0 <= t < T.VOCAB for r in out for t in r)


# ----------------------------------------------------------------------------- edits

def _o_proj(hf, layer: int):
    """(transformers' attention output weight of ``layer``, whether it is stored (H e, d), GPT-2's Conv1D)."""
    if hasattr(hf, "transformer"):
        return hf.transformer.h[layer].attn.c_proj.weight, True
    return hf.model.layers[layer].self_attn.o_proj.weight, False


def _delta(model, scale: float):
    d, He = model.layers.W_o.shape[1:]
    u, w = np.random.default_rng(1).normal(size=d), np.random.default_rng(2).normal(size=He)
    return scale * np.outer(u, w) / np.sqrt(d * He)


@pytest.mark.parametrize("case", ["llama", "gpt2"], indirect=True)
def test_steered_model_generates_as_transformers_with_the_same_weight_change(case):
    """W_o[1] += dO (GPT-2 stores it transposed, as Conv1D): transformers with its own weight
    changed gives the same tokens, and they differ from the unedited model's."""
    from powerlens._src.steering.effects import steered_model
    model, hf, prompts = case["model"], case["hf"], random_prompts(7)
    dO = _delta(model, 8.0)
    out = pl.generate(steered_model(model, dO, layer=1), prompts, max_new_tokens=NEW).new_ids
    weight, conv1d = _o_proj(hf, 1)
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight += torch.tensor(dO.T if conv1d else dO, dtype=weight.dtype)
        ref, margin = hf_greedy(hf, prompts)
    finally:
        with torch.no_grad():
            weight.copy_(saved)
    assert margin >= MARGIN
    assert out == ref
    assert out != pl.generate(model, prompts, max_new_tokens=NEW).new_ids      # the edit changed something


@pytest.mark.parametrize("case", ["llama", "gemma2"], indirect=True)
def test_activation_addition_generates_as_transformers_with_a_hook(case):
    """``add=v, add_layer=1``: transformers with a forward hook adding v to layer 1's output
    gives the same tokens, which differ from the unedited model's. Gemma 2's block ends in a
    norm (post-FFN), so there the addition is not a bias change of the block."""
    model, hf, prompts = case["model"], case["hf"], random_prompts(8)
    d = model.layers.config.d_model
    v = ((3.0 if case["name"] == "llama" else 60.0) / np.sqrt(d) * np.random.default_rng(4).normal(size=d)).astype(np.float32)

    def hook(module, inputs, output):
        if isinstance(output, tuple):
            return (output[0] + torch.tensor(v),) + tuple(output[1:])
        return output + torch.tensor(v)

    handle = hf.model.layers[1].register_forward_hook(hook)
    try:
        ref, margin = hf_greedy(hf, prompts)
    finally:
        handle.remove()
    assert margin >= MARGIN
    out = pl.generate(model, prompts, max_new_tokens=NEW, add=v, add_layer=1).new_ids
    assert out == ref
    assert pl.generate(model, prompts, max_new_tokens=NEW, add=v, add_layer=-2).new_ids == ref     # 3 layers
    assert out != pl.generate(model, prompts, max_new_tokens=NEW).new_ids
    if case["name"] == "llama":
        # the same edit as a bias change of the block (exact for this pre-norm block)
        from powerlens._src.steering.compare import activation_model
        assert pl.generate(activation_model(model, v, 1), prompts, max_new_tokens=NEW).new_ids == ref


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_an_applied_edit_generates(case, tmp_path):
    """Edits as files: a weight edit and an activation addition saved, loaded and applied
    (``pl.apply_edit``) give the tokens of ``steered_model`` and of ``add=``."""
    edit_file = pytest.importorskip("powerlens._src.steering.edit_file")
    from powerlens._src.steering.effects import steered_model
    model, prompts = case["model"], random_prompts(7)
    dO = _delta(model, 8.0).astype(np.float32)
    v = (3.0 / np.sqrt(model.layers.config.d_model) * np.random.default_rng(4).normal(
        size=model.layers.config.d_model)).astype(np.float32)
    identity = edit_file.model_identity(model, 1)
    for kind, arrays, want in (
            ("delta_O", {"delta_O": dO}, pl.generate(steered_model(model, dO, layer=1), prompts, max_new_tokens=NEW)),
            ("activation", {"vector": v}, pl.generate(model, prompts, max_new_tokens=NEW, add=v, add_layer=1))):
        path = str(tmp_path / f"{kind}.npz")
        edit_file.save_edit(path, edit_file.Edit(kind=kind, layer=1, arrays=arrays, model=identity))
        assert pl.generate(edit_file.apply_edit(model, path), prompts, max_new_tokens=NEW).new_ids == want.new_ids
        assert want.new_ids != pl.generate(model, prompts, max_new_tokens=NEW).new_ids


# ----------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_sampling_is_reproducible_and_top_k_1_is_greedy(case):
    model, prompts = case["model"], random_prompts()
    key = jax.random.key(11)
    a = pl.generate(model, prompts, max_new_tokens=NEW, key=key, temperature=2.0)
    assert a.new_ids == pl.generate(model, prompts, max_new_tokens=NEW, key=jax.random.key(11), temperature=2.0).new_ids
    assert a.new_ids != pl.generate(model, prompts, max_new_tokens=NEW, key=jax.random.key(12), temperature=2.0).new_ids
    # the old-style raw key works too
    raw = pl.generate(model, prompts, max_new_tokens=NEW, key=jax.random.PRNGKey(11), temperature=2.0)
    assert raw.new_ids == pl.generate(model, prompts, max_new_tokens=NEW, key=jax.random.PRNGKey(11),
                                      temperature=2.0).new_ids
    greedy = pl.generate(model, prompts, max_new_tokens=NEW).new_ids
    assert pl.generate(model, prompts, max_new_tokens=NEW, key=key, top_k=1).new_ids == greedy
    assert pl.generate(model, prompts, max_new_tokens=NEW, key=key, top_k=1, temperature=5.0).new_ids == greedy
    # row 0 of a batch samples what its prompt samples alone, with the same key
    assert pl.generate(model, prompts[:1], max_new_tokens=NEW, key=key, temperature=2.0).new_ids[0] == a.new_ids[0]


def _expected(z, temperature, top_k, top_p):
    """softmax(z / T) restricted to the top_k largest, then to the smallest set of most
    probable tokens whose mass reaches top_p, renormalised: float64, by sorting."""
    z = np.asarray(z, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    keep = np.zeros(z.shape, bool)
    keep[order[: top_k or len(z)]] = True
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p is not None:
        ps = p[order]
        before = np.cumsum(ps) - ps
        nucleus = np.zeros(z.shape, bool)
        nucleus[order[before < top_p]] = True
        p = np.where(nucleus & keep, p, 0.0)
        p /= p.sum()
    return p


@pytest.mark.parametrize("case", ["llama"], indirect=True)
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.5, None, None), (1.5, 6, None), (0.8, None, 0.8),
                                                       (2.0, 8, 0.7)])
def test_first_token_frequencies_match_the_restricted_softmax(case, temperature, top_k, top_p):
    model = case["model"]
    prompt = random_prompts()[1]
    x0, valid = pl.embed_ids(model, np.asarray([prompt]))
    z = np.asarray(pl.logits(model, pl.run_states(model, x0, valid)[-1][0, -1]), np.float64)   # the uncached forward
    p = _expected(z, temperature, top_k, top_p)
    kept = int((p > 0).sum())
    assert 3 <= kept and p.max() < 0.8, (kept, p.max())          # a distribution worth testing
    N = 4000
    out = pl.generate(model, [prompt] * N, max_new_tokens=1, key=jax.random.key(3), temperature=temperature,
                      top_k=top_k, top_p=top_p).new_ids
    counts = np.bincount([r[0] for r in out], minlength=len(p))
    assert counts[p == 0].sum() == 0                               # nothing outside the top-k / nucleus
    sd = np.sqrt(N * p * (1 - p))
    assert np.all(np.abs(counts - N * p) <= 4.5 * sd + 1e-9), np.c_[counts, N * p][p > 0]


# ----------------------------------------------------------------------------- progress and options

@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_progress_bar_on_stderr_same_tokens(case, capsys, monkeypatch):
    from powerlens._src.models import generate as G
    monkeypatch.setattr(G, "PROGRESS_STEPS", 4)
    model, prompts = case["model"], random_prompts()
    want = pl.generate(model, prompts, max_new_tokens=NEW).new_ids
    capsys.readouterr()
    assert pl.generate(model, prompts, max_new_tokens=NEW, progress=True).new_ids == want
    err = capsys.readouterr().err
    assert "generate" in err and f"{NEW}/{NEW}" in err


@pytest.mark.parametrize("case", ["llama"], indirect=True)
def test_bad_sampling_and_addition_options(case):
    model, prompts = case["model"], random_prompts()
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"top_k, top_p shape sampling, which needs a PRNG key"):
        pl.generate(model, prompts, top_k=3, top_p=0.5)
    with pytest.raises(ValueError, match=r"temperature shape sampling"):
        pl.generate(model, prompts, temperature=0.5)
    for bad in (0, 1, np.zeros(3, np.uint32), "seed"):
        with pytest.raises(ValueError, match=r"key must be one JAX PRNG key"):
            pl.generate(model, prompts, key=bad)
    for bad in (0, -1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match=r"temperature must be a number > 0"):
            pl.generate(model, prompts, key=key, temperature=bad)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=r"top_k must be an integer >= 1"):
            pl.generate(model, prompts, key=key, top_k=bad)
    for bad in (0, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\]"):
            pl.generate(model, prompts, key=key, top_p=bad)
    d = model.layers.config.d_model
    with pytest.raises(ValueError, match=rf"add must be a real vector of shape \({d},\)"):
        pl.generate(model, prompts, add=np.ones(d + 1))
    with pytest.raises(ValueError, match=r"add contains non-finite values"):
        pl.generate(model, prompts, add=np.full(d, np.nan))
    with pytest.raises(ValueError, match=r"add_layer must be an integer in \[-3, 3\)"):
        pl.generate(model, prompts, add=np.ones(d), add_layer=3)
    with pytest.raises(ValueError, match=r"unroll must be True, False or None, got 1"):
        pl.generate(model, prompts, unroll=1)


def test_benchmark_script_tiny(tmp_path):
    """benchmarks/generate.py on a tiny random Llama: both sides emit the same tokens, the times
    are positive, and a --doc file holds the table and what was printed."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import generate as bench
    doc = tmp_path / "generate.md"
    out = bench.main(["--tiny", "--new", "6", "--prompt", "5", "--repeat", "1", "--doc", str(doc)])
    assert out["same"] and out["ratio"] > 0 and all(t > 0 for v in out["times"].values() for t in v)
    text = doc.read_text()
    assert "| powerlens |" in text and "| transformers |" in text and "same tokens: True" in text


# ----------------------------------------------------------------------------- SmolLM2

@pytest.mark.slow
def test_smollm2_64_tokens_match_transformers(smol_pair):
    model, ref_model = smol_pair
    out = pl.generate(model, SMOL_PROMPTS, max_new_tokens=64)
    ref, margin = hf_greedy(ref_model, out.prompt_ids, new=64)
    assert margin >= MARGIN, margin
    assert out.new_ids == ref
