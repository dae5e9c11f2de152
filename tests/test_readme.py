"""The README stays true: its Python tour runs, and its commands exist."""
from __future__ import annotations

import math
import os
import re

import numpy as np
from scipy.special import betaln

import reference_numpy as R

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        return fh.read()


def _tour():
    """The README's Python block, split before its first ``load(`` line: the synthetic part
    (whose x0 the model part overwrites) and the model part, run one after the other in one
    scope, exactly as the whole block runs."""
    lines = re.search(r"```python\n(.*?)```", _readme(), re.S).group(1).splitlines(keepends=True)
    cut = next(i for i, line in enumerate(lines) if re.search(r"\bload\(", line))
    return "".join(lines[:cut]), "".join(lines[cut:])


def _F(layers, u):
    """F = sum_h W_o[:, h] W_v,g(h) of unique layer u, in float64 NumPy (no powerlens maths)."""
    W_v = np.asarray(layers.W_v, np.float64)[u]                      # (G, e, d)
    W_o = np.asarray(layers.W_o, np.float64)[u]                      # (d, H e)
    G, e, _ = W_v.shape
    H = W_o.shape[1] // e
    return sum(W_o[:, h * e:(h + 1) * e] @ W_v[h // (H // G)] for h in range(H))


def _value_cat(layers, u):
    """V_cat (H e, d): every query head's value matrix, stacked."""
    W_v = np.asarray(layers.W_v, np.float64)[u]
    G, e, d = W_v.shape
    H = np.asarray(layers.W_o).shape[-1] // e
    return np.concatenate([W_v[h // (H // G)] for h in range(H)], axis=0)


def _principal_projector(F, rtol=1e-4):
    """Projector onto the real span of the eigenvectors of the top |1 + lambda| group of F, and its rank."""
    w, V = np.linalg.eig(F)
    key = np.abs(1 + w)
    top = key >= key.max() * (1 - rtol)
    Z = np.concatenate([V[:, top].real, V[:, top].imag], axis=1)
    U, sv, _ = np.linalg.svd(Z, full_matrices=False)
    B = U[:, sv > 1e-7 * sv[0]]
    return B @ B.T, B.shape[1]


def _paper_run(params, schedule, X, valid, static):
    """The oracle's paper-rule softmax run; returns every state (T + 1, n, d)."""
    states = [X]
    for u in schedule:
        X = R.layer_step(params[u], X, valid, rule="paper", attention="softmax", **static)
        states.append(X)
    return np.stack(states)


def test_python_tour_runs():
    synthetic, pretrained = _tour()
    scope: dict = {}
    exec(compile(synthetic, "README.md", "exec"), scope)

    # --- the synthetic system: F has exactly the prescribed spectrum 2, 0.5 +- 1j, 0.3 (and 0s)
    layers, spectra, subs, traj = scope["layers"], scope["spectra"], scope["subs"], scope["traj"]
    x0_synthetic = np.asarray(scope["x0"], np.float64)
    F = _F(layers, 0)
    want = np.array([2.0, 0.5 + 1j, 0.5 - 1j, 0.3] + [0.0] * (F.shape[0] - 4))
    np.testing.assert_allclose(np.sort_complex(np.linalg.eigvals(F)), np.sort_complex(want), atol=1e-5)
    # printed: the top eigenvalue (2 in both orderings: |1+2| = 3 > |1.5+1j| = 1.80 > 1.3 and
    # |2| > |0.5+1j| = 1.12 > 0.3), so the orderings agree, and the rate |1 + l2| / |1 + l1|
    sp = spectra[0]
    assert abs(sp.shifted.top - 2.0) < 1e-5 and abs(sp.plain.top - 2.0) < 1e-5
    assert sp.orderings_differ is False
    np.testing.assert_allclose(sp.shifted.ratio, abs(1 + (0.5 + 1j)) / abs(1 + 2.0), atol=1e-5)
    np.testing.assert_allclose(sp.plain.ratio, abs(0.5 + 1j) / 2.0, atol=1e-5)
    # printed: gamma after the last step against (principal, random, other layer) and the
    # consensus distance, against the NumPy oracle run on the same system; a single layer
    # has no other layer, so that control is undefined
    ref = R.simulate_layers(layers, x0_synthetic, subs, rule="paper", attention="softmax", fast=True)
    gamma_last = np.asarray(scope["pl"].pooled(traj)["gamma"][-1], np.float64)
    assert np.isnan(gamma_last[2]) and np.isnan(ref["gamma"][-1, 2])
    np.testing.assert_allclose(gamma_last[:2], ref["gamma"][-1, :2], atol=1e-4)
    np.testing.assert_allclose(float(traj.consensus[0, -1]), ref["consensus"][-1], atol=1e-4)

    exec(compile(pretrained, "README.md", "exec"), scope)
    model, res, u, a, steered = scope["model"], scope["res"], scope["u"], scope["a"], scope["steered"]
    L = model.layers
    x0, valid = np.asarray(scope["x0"], np.float64)[0], np.asarray(scope["valid"], bool)[0]
    params, static = R.layer_dicts(L), R.static_kwargs(L.config)
    sched = list(L.schedule)
    assert sched == list(range(6))                                   # all-MiniLM-L6-v2: six layers
    d = x0.shape[1]

    # --- printed: the alignment summary, from the oracle's states and NumPy eigenvectors
    states = _paper_run(params, sched, x0, valid, static)
    proj = [_principal_projector(_F(L, t)) for t in sched]
    gam = np.array([np.mean(np.linalg.norm(states[t + 1][valid] @ P, axis=1)
                            / np.linalg.norm(states[t + 1][valid], axis=1)) for t, (P, _) in enumerate(proj)])
    # E ||P x|| for x uniform on the sphere of R^d, P of rank k: ||P x||^2 ~ Beta(k/2, (d-k)/2)
    chance = np.array([math.exp(betaln((k + 1) / 2, (d - k) / 2) - betaln(k / 2, (d - k) / 2)) for _, k in proj])
    summary = res.summary("shifted")
    assert summary["steps"] == 6
    np.testing.assert_allclose(summary["mean_gamma"], gam.mean(), atol=1e-4)
    np.testing.assert_allclose(summary["max_gamma"], gam.max(), atol=1e-4)
    np.testing.assert_allclose(summary["mean_chance"], chance.mean(), rtol=1e-6)

    # --- a: the smallest alpha from which every token has |cos(x, u)| >= 0.9 after the last
    # layer (paper rule), checked by running the oracle with O' = O + alpha u w^T built here,
    # w = V_cat u / ||V_cat u||
    uu = np.asarray(u, np.float64)
    V = _value_cat(L, sched[-1])
    w = V @ uu / np.linalg.norm(V @ uu)

    def worst_cos(alpha):
        steered_params = [dict(p) for p in params]
        steered_params[-1]["W_o"] = params[-1]["W_o"] + alpha * np.outer(uu, w)
        Y = _paper_run(steered_params, sched, x0, valid, static)[-1][valid]
        return np.min(np.abs(Y @ uu) / (np.linalg.norm(Y, axis=1) * np.linalg.norm(uu)))

    assert a > 0
    np.testing.assert_allclose(worst_cos(a), 0.9, atol=1e-4)
    assert worst_cos(0.99 * a) < 0.9 - 1e-4
    # --- steered: only the last layer's W_o changes, by exactly a u w^T, of norm a ||u||
    dW = np.asarray(steered.layers.W_o, np.float64) - np.asarray(L.W_o, np.float64)
    np.testing.assert_array_equal(dW[:-1], 0.0)
    np.testing.assert_allclose(dW[-1], a * np.outer(uu, w), atol=1e-5 * a)
    np.testing.assert_allclose(steered.delta_norm, a * np.linalg.norm(uu), rtol=1e-5)


def test_documented_commands_exist():
    from powerlens.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    inside, lines = False, []
    for line in _readme().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside:
            lines.append(line)
    names = re.findall(r"^powerlens (\w+)", "\n".join(lines), re.M)
    assert {"simulate", "spectrum", "align", "steer", "reproduce"} <= set(names)
    for name in names:
        assert name in sub.choices, name
    with open(os.path.join(ROOT, ".ci", "run")) as fh:
        ci = fh.read()
    assert "make test" in ci and "make test" in _readme()


def test_vs_torch_runs_table_is_the_scripts():
    """The README's table of every vs_torch run is what ``python benchmarks/vs_torch_runs.py``
    prints from the saved outputs in docs/benchmarks/ (footnote marks aside), so no run's
    number is copied by hand, and every saved run is in it."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "vs_torch_runs.py")],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    printed = [line for line in out if line.startswith("|")]
    text = re.sub(r" [¹²³⁴⁵⁶⁷⁸⁹]", "", _readme())
    start = text.index(printed[0])
    assert text[start:start + len("\n".join(printed))].splitlines() == printed
    assert "python benchmarks/vs_torch_runs.py" in text
    for line in out:
        if line.startswith("Left out"):
            assert line in text


def test_vs_torch_run_table_is_the_scripts():
    """The README's "powerlens vs torch" table and B-E lines are what
    ``python benchmarks/vs_torch_runs.py --run K`` prints for the run K the README names."""
    import subprocess
    import sys
    text = _readme()
    k = re.search(r"vs_torch_runs\.py\s+--run (\d+)` prints them", text).group(1)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "vs_torch_runs.py"), "--run", k],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    blank = out.index("")
    table, tail = out[:blank], out[blank + 1:]
    start = text.index(table[0])
    assert text[start:start + len("\n".join(table))].splitlines() == table
    block = text.index("```\n" + "\n".join(tail) + "\n```", start)
    assert block > start and tail
