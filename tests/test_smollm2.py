"""GGUF Llama: SmolLM2-135M-Instruct (Q4_1) end to end, a tiny GGUF written from a tiny HF
Llama, and bad GGUF files.

* ``load("smollm2")``: 30 layers, d = 576, 9 query / 3 KV heads, finite spectra of every F_t.
* Rule ``full`` on "The capital of France is" (GGUF tokenizer) puts " Paris" in the top 5,
  and its logits match an independent NumPy forward pass (float64, plain loops over layers)
  that dequantises with ``gguf`` itself and keeps llama.cpp's permuted W_q/W_k rows with
  llama.cpp's interleaved RoPE (so the un-permutation of the loader is checked, not reused).
* A 2-layer HF Llama written to GGUF the way llama.cpp's converter does (Q/K rows permuted)
  loads back to hidden states equal to transformers' to <= 1e-4.
* Truncated / corrupt / NaN / incomplete GGUF files give a CheckpointError naming the file.
"""
from __future__ import annotations


import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from powerlens._src.analysis.spectra import layer_spectra  # noqa: E402
from powerlens._src.dynamics.params import layer_matrices  # noqa: E402
from powerlens._src.models import CheckpointError, embed, embed_ids, hidden_states, load, logits, resolve, run_states  # noqa: E402
from powerlens._src.models.embed import tokenizer  # noqa: E402
from powerlens._src.models.gguf_llama import GGUFFile, load_gguf, unpermute  # noqa: E402

PROMPT = "The capital of France is"


def _smollm2_path():
    try:
        return resolve("smollm2")
    except CheckpointError as exc:
        pytest.skip(f"SmolLM2 GGUF not installed: {exc}")


@pytest.fixture(scope="module")
def smol():
    path = _smollm2_path()
    model = load("smollm2")
    x0, valid = embed(model, [PROMPT])
    h = run_states(model, x0, valid)[-1]
    return dict(path=path, model=model, x0=x0, valid=valid, logits=np.asarray(logits(model, h))[0])


def test_smollm2_structure(smol):
    m = smol["model"]
    cfg = m.config
    assert m.layers.n_unique == 30
    assert (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head) == (576, 9, 3, 64)
    assert cfg.norm == "rmsnorm" and cfg.norm_placement == "pre" and cfg.causal
    assert cfg.rope_theta == 100000.0 and cfg.ffn_activation == "silu_glu"
    assert m.layers.W_in.shape == (30, 1536, 576) and m.embeddings["word"].shape == (49152, 576)
    assert m.lm_head is None                       # tied: the file has no output.weight
    assert m.info.max_positions == 8192 and m.info.family == "llama"


def test_smollm2_spectra_finite(smol):
    """All 30 F_t are finite with finite spectra; layer_spectra agrees with a reduced eigenproblem.

    With grouped-query attention F = sum_g O'_g V_g = O' V_G, O' (d, G e), V_G (G e, d), so
    the non-zero eigenvalues of F (d x d, rank <= G e = 192) are those of V_G O' (192 x 192),
    and F has d - G e = 384 zero eigenvalues. This is computed for every layer; the full
    ``layer_spectra`` (Schur-ordered subspaces, O(d^3) per ordering) runs on three layers to
    keep the test fast, and must agree with it.
    """
    m = smol["model"]
    cfg = m.config
    d, G, e, grp = cfg.d_model, cfg.n_kv_heads, cfg.d_head, cfg.kv_group
    F = np.asarray(layer_matrices(m.layers), np.float64)
    assert F.shape == (30, d, d) and np.isfinite(F).all()
    Wo = np.asarray(m.layers.W_o, np.float64).reshape(30, d, G, grp, e).sum(3).reshape(30, d, G * e)
    Vg = np.asarray(m.layers.W_v, np.float64).reshape(30, G * e, d)
    red = np.linalg.eigvals(Vg @ Wo)                                    # (30, 192)
    assert np.isfinite(red).all()
    for layer, s in zip((0, 15, 29), layer_spectra(F[[0, 15, 29]])):
        ev = red[layer]
        for o in (s.shifted, s.plain):
            assert np.isfinite(o.eigenvalues).all() and np.isfinite(o.basis).all()
            assert o.basis.shape == (d, o.dim) and o.dim >= 1
            np.testing.assert_allclose(o.basis.T @ o.basis, np.eye(o.dim), atol=1e-8)
        np.testing.assert_allclose(s.plain.mu1, np.abs(ev).max(), rtol=1e-6)
        np.testing.assert_allclose(s.shifted.mu1, max(1.0, np.abs(1 + ev).max()), rtol=1e-6)
        # the 20 largest |lambda| of F are those of the reduced problem
        np.testing.assert_allclose(np.abs(s.plain.eigenvalues[:20]), np.sort(np.abs(ev))[::-1][:20], rtol=1e-6)


