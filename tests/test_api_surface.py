"""The public API without traps, checked against transformers and known answers.

* ``pl.logits(model, pl.hidden_states(model, x0, valid)[-1])`` is transformers' logits on tiny
  random GPT-2, Llama and Gemma 2 decoders (each applies a final norm, which transformers
  also records in its last hidden state: the call used to apply it twice), and on SmolLM2 it
  puts " Paris" first after "The capital of France is".
* ``pl.decode`` and ``pl.top_tokens`` against transformers' own tokenizer (a byte-level BPE
  trained here for a tiny Llama) and softmax, and on SmolLM2's GGUF tokenizer;
  ``decode(tokenize(text)) == text``.
* ``pl.trace``: states, per-head attention weights and logits against transformers'
  ``output_hidden_states`` / ``output_attentions`` / logits; its gamma_t and rho_t are those of
  ``pl.align`` (the twin of ``powerlens align``), labelled by reference.
* Layers are numbered from 0 in the align figure and JSON, the reproduce marks of Gemma 3's
  global layers and the spectrum figure; plots over steps say so.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_tiny_decoders as T  # noqa: E402
import powerlens as pl  # noqa: E402

TOL = 1e-4
TEXTS = ["The capital of France is", "Power iteration finds the top eigenvector, slowly."]
CORPUS = TEXTS + ["The cat sat on the mat.", "Paris is the capital and largest city of France.",
                  "Attention layers mix the tokens; the residual stream carries them.", "héllo wörld"] * 4


def _err(a, b, valid):
    """Max abs difference of a and b "[..., B, n, X]" at the valid "bool[B n]" positions."""
    return T.max_err(np.asarray(a, np.float64), np.asarray(b, np.float64), valid)


@pytest.fixture(scope="module", params=["gpt2", "llama", "gemma2"])
def decoder(request, tmp_path_factory):
    """A tiny random transformers decoder and powerlens's model loaded from its folder."""
    folder = str(tmp_path_factory.mktemp(request.param))
    hf = T.build(request.param, folder, seed=5)
    return dict(kind=request.param, hf=hf, model=pl.load(folder))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama whose folder has a byte-level BPE tokenizer.json trained here,
    the model's vocabulary the tokenizer's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    folder = tmp_path_factory.mktemp("tiny_llama_tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = tok.get_vocab_size()
    hf = T.build("llama", str(folder), seed=7, vocab_size=vocab, max_position_embeddings=64)
    tok.save(str(folder / "tokenizer.json"))
    ref_tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), clean_up_tokenization_spaces=False)
    return dict(hf=hf, model=pl.load(str(folder)), folder=str(folder), tok=ref_tok, vocab=vocab)


@pytest.fixture(scope="module")
def smol():
    try:
        return pl.load("smollm2")
    except Exception as exc:  # noqa: BLE001 - the GGUF package is part of the set-up; say why if absent
        pytest.skip(f"cannot load 'smollm2' here: {type(exc).__name__}: {exc}")


# ------------------------------------------------------------------ the obvious logits call

def test_obvious_logits_call_matches_transformers(decoder):
    model, hf = decoder["model"], decoder["hf"]
    ids, mask = T.batch()
    valid = mask.astype(bool)
    x0, jvalid = pl.embed_ids(model, ids, valid)
    hs = pl.hidden_states(model, x0, jvalid)
    ref = T.hf_logits(hf, ids, mask)
    tol = TOL * max(1.0, np.abs(ref).max())
    assert _err(pl.logits(model, hs[-1]), ref, valid) <= tol
    assert _err(pl.logits(model, hs), ref, valid) <= tol                       # the HiddenStates itself
    assert _err(pl.logits(model, pl.run_states(model, x0, jvalid)[-1]), ref, valid) <= tol
    assert _err(pl.logits(model, hs[-1][:, 2:3]), ref[:, 2:3], valid[:, 2:3]) <= tol   # a slice of positions
    # the last state is marked: hs.hf is transformers' tuple (final norm on its last entry),
    # hs[k] the residual stream; they differ by O(1) at the last entry only
    ref_hs = T.hf_hidden_states(hf, ids, mask)
    assert hs.final_norm_in_hf and len(hs) == len(ref_hs) == len(np.asarray(hs))
    assert _err(hs.hf, ref_hs, valid) <= TOL
    assert _err(hs.states[:-1], ref_hs[:-1], valid) <= TOL and _err(hs[-1], ref_hs[-1], valid) > 0.1
    assert _err(hs.normed, ref_hs[-1], valid) <= TOL


