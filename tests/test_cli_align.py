"""`powerlens align` on MiniLM: per-layer numbers in both orderings, controls, p-values."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from powerlens.cli import main
from powerlens._src.dynamics.norms import l2_normalize

TEXTS = ["The cat sat on the mat.", "Power iteration finds the top eigenvector."]


@pytest.fixture(scope="module")
def paper_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("align") / "paper"
    argv = ["align", "minilm", "--quiet", "--out", str(out)]
    for t in TEXTS:
        argv += ["--text", t]
    assert main(argv) == 0
    return json.loads((out / "align.json").read_text()), out


def test_align_json_numbers(paper_run):
    doc, out = paper_run
    assert doc["rule"] == "paper" and doc["n_prompts"] == 2
    from powerlens._src.models import load
    from powerlens._src.models.embed import tokenize
    n_tok = sum(len(ids) for ids in tokenize(load("minilm"), TEXTS))
    assert doc["n_tokens"] == n_tok
    for order in ("shifted", "plain"):
        steps = doc["orders"][order]["steps"]
        assert len(steps) == 7 and [s["layer"] for s in steps[1:]] == list(range(6))
        for s, layer in zip(steps[1:], doc["layers"]):
            k = layer["dim"] if order == "shifted" else layer["dim_plain"]
            # chance level of gamma for a random unit vector against a k-dim subspace of R^384
            chance = math.exp(math.lgamma((k + 1) / 2) + math.lgamma(384 / 2) - math.lgamma(k / 2)
                              - math.lgamma((384 + 1) / 2))
            assert s["chance_gamma"] == pytest.approx(chance, rel=1e-9)
            count = round(s["rho"] * n_tok)
            assert s["rho_pvalue"] == pytest.approx(stats.binom.sf(count - 1, n_tok, 0.5), rel=1e-6)
            assert 0 <= s["gamma"] <= 1 and s["rho_random"] is not None and s["rho_other_layer"] is not None
    flags = [l["orderings_differ"] for l in doc["layers"]]
    assert flags == [False, True, False, True, True, False]      # MiniLM layers 1, 3, 4 (design.md §2)
    assert (out / "alignment.png").stat().st_size > 10000


def test_first_layer_gamma_matches_direct_computation(paper_run):
    """gamma_1 recomputed by hand: one paper step of layer 0, then ||B^T x|| / ||x||."""
    import jax.numpy as jnp
    from powerlens._src.analysis.alignment import model_spectra
    from powerlens._src.dynamics.layer import layer_step
    from powerlens._src.models import embed, load
    doc, _ = paper_run
    model = load("minilm")
    x0, valid = embed(model, TEXTS)
    B = model_spectra(model)[0].shifted.basis
    gam = []
    for b in range(2):
        Y = np.asarray(layer_step(model.layers.layer(0), jnp.asarray(x0[b]), jnp.asarray(valid[b]), rule="paper"))
        v = np.asarray(valid[b])
        gam += list(np.linalg.norm(Y[v] @ B, axis=1) / np.linalg.norm(Y[v], axis=1))
    assert doc["orders"]["shifted"]["steps"][1]["gamma"] == pytest.approx(np.mean(gam), rel=1e-4)


def test_shared_layer_and_faithful(tmp_path, capsys):
    out = tmp_path / "shared"
    argv = ["align", "minilm", "--text", TEXTS[0], "--shared-layer", "2", "--steps", "30", "--rule", "faithful",
            "--quiet", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "align.json").read_text())
    assert doc["rule"] == "post_ln" and doc["mode"] == "shared layer 2 x 30"
    assert len(doc["orders"]["shifted"]["steps"]) == 31
    assert all(s["layer"] == 0 for s in doc["orders"]["shifted"]["steps"][1:])   # the one kept layer


@pytest.mark.parametrize("argv, message", [
    (["--text", "   "], "empty"),
    (["--prompts", "/nonexistent/prompts.txt"], "does not exist"),
    ([], "no prompts"),
    (["--text", "a b", "--shared-layer", "1"], "go together"),
    (["--text", "word " * 600], "longer than the model's"),
])
def test_align_bad_input(tmp_path, capsys, argv, message):
    out = tmp_path / "x"
    code = main(["align", "minilm", "--quiet", "--out", str(out)] + argv)
    assert code == 2 and message in capsys.readouterr().err
    assert not out.exists()
