"""Layers built from parts: Attention, Norms and an optional FFN.

* Each converter fills the parts its family has (written here from each architecture:
  biases, norms with or without biases, a gated FFN, q/k norms, sandwich norms, per-layer RoPE
  bases), ``ffn`` None where the family or the load has no FFN (``parts="attention"``, a
  synthetic system, a weights file).
* Reading an array by its flat name is reading it from its part; ``replace`` by flat name
  changes that part alone (and creates an FFN on layers without one).
* The parts' own sharding rules give, for every field, the PartitionSpec the old table
  (``MODEL_SPLIT``, one row per flat field, written out below by hand) gave, on model axes of
  1, 2, 4 and 8 devices (counts that do not divide leave a field replicated).
* ``pl.save_weights_npz`` is the inverse of ``--weights`` (``load_weights_npz``), and refuses
  what the format cannot hold, by name.
* ``rule="full"`` on layers without an FFN is refused (the dispatch is ``layers.ffn is None``).
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import powerlens as pl
from powerlens._src.dynamics import execution
from powerlens._src.dynamics.params import FIELDS, MODEL_SPLIT, LayerConfig, make_layers
from powerlens._src.dynamics.parts import FFN, PARTS, Attention, Norms
from powerlens._src.models.npz import load_weights_npz, save_weights_npz

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_tiny as E  # noqa: E402
import hf_tiny_decoders as T  # noqa: E402

QKV = {"W_q", "W_k", "W_v", "W_o", "scale", "window"}
QKV_BIASES = {"b_q", "b_k", "b_v", "b_o"}
LN = {"norm_scale", "norm_bias", "ffn_norm_scale", "ffn_norm_bias"}
RMS = {"norm_scale", "ffn_norm_scale"}
FFN_BIASED = {"W_in", "b_in", "W_out", "b_out"}
GLU = {"W_in", "W_gate", "W_out"}
QK_NORMS = {"q_norm_scale", "k_norm_scale"}
SANDWICH = {"post_attn_norm_scale", "post_ffn_norm_scale"}

# family -> (builder, attention arrays, norm arrays, FFN arrays), from each architecture
EXPECTED = {
    "bert": ("enc", QKV | QKV_BIASES, LN, FFN_BIASED),
    "roberta": ("enc", QKV | QKV_BIASES, LN, FFN_BIASED),
    "distilbert": ("enc", QKV | QKV_BIASES, LN, FFN_BIASED),
    "albert": ("enc", QKV | QKV_BIASES, LN, FFN_BIASED),
    "gpt2": ("dec", QKV | QKV_BIASES, LN, FFN_BIASED),
    "gpt_neo": ("dec", QKV | {"b_o"}, LN, FFN_BIASED),               # q/k/v without bias
    "llama": ("dec", QKV, RMS, GLU),
    "mistral": ("dec", QKV, RMS, GLU),
    "qwen2": ("dec", QKV | {"b_q", "b_k", "b_v"}, RMS, GLU),
    "qwen3": ("dec", QKV | QK_NORMS, RMS, GLU),
    "gemma": ("dec", QKV, RMS, GLU),
    "gemma2": ("dec", QKV, RMS | SANDWICH, GLU),
    "gemma3_text": ("dec", QKV | QK_NORMS | {"rope_base"}, RMS | SANDWICH, GLU),
    "gpt_neox": ("dec", QKV | QKV_BIASES, LN, FFN_BIASED),
    "opt": ("dec", QKV | QKV_BIASES, LN, FFN_BIASED),
    "phi": ("dec", QKV | QKV_BIASES, {"norm_scale", "norm_bias"}, FFN_BIASED),   # one LN, parallel block
    "phi3": ("dec", QKV, RMS, GLU),
}


@pytest.fixture(scope="module", params=sorted(EXPECTED))
def converted(request, tmp_path_factory):
    family = request.param
    folder = str(tmp_path_factory.mktemp(family))
    (E.build if EXPECTED[family][0] == "enc" else T.build)(family, folder, seed=1)
    return family, folder, pl.load(folder)


def _present(part) -> set:
    return set() if part is None else set(part.arrays())


def test_each_converter_fills_the_parts_of_its_family(converted):
    family, folder, model = converted
    _, attn, norms, ffn = EXPECTED[family]
    layers = model.layers
    assert isinstance(layers.attn, Attention) and isinstance(layers.norms, Norms) and isinstance(layers.ffn, FFN)
    assert (_present(layers.attn), _present(layers.norms), _present(layers.ffn)) == (attn, norms, ffn)
    U = layers.n_unique
    assert all(np.shape(a)[0] == U for a in layers.arrays().values())
    # without the FFN: ffn is None, the rest as before
    light = pl.load(folder, parts="attention").layers
    assert light.ffn is None and light.W_in is None and _present(light.attn) == attn
    assert _present(light.norms) <= norms
    # spectrum only: W_v and W_o (the attention part without W_q, W_k)
    spec = pl.load(folder, parts="spectrum").layers
    assert spec.ffn is None and spec.W_q is None and {"W_v", "W_o"} <= _present(spec.attn)


def test_flat_names_read_and_replace_the_parts(converted):
    family, _, model = converted
    layers = model.layers
    assert set(FIELDS) == {n for cls in PARTS.values() for n in cls.names()} and len(FIELDS) == 26
    for name in FIELDS:
        part = {"attn": layers.attn, "norms": layers.norms, "ffn": layers.ffn}[
            next(p for p, cls in PARTS.items() if name in cls.names())]
        assert getattr(layers, name) is getattr(part, name)
    new = jnp.zeros_like(layers.W_o)
    changed = layers.replace(W_o=new, norm_scale=None)
    assert changed.attn.W_o is new and changed.W_o is new and changed.norms.norm_scale is None
    assert changed.attn.W_v is layers.attn.W_v and changed.ffn is layers.ffn and changed.config is layers.config
    assert layers.W_o is not new                                              # the original is untouched
    # an FFN array on layers without an FFN creates the part; None on them changes nothing
    bare = layers.replace(ffn=None)
    assert bare.ffn is None and bare.replace(W_in=None).ffn is None
    grown = bare.replace(W_in=layers.W_in, W_out=layers.W_out)
    assert grown.ffn.W_in is layers.W_in and grown.ffn.b_in is None
    with pytest.raises(TypeError, match="unknown field"):
        layers.replace(W_x=1)
    # a pytree of the parts: leaves are the arrays present, the structure keeps the config
    leaves, tree = jax.tree_util.tree_flatten(layers)
    assert len(leaves) == len(layers.arrays())
    assert jax.tree_util.tree_unflatten(tree, leaves).config == layers.config


def test_synthetic_and_weights_file_systems_have_no_ffn_and_no_norms(tmp_path):
    sys_ = pl.synthetic_system([1.5, 0.3], heads=2, d=4, steps=3)
    assert sys_.ffn is None and sys_.norms.arrays() == {} and set(sys_.attn.arrays()) == QKV
    save_weights_npz(str(tmp_path / "s.npz"), sys_)
    back = load_weights_npz(str(tmp_path / "s.npz"))
    assert back.ffn is None and back.norms.arrays() == {}
    x = np.ones((3, 4), np.float32) / 2
    with pytest.raises(ValueError, match=r"rule 'full' needs FFN parameters"):
        pl.layer_step(sys_.layer(0), x, np.ones(3, bool), rule="full")


def test_make_layers_from_parts_equals_make_layers_from_flat_arrays():
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    cfg = LayerConfig(d_model=8, n_heads=2, d_head=4, norm="layernorm", norm_placement="pre", ffn_activation="gelu")
    flat = dict(W_v=r(2, 2, 4, 8), W_o=r(2, 8, 8), W_q=r(2, 2, 4, 8), W_k=r(2, 2, 4, 8), b_o=r(2, 8),
                norm_scale=r(2, 8), W_in=r(2, 6, 8), W_out=r(2, 8, 6), b_out=r(2, 8))
    a = make_layers(config=cfg, **flat)
    rest = dict(flat)
    b = make_layers(attn=Attention.take(rest), norms=Norms.take(rest), ffn=FFN.take(rest), config=cfg)
    assert rest == {}
    assert a.arrays().keys() == b.arrays().keys()
    for k in a.arrays():
        np.testing.assert_array_equal(np.asarray(a.arrays()[k]), np.asarray(b.arrays()[k]))
    with pytest.raises(ValueError, match="not both"):
        make_layers(attn=b.attn, W_in=flat["W_in"], config=cfg)
    with pytest.raises(ValueError, match="the FFN needs W_in and W_out; W_out is missing"):
        make_layers(config=cfg, **{k: v for k, v in flat.items() if k not in ("W_out", "b_out")})
    with pytest.raises(TypeError, match=r"unknown array\(s\) \['W_x'\]"):
        make_layers(config=cfg, W_x=r(2, 8), **flat)


# --------------------------------------------------------------------------- sharding rules

# The table the flat Layers had (one row per field): (axis, what it counts) split over ``model``
OLD_MODEL_SPLIT = {
    "W_q": (1, "n_heads"), "b_q": (1, "n_heads"), "W_o": (2, "n_heads"),
    "W_k": (1, "n_kv_heads"), "b_k": (1, "n_kv_heads"), "W_v": (1, "n_kv_heads"), "b_v": (1, "n_kv_heads"),
    "W_in": (1, "ffn"), "b_in": (1, "ffn"), "W_gate": (1, "ffn"), "W_out": (2, "ffn"),
    "scale": None, "window": None, "b_o": None, "norm_scale": None, "norm_bias": None, "ffn_norm_scale": None,
    "ffn_norm_bias": None, "b_out": None, "q_norm_scale": None, "k_norm_scale": None, "q_norm_bias": None,
    "k_norm_bias": None, "post_attn_norm_scale": None, "post_ffn_norm_scale": None, "rope_base": None,
}


def _every_field_layers():
    """U=2 layers with all 26 arrays: H=4 query heads, G=2 key/value heads, e=2, d=8, f=12."""
    rng = np.random.default_rng(3)
    r = lambda *s: (0.3 * rng.standard_normal(s)).astype(np.float32)
    U, H, G, e, d, f = 2, 4, 2, 2, 8, 12
    cfg = LayerConfig(d_model=d, n_heads=H, n_kv_heads=G, d_head=e, norm="layernorm", norm_placement="pre",
                      rope_theta=100.0, ffn_activation="silu_glu", causal=True)
    return make_layers(
        W_v=r(U, G, e, d), W_o=r(U, d, H * e), W_q=r(U, H, e, d), W_k=r(U, G, e, d), b_q=r(U, H, e),
        b_k=r(U, G, e), b_v=r(U, G, e), b_o=r(U, d), norm_scale=r(U, d), norm_bias=r(U, d),
        ffn_norm_scale=r(U, d), ffn_norm_bias=r(U, d), W_in=r(U, f, d), b_in=r(U, f), W_gate=r(U, f, d),
        W_out=r(U, d, f), b_out=r(U, d), q_norm_scale=r(U, e), k_norm_scale=r(U, e), q_norm_bias=r(U, e),
        k_norm_bias=r(U, e), post_attn_norm_scale=r(U, d), post_ffn_norm_scale=r(U, d),
        rope_base=np.array([10.0, 1000.0], np.float32), config=cfg)


class _FakeMesh:
    """A mesh of ``size`` devices on the ``model`` axis, for the placement rules alone."""
    axis_names = (execution.DATA, execution.MODEL)

    def __init__(self, size):
        self.shape = {execution.DATA: 1, execution.MODEL: size}


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_the_parts_rules_give_the_old_tables_partition_specs(size, monkeypatch):
    from jax.sharding import PartitionSpec as P
    from powerlens._src.models import shard
    monkeypatch.setattr(execution, "axis_sharding",
                        lambda mesh, ndim, axis=None, name=execution.MODEL: P(*[name if i == axis else None
                                                                             for i in range(ndim)]))
    layers = _every_field_layers()
    cfg = layers.config
    assert len(layers.arrays()) == 26
    placed = shard.placements(layers, _FakeMesh(size))
    for name in FIELDS:                           # the old rule, applied as the old shard.py did
        a, rule = getattr(layers, name), OLD_MODEL_SPLIT[name]
        axis = None
        if rule is not None:
            ax, what = rule
            count = a.shape[ax] if what == "ffn" else getattr(cfg, what)
            axis = ax if count % size == 0 else None
        want = P(*["model" if i == axis else None for i in range(a.ndim)])
        assert getattr(placed, name) == want, (name, size)
    assert MODEL_SPLIT == OLD_MODEL_SPLIT
    # by hand: 2 devices split everything splittable; 4 replicate the 2 KV heads; 8 replicate the
    # 4 query heads and the FFN width 12, so nothing is split
    split = {n for n in FIELDS if "model" in tuple(getattr(placed, n))}
    heads, kv, ffn = {"W_q", "b_q", "W_o"}, {"W_k", "W_v", "b_k", "b_v"}, {"W_in", "b_in", "W_gate", "W_out"}
    assert split == {1: heads | kv | ffn, 2: heads | kv | ffn, 4: heads | ffn, 8: set()}[size]
    assert placed.W_o == P(None, None, "model") if size <= 4 else placed.W_o == P(None, None, None)


def test_edit_hash_reads_the_flat_fields_in_their_old_order():
    """The sha256 of a layer (edit files) is over the flat names in the old field order, so
    an edit file written before the parts still matches its model."""
    from powerlens._src.steering.edit_file import layer_sha256
    layers = _every_field_layers()
    one = layers.layer(1)
    h = hashlib.sha256()
    for name in FIELDS:
        a = np.ascontiguousarray(np.asarray(getattr(one, name)))
        h.update(f".{name}|{a.dtype.name}|{a.shape}|".encode())
        h.update(a.tobytes())
    assert layer_sha256(layers, 1) == h.hexdigest()
    assert FIELDS[:6] == ("W_q", "W_k", "W_v", "W_o", "scale", "window") and FIELDS[-1] == "rope_base"


# --------------------------------------------------------------------------- weights files

def test_save_weights_npz_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)
    cfg = LayerConfig(d_model=6, n_heads=3, d_head=2, causal=True, norm="l2")
    layers = make_layers(attn=Attention(W_v=r(2, 3, 2, 6), W_o=r(2, 6, 6), W_q=r(2, 3, 2, 6), W_k=r(2, 3, 2, 6),
                                        b_q=r(2, 3, 2), b_v=r(2, 3, 2), b_o=r(2, 6),
                                        scale=np.array([0.5, 0.25]), window=np.array([0, 3])), config=cfg)
    path = pl.save_weights_npz(str(tmp_path / "w.npz"), layers)
    assert path == str(tmp_path / "w.npz")
    back = pl.load_weights_npz(path)
    assert back.config.causal and back.ffn is None and back.norms.arrays() == {}
    assert back.arrays().keys() == layers.arrays().keys()
    for k, a in layers.arrays().items():
        np.testing.assert_array_equal(np.asarray(back.arrays()[k]), np.asarray(a))
    assert back.window.tolist() == [0, 3] and back.scale.tolist() == [0.5, 0.25]
    # the same dynamics: the paper rule's final states agree exactly
    x0 = pl.sphere_tokens(np.random.default_rng(1), 5, 6)
    f = lambda l: np.asarray(pl.run(l, x0, None, observers={"x": pl.final()})["x"])
    np.testing.assert_array_equal(f(back), f(layers))
    # bf16 weights are written widened to float32 (exactly) and read back
    half = layers.replace(**{k: a.astype(jnp.bfloat16) for k, a in layers.attn.arrays().items()
                             if jnp.issubdtype(a.dtype, jnp.floating)})
    back16 = pl.load_weights_npz(pl.save_weights_npz(str(tmp_path / "h.npz"), half))
    np.testing.assert_array_equal(np.asarray(back16.W_o), np.asarray(half.W_o.astype(jnp.float32)))


def test_save_weights_npz_refuses_what_the_format_cannot_hold(tmp_path):
    folder = str(tmp_path / "llama")
    T.build("llama", folder, seed=2)
    layers = pl.load(folder).layers
    with pytest.raises(ValueError) as info:
        pl.save_weights_npz(str(tmp_path / "l.npz"), layers)
    msg = str(info.value)
    assert "\n" not in msg and "norm_scale" in msg and "the FFN (W_gate, W_in, W_out)" in msg
    assert "grouped-query attention (1 key/value heads for 3 query heads)" in msg and "RoPE" in msg
    assert not (tmp_path / "l.npz").exists()
    # a BERT's attention alone (norms and FFN left out explicitly) is a weights file
    enc = str(tmp_path / "bert")
    E.build("bert", enc, seed=2)
    bert = pl.load(enc).layers
    attn_only = bert.replace(norms=Norms(), ffn=None)
    back = pl.load_weights_npz(pl.save_weights_npz(str(tmp_path / "b.npz"), attn_only))
    for k, a in attn_only.arrays().items():
        np.testing.assert_array_equal(np.asarray(back.arrays()[k]), np.asarray(a))