def test_logits_names_a_state_of_the_wrong_width(decoder):
    model = decoder["model"]
    d = model.config.d_model
    with pytest.raises(ValueError, match=f"width {d + 1}.*reads width {d}"):
        pl.logits(model, np.ones((1, 2, d + 1), np.float32))


# ------------------------------------------------------------------ decode and top_tokens

def test_decode_matches_transformers_and_round_trips(tiny):
    model, ref = tiny["model"], tiny["tok"]
    ids = pl.tokenize(model, TEXTS)
    assert ids == [ref(t)["input_ids"] for t in TEXTS]
    assert pl.decode(model, ids) == TEXTS                                      # several prompts
    assert pl.decode(model, ids[1]) == TEXTS[1] == ref.decode(ids[1])          # one prompt
    assert pl.decode(model, np.asarray(ids[0])) == TEXTS[0]
    assert pl.decode(model, ids[0][1]) == ref.decode([ids[0][1]])              # one token
    # a right-padded batch: the mask leaves the padding out
    n = max(map(len, ids))
    arr = np.array([r + [0] * (n - len(r)) for r in ids])
    mask = np.array([[j < len(r) for j in range(n)] for r in ids])
    assert pl.decode(model, arr, valid=mask) == TEXTS
    assert pl.decode(model, arr)[0] != TEXTS[0]                                # without it, padding is text


@pytest.mark.parametrize("bad,needle", [([[3, 10 ** 6]], "token id 1000000 is outside"), ([[-1]], "token id -1"),
                                        ([[1.5, 2.0]], "must be integers"), (np.zeros((1, 2, 2), int), "shape")])
def test_decode_names_bad_ids(tiny, bad, needle):
    with pytest.raises(ValueError, match=needle):
        pl.decode(tiny["model"], bad)


def test_top_tokens_match_transformers_softmax_and_tokenizer(tiny):
    model, hf, ref = tiny["model"], tiny["hf"], tiny["tok"]
    x0, valid = pl.embed(model, TEXTS[:1])
    lg = pl.logits(model, pl.hidden_states(model, x0, valid)[-1])            # (1, n, V)
    top = pl.top_tokens(model, lg[0, -1], k=5)
    with torch.no_grad():
        p = torch.softmax(hf(input_ids=torch.tensor(pl.tokenize(model, TEXTS[:1]))).logits[0, -1].double(), -1)
    want = torch.topk(p, 5)
    assert [t.id for t in top] == want.indices.tolist()
    np.testing.assert_allclose([t.prob for t in top], want.values.numpy(), rtol=1e-4, atol=1e-6)
    assert [t.text for t in top] == [ref.decode([i]) for i in want.indices.tolist()]
    assert top[0] == (top[0].id, top[0].text, top[0].prob) and top[0].prob >= top[-1].prob
    nested = pl.top_tokens(model, lg, k=2)                                     # float[B n V] -> B x n x k
    assert len(nested) == 1 and len(nested[0]) == lg.shape[1] and nested[0][-1] == top[:2]


@pytest.mark.parametrize("what,needle", [("k0", "k must be an integer in"), ("width", "expected float"),
                                         ("nan", "NaN")])