def test_smollm2_predicts_paris(smol):
    tok = tokenizer(smol["model"])
    ids = tok(PROMPT)["input_ids"]
    assert tok.decode(ids) == PROMPT
    top5 = [tok.decode([int(t)]) for t in np.argsort(-smol["logits"][-1])[:5]]
    assert " Paris" in top5, top5


# ----------------------------------------------------------------------------- NumPy reference
def _rope_interleaved(x, theta):
    """llama.cpp's RoPE (mode 0): pairs (2i, 2i+1) of each head rotated by pos * theta^(-2i/e).

    x: (n, heads, e)."""
    n, _, e = x.shape
    ang = np.arange(n)[:, None] * theta ** (-np.arange(0, e, 2) / e)[None, :]     # (n, e/2)
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * c - b * s
    out[..., 1::2] = a * s + b * c
    return out


def numpy_forward(path, ids):
    """Straightforward float64 forward of a llama GGUF: logits (n, V) for one prompt."""
    r = GGUFFile(path).reader                      # header parsing only; dequantisation below
    meta = lambda k: r.get_field(k).contents()
    T = {t.name: t for t in r.tensors}

    def W(name):
        t = T[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)

    L, H, G = meta("llama.block_count"), meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
    eps, theta = meta("llama.attention.layer_norm_rms_epsilon"), meta("llama.rope.freq_base")
    rms = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w
    E = W("token_embd.weight")
    x = E[np.asarray(ids)]
    n, d = x.shape
    e = d // H
    causal = np.tril(np.ones((n, n), bool))
    for i in range(L):
        b = f"blk.{i}."
        h = rms(x, W(b + "attn_norm.weight"))
        q = _rope_interleaved((h @ W(b + "attn_q.weight").T).reshape(n, H, e), theta)
        k = _rope_interleaved((h @ W(b + "attn_k.weight").T).reshape(n, G, e), theta)
        v = (h @ W(b + "attn_v.weight").T).reshape(n, G, e)
        heads = []
        for hh in range(H):
            g = hh // (H // G)
            s = q[:, hh] @ k[:, g].T / np.sqrt(e)
            s = np.where(causal, s, -np.inf)
            a = np.exp(s - s.max(-1, keepdims=True))
            heads.append((a / a.sum(-1, keepdims=True)) @ v[:, g])
        x = x + np.concatenate(heads, -1) @ W(b + "attn_output.weight").T
        h = rms(x, W(b + "ffn_norm.weight"))
        gate = h @ W(b + "ffn_gate.weight").T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ W(b + "ffn_up.weight").T)) @ W(b + "ffn_down.weight").T
    x = rms(x, W("output_norm.weight"))
    head = W("output.weight") if "output.weight" in T else E
    return x @ head.T


def test_smollm2_logits_match_numpy_reference(smol):
    ids = tokenizer(smol["model"])(PROMPT)["input_ids"]
    ref = numpy_forward(smol["path"], ids)
    got = smol["logits"]
    assert got.shape == ref.shape
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel <= 1e-3, rel
    assert np.argmax(got[-1]) == np.argmax(ref[-1])


# ----------------------------------------------------------------------------- tiny GGUF vs torch
def _permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py ``permute`` (HF rotate_half rows -> GGML interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).normal(size=(3 * 8, 5))
    np.testing.assert_array_equal(unpermute(_permute(w, 3), 3), w)
    assert not np.array_equal(_permute(w, 3), w)


