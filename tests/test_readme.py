"""The README stays true: its Python tour runs, and its commands exist."""
from __future__ import annotations

import os
import re

import numpy as np

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
    assert scope["out"]["align"].names == traj.references == ("principal", "random", "other_layer")
    assert np.isnan(gamma_last[2]) and np.isnan(ref["gamma"][-1, 2])
    np.testing.assert_allclose(gamma_last[:2], ref["gamma"][-1, :2], atol=1e-4)
    np.testing.assert_allclose(float(traj.consensus[0, -1]), ref["consensus"][-1], atol=1e-4)

    exec(compile(pretrained, "README.md", "exec"), scope)
    model, tr, u, a, steered = scope["model"], scope["tr"], scope["u"], scope["a"], scope["steered"]
    L = model.layers
    x0, valid = np.asarray(scope["x0"], np.float64)[0], np.asarray(scope["valid"], bool)[0]
    params, static = R.layer_dicts(L), R.static_kwargs(L.config)
    sched = list(L.schedule)
    assert sched == list(range(6))                                   # all-MiniLM-L6-v2: six layers

    # --- printed: the trace's gamma_t per layer (from 0) against each layer's principal
    # subspace, from the oracle's states and NumPy eigenvectors
    states = _paper_run(params, sched, x0, valid, static)
    np.testing.assert_allclose(np.asarray(tr.states[:, 0], np.float64)[:, valid], states[:, valid], atol=2e-4)
    proj = [_principal_projector(_F(L, t)) for t in sched]
    gam = np.array([np.mean(np.linalg.norm(states[t + 1][valid] @ P, axis=1)
                            / np.linalg.norm(states[t + 1][valid], axis=1)) for t, (P, _) in enumerate(proj)])
    assert set(tr.gamma) == {"principal", "random", "other_layer"}
    np.testing.assert_allclose(np.asarray(tr.gamma["principal"], np.float64), gam, atol=1e-4)
    # rho_t: the share of valid tokens whose principal alignment grows across layer t
    cos = lambda X, P: np.linalg.norm(X @ P, axis=1) / np.linalg.norm(X, axis=1)
    rho = np.array([np.mean(cos(states[t + 1][valid], P) > cos(states[t][valid], P)) for t, (P, _) in enumerate(proj)])
    np.testing.assert_allclose(np.asarray(tr.rho["principal"], np.float64), rho, atol=1e-6)

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


def test_benchmark_tables_are_their_results_files():
    """Every README table marked ``<!-- table from docs/benchmarks/NAME.md -->`` is that file's
    first table, as ``benchmarks/NAME.py`` wrote it on its last run (the script replaces both)."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import benchdoc
    text = _readme()
    quoted = benchdoc.quoted_tables(text)
    assert quoted, "the README quotes no benchmark table"
    lines = text.splitlines()
    for name, (a, b) in quoted:
        path = os.path.join(ROOT, name)
        script = os.path.basename(name)[:-3]
        assert os.path.exists(path), f"{name} is missing: run python benchmarks/{script}.py"
        with open(path, encoding="utf-8") as fh:
            doc = fh.read()
        assert lines[a:b] == benchdoc.first_table(doc), f"the README's table differs from {name}'s"
        assert len(lines[a:b]) > 2, f"{name}'s table has no rows"
        assert f"- command: `python benchmarks/{script}.py" in doc


def test_every_benchmark_has_its_results_file():
    """docs/benchmarks/ holds one file per benchmark script (each script that writes one, through
    benchdoc), and nothing else."""
    import glob
    scripts = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))
                     if "benchdoc.add_doc_option(" in open(p, encoding="utf-8").read() and not p.endswith("benchdoc.py"))
    files = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "docs", "benchmarks")) if f.endswith(".md"))
    assert len(scripts) >= 8 and files == scripts, (scripts, files)


MACHINE_PATH = re.compile("|".join(("/" + "work/", "/" + "root/", r"/tmp/[a-z]")))  # split: no such path here
HISTORY = re.compile(r"\bsessions?\b|\bruns? \d+\b|\bthis run\b|\bminutes earlier\b", re.I)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _user_docs():
    """README.md and every Markdown file under docs/ (the benchmark results included)."""
    paths = [os.path.join(ROOT, "README.md")]
    for folder, _, files in os.walk(os.path.join(ROOT, "docs")):
        paths += [os.path.join(folder, f) for f in sorted(files) if f.endswith(".md")]
    return paths


def test_user_docs_hold_no_machine_path_and_no_history():
    """What a user reads states the current state: no path of the machine it was written on, no
    numbered runs, no working periods, no commit hashes; the README stays under 300 lines."""
    bad = []
    for path in _user_docs():
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh, 1):
                for what, pattern in (("machine path", MACHINE_PATH), ("history", HISTORY), ("commit", COMMIT)):
                    m = pattern.search(line)
                    if m:
                        bad.append(f"{os.path.relpath(path, ROOT)}:{i}: {what} {m.group(0)!r}")
    assert not bad, "\n".join(bad)
    assert len(_readme().splitlines()) < 300
    assert COMMIT.search("timed at f58e29a") and HISTORY.search("in run 13") and not COMMIT.search("deadbeefs")