def test_top_tokens_names_bad_input(tiny, what, needle):
    model, V = tiny["model"], tiny["vocab"]
    z = np.zeros(V, np.float32)
    args = {"k0": (z, 0), "width": (z[:-1], 3), "nan": (np.full(V, np.nan, np.float32), 3)}[what]
    with pytest.raises(ValueError, match=needle):
        pl.top_tokens(model, *args)


def test_smollm2_obvious_call_decode_and_top_tokens(smol):
    from powerlens._src.steering.effects import next_token_stats
    x0, valid = pl.embed(smol, [TEXTS[0]])
    hs = pl.hidden_states(smol, x0, valid)
    lg = pl.logits(smol, hs[-1])
    top = pl.top_tokens(smol, lg[0, -1], k=3)
    assert top[0].text == " Paris" and top[0].prob > 0.5, top
    # steer.json's next tokens are these (the effects of steering, before any change)
    stats = next_token_stats(smol, hs[-1], valid, target_id=top[1].id, k=3)
    assert [(t["id"], t["token"]) for t in stats["topk"][0]] == [(t.id, t.text) for t in top]
    assert stats["topk"][0][0]["prob"] == pytest.approx(top[0].prob, rel=1e-5)
    assert stats["target_prob"][0] == pytest.approx(top[1].prob, rel=1e-5)
    for text in TEXTS + ["  two spaces, a tab\tand ünïcödé — ok?"]:
        assert pl.decode(smol, pl.tokenize(smol, [text])[0]) == text


# ------------------------------------------------------------------ trace

@pytest.mark.parametrize("decoder", ["gpt2", "gemma2"], indirect=True)     # Llama: the twin test and SmolLM2
def test_trace_matches_transformers(decoder):
    model, hf = decoder["model"], decoder["hf"]
    ids, mask = T.batch()
    valid = mask.astype(bool)
    tr = pl.trace(model, [list(r[v]) for r, v in zip(ids, valid)], attention_weights=True)
    L = hf.config.num_hidden_layers
    B, n = ids.shape
    d, H = model.config.d_model, model.config.n_heads
    assert tr.rule == "full" and list(tr.layer) == list(range(L))
    assert tr.states.shape == (L + 1, B, n, d) and tr.inputs.shape == tr.outputs.shape == (L, B, n, d)
    assert tr.attention.shape == (L, B, H, n, n) and tr.logits.shape == (B, n, model.embeddings["word"].shape[0])
    assert (tr.valid == valid).all()
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), output_hidden_states=True,
                 output_attentions=True)
    ref_hs = np.stack([h.double().numpy() for h in out.hidden_states])
    assert _err(tr.states[:-1], ref_hs[:-1], valid) <= TOL                   # the residual stream
    ref_lg = out.logits.double().numpy()
    assert _err(tr.logits, ref_lg, valid) <= TOL * max(1.0, np.abs(ref_lg).max())
    A = np.asarray(tr.attention, np.float64)
    for b, m in enumerate(valid.sum(1)):
        ref_A = np.stack([a[b, :, :m, :m].double().numpy() for a in out.attentions])
        assert np.abs(A[:, b, :, :m, :m] - ref_A).max() <= 1e-5
    np.testing.assert_allclose(A.sum(-1), 1.0, atol=1e-5)
    last = valid.sum(1) - 1
    np.testing.assert_allclose(np.asarray(tr.next_logits), np.asarray(tr.logits)[np.arange(B), last])
    # measures against the references, labelled
    for measure in (tr.gamma, tr.rho):
        assert list(measure) == ["principal", "random", "other_layer"]
        assert all(v.shape == (L,) for v in measure.values())
    assert tr.rho["principal"][0] == pytest.approx(tr.measures.rho[1])