def write_gguf(path, sd, cfg, *, drop=(), nan=None, bad_shape=None):
    """Write an HF Llama state dict (numpy, float32) as a llama GGUF, like llama.cpp does."""
    H, G, L = cfg["heads"], cfg["kv"], cfg["layers"]
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(L)
    w.add_context_length(cfg["ctx"])
    w.add_embedding_length(cfg["d"])
    w.add_feed_forward_length(cfg["f"])
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_rope_freq_base(cfg["theta"])
    w.add_layer_norm_rms_eps(cfg["eps"])
    w.add_rope_dimension_count(cfg["d"] // H)
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if "lm_head.weight" in sd:
        tensors["output.weight"] = sd["lm_head.weight"]
    for i in range(L):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        tensors[b + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        tensors[b + "attn_q.weight"] = _permute(sd[p + "self_attn.q_proj.weight"], H)
        tensors[b + "attn_k.weight"] = _permute(sd[p + "self_attn.k_proj.weight"], G)
        tensors[b + "attn_v.weight"] = sd[p + "self_attn.v_proj.weight"]
        tensors[b + "attn_output.weight"] = sd[p + "self_attn.o_proj.weight"]
        tensors[b + "ffn_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        tensors[b + "ffn_gate.weight"] = sd[p + "mlp.gate_proj.weight"]
        tensors[b + "ffn_up.weight"] = sd[p + "mlp.up_proj.weight"]
        tensors[b + "ffn_down.weight"] = sd[p + "mlp.down_proj.weight"]
    for name, arr in tensors.items():
        if name in drop:
            continue
        arr = np.ascontiguousarray(arr, np.float32)
        if name == nan:
            arr = arr.copy()
            arr.flat[0] = np.nan
        if name == bad_shape:
            arr = np.ascontiguousarray(arr[:-1])
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    torch = pytest.importorskip("torch")
    import hf_tiny_decoders as T
    folder = tmp_path_factory.mktemp("tiny_llama_hf")
    hf = T.build("llama", str(folder), num_hidden_layers=2, rope_theta=300.0)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    c = hf.config
    cfg = dict(heads=c.num_attention_heads, kv=c.num_key_value_heads, layers=2, d=c.hidden_size,
               f=c.intermediate_size, theta=300.0, eps=c.rms_norm_eps, ctx=c.max_position_embeddings)
    return dict(hf=hf, sd=sd, cfg=cfg, dir=tmp_path_factory.mktemp("tiny_gguf"), T=T, torch=torch)


def test_tiny_gguf_matches_transformers(tiny_llama):
    t = tiny_llama
    path = write_gguf(str(t["dir"] / "tiny.gguf"), t["sd"], t["cfg"])
    model = load(path)
    assert model.config.n_kv_heads == 1 and model.config.rope_theta == 300.0
    ids, mask = t["T"].batch()
    x0, valid = embed_ids(model, ids, mask.astype(bool))
    out = hidden_states(model, x0, valid)
    hs = np.asarray(out.hf, np.float64)                     # transformers' tuple, last state normed
    ref = t["T"].hf_hidden_states(t["hf"], ids, mask)
    v = mask.astype(bool)
    errs = [float(np.abs(hs[k][v] - ref[k][v]).max()) for k in range(len(ref))]
    assert max(errs) <= 1e-4, errs
    lg = np.asarray(logits(model, out[-1]))
    ref_lg = t["T"].hf_logits(t["hf"], ids, mask)
    assert np.abs(lg[v] - ref_lg[v]).max() <= 1e-4 * max(1.0, np.abs(ref_lg).max())
    # the loader undid the permutation: W_q is HF's q_proj again
    wq = np.asarray(model.layers.W_q[0]).reshape(-1, model.config.d_model)
    np.testing.assert_allclose(wq, t["sd"]["model.layers.0.self_attn.q_proj.weight"], atol=1e-6)


@pytest.mark.parametrize("kw,needle", [
    (dict(drop=("blk.1.ffn_up.weight",)), "'blk.1.ffn_up.weight' is missing"),
    (dict(nan="blk.0.attn_v.weight"), "'blk.0.attn_v.weight' contains non-finite"),
    (dict(bad_shape="blk.0.ffn_down.weight"), "'blk.0.ffn_down.weight' has shape"),
])
def test_bad_tiny_gguf_names_tensor_and_file(tiny_llama, kw, needle):
    path = write_gguf(str(tiny_llama["dir"] / f"bad_{sorted(kw)[0]}.gguf"), tiny_llama["sd"], tiny_llama["cfg"], **kw)
    with pytest.raises(CheckpointError) as err:
        load_gguf(path)
    assert needle in str(err.value) and path in str(err.value)


@pytest.mark.parametrize("n_bytes", [1 << 20, 60 << 20])
def test_truncated_gguf_names_file(tmp_path, n_bytes):
    src = _smollm2_path()
    dst = str(tmp_path / "truncated.gguf")
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read(n_bytes))
    with pytest.raises(CheckpointError, match="truncated or corrupt") as err:
        load(dst)
    assert dst in str(err.value)


def test_corrupt_gguf_header_names_file(tmp_path):
    src = _smollm2_path()
    dst = str(tmp_path / "corrupt.gguf")
    with open(src, "rb") as f:
        head = bytearray(f.read(1 << 20))
    head[:4] = b"XXXX"
    with open(dst, "wb") as g:
        g.write(head)
    with pytest.raises(CheckpointError, match="not a readable GGUF") as err:
        load(dst)
    assert dst in str(err.value) and "magic" in str(err.value)
    with pytest.raises(CheckpointError, match="not found"):
        load_gguf(str(tmp_path / "absent.gguf"))