def test_trace_is_the_twin_of_align(tiny):
    model = tiny["model"]
    res = pl.align(model, TEXTS, rule="paper", seed=3)
    for order in ("shifted", "plain"):
        tr = pl.trace(model, TEXTS, rule="paper", order=order, seed=3)
        assert tr.attention is None and tr.order == order
        want = res.measures[order].rows()
        got = tr.measures.rows()
        assert [r["layer"] for r in got] == [r["layer"] for r in want] == [None, 0, 1, 2]
        for w, g in zip(want, got):
            for key, v in w.items():
                assert (g[key] is None) == (v is None), key
                if v is not None:
                    assert g[key] == pytest.approx(v, abs=1e-5), (order, key)
        np.testing.assert_allclose(tr.gamma["principal"], res.measures[order].gamma[1:], atol=1e-5)
        np.testing.assert_allclose(tr.rho["other_layer"], res.measures[order].rho_other_layer[1:], atol=1e-5)


def test_trace_names_bad_options(tiny):
    with pytest.raises(ValueError, match="unknown rule 'fast'"):
        pl.trace(tiny["model"], TEXTS, rule="fast")
    with pytest.raises(ValueError, match="unknown order 'largest'"):
        pl.trace(tiny["model"], TEXTS, order="largest")
    with pytest.raises(ValueError, match="attention_weights must be True or False"):
        pl.trace(tiny["model"], TEXTS, attention_weights="yes")


def test_smollm2_trace(smol):
    tr = pl.trace(smol, [TEXTS[0]], attention_weights=True)
    assert pl.top_tokens(smol, tr.next_logits[0], k=1)[0].text == " Paris"
    x0, valid = pl.embed(smol, [TEXTS[0]])
    np.testing.assert_allclose(np.asarray(tr.logits), np.asarray(pl.logits(smol, pl.hidden_states(smol, x0, valid)[-1])),
                               atol=2e-3)
    A = np.asarray(tr.attention)                                               # (30, 1, 9, n, n), causal
    n = A.shape[-1]
    assert A.shape[:3] == (30, 1, 9) and np.allclose(A.sum(-1), 1.0, atol=1e-5)
    assert np.abs(A[..., np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]]).max() == 0.0


# ------------------------------------------------------------------ labelled numbers

def test_alignment_measures_are_labelled():
    layers = pl.synthetic_system([2.0, 0.5, 0.3], kind="symmetric", heads=1, d=6, steps=4)
    subs = pl.reference_subspaces(pl.spectra_of(layers))
    x0 = pl.sphere_tokens(np.random.default_rng(0), 5, 6)
    out = pl.run(layers, x0, None, rule="paper", attention="softmax", observers={"align": pl.alignment(subs)})
    named = out["align"].named("gamma")
    assert list(named) == ["principal", "random", "other_layer"]
    for r, name in enumerate(subs.names):
        np.testing.assert_array_equal(named[name], out["align"].gamma[:, r])
    assert np.isnan(named["other_layer"]).all()                                 # one layer: no other layer
    with pytest.raises(ValueError, match="field must be gamma, gamma_before or rho"):
        out["align"].named("rotation")


def test_simulate_summary_says_distance_to_consensus(tmp_path, capsys):
    from powerlens.cli import main
    assert main(["simulate", "--spectrum", "3,1,0.5", "--dim", "6", "--attention", "uniform", "--tokens", "5",
                 "--steps", "5", "--quiet", "--out", str(tmp_path / "s")]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("T=")][0]
    assert "distance to consensus=" in line and " consensus=" not in line.replace("distance to consensus=", "")


# ------------------------------------------------------------------ one numbering of layers

def _ticks(ax):
    ax.figure.canvas.draw()
    return [t.get_text() for t in ax.get_xticklabels()]


def test_align_numbers_layers_from_0_in_json_and_figure(tiny, tmp_path):
    from powerlens._src.analysis.experiment import StepMeasures, plot_measures
    from powerlens.cli import main
    out = tmp_path / "align"
    assert main(["align", tiny["folder"], "--text", TEXTS[0], "--text", TEXTS[1], "--quiet", "--out", str(out)]) == 0
    doc = json.loads((out / "align.json").read_text())
    steps = doc["orders"]["shifted"]["steps"]
    assert [s["layer"] for s in steps] == [None, 0, 1, 2] and [entry["layer"] for entry in doc["layers"]] == [0, 1, 2]
    m = {o: StepMeasures.from_rows(doc["orders"][o]["steps"]) for o in ("shifted", "plain")}
    fig = plot_measures(m, str(tmp_path / "a.png"), over="layers", return_fig=True)
    ax = fig.axes[1]
    assert ax.get_xlabel() == "layer" and _ticks(ax) == ["0", "1", "2"]
    gamma = [line for line in fig.axes[0].get_lines() if line.get_label() == "γ_t shifted"][0]
    assert list(gamma.get_xdata()) == [0, 1, 2]
    np.testing.assert_allclose(gamma.get_ydata(), [s["gamma"] for s in steps[1:]])
    # over steps (a shared layer iterated): the steps done, 1 .. T, and labelled as steps
    fig = plot_measures(m, str(tmp_path / "b.png"), over="steps", return_fig=True)
    assert fig.axes[1].get_xlabel() == "step t" and _ticks(fig.axes[1]) == ["1", "2", "3"]
    with pytest.raises(ValueError, match="over must be one of"):
        plot_measures(m, str(tmp_path / "c.png"), over="layer")


def test_gemma3_global_layers_are_shaded_at_5_11_17(tmp_path):
    from powerlens._src.analysis.experiment import StepMeasures, plot_measures
    from powerlens._src.reproduce.real_models import global_layers
    kinds = (["local"] * 5 + ["global"]) * 3                                  # Gemma 3 270M's 18 layers
    assert global_layers(kinds) == [5, 11, 17]
    T1 = 19
    rows = [dict(t=t, layer=None if t == 0 else t - 1, **{k: (None if t == 0 and k.startswith("rho") else 0.1 * (t % 3))
                                                           for k in StepMeasures.COLUMNS[2:]}) for t in range(T1)]
    m = StepMeasures.from_rows(rows, n_tokens=10)
    fig = plot_measures({"shifted": m}, str(tmp_path / "g.png"), over="layers", marks={"global": global_layers(kinds)},
                        return_fig=True)
    spans = [p for p in fig.axes[0].patches if hasattr(p, "get_width") and p.get_width() == pytest.approx(1.0)]
    centres = sorted({round(p.get_x() + p.get_width() / 2, 6) for p in spans})
    assert centres == [5.0, 11.0, 17.0]


def test_spectrum_figure_numbers_layers_from_0(tmp_path):
    F = np.random.default_rng(0).standard_normal((3, 5, 5))
    fig = pl.plots.plot_eigenvalues(pl.layer_spectra(F), str(tmp_path / "e.png"), return_fig=True)
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible() and ax.get_title().startswith("layer")]
    assert [t.split(" —")[0] for t in titles] == ["layer 0", "layer 1", "layer 2"]


def test_the_type_checking_block_names_exactly_the_exports():
    """``powerlens/__init__.py`` resolves names lazily (PEP 562) and states them again in an
    ``if TYPE_CHECKING:`` block, for IDEs and type checkers: the two agree name for name, and
    every import of the block resolves to the object ``pl.<name>`` gives."""
    import ast
    import importlib
    path = pl.__file__
    tree = ast.parse(open(path, encoding="utf-8").read())
    block = next(node for node in tree.body if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING")
    stated = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.level == 1, ast.dump(node)
        module = "powerlens" + ("." + node.module if node.module else "")
        for alias in node.names:
            stated[alias.asname or alias.name] = (module, alias.name)
    assert set(stated) == set(pl._EXPORTS)
    for name, (module, attr) in stated.items():
        value = getattr(importlib.import_module(module), attr, None)
        if value is None:
            value = importlib.import_module(f"{module}.{attr}")
        assert value is getattr(pl, name), name
