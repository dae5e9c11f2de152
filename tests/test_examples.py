"""The scripts in examples/ run on small settings and print/write the right numbers.

Each example is imported from its file and its ``main(argv)`` called in this process
(one JAX start-up, shared compilations); one is also run as a script in a subprocess.
The numbers are checked against values derived here independently:

    spectrum   eigenvalues of F_t = W_o · concat_h W_v,h from the raw weights (numpy eig)
    align      gamma_t / rho_t / chance from a plain NumPy forward pass of the `paper` rule
               and numpy eig; chance = Gamma(d/2) / (sqrt(pi) Gamma((d+1)/2)) (x pi/2 for a plane)
    sweep      consensus rate 1/|1 + lambda1| with lambda1 the swept values
    steer      the written Delta O is alpha u (V u)^T / ||V u||, and a NumPy forward pass with
               it gives min_i cos(x_i, u) = target (reached, and not reached at 0.99 alpha);
               the asymptotic and exact top eigenvalues of F + alpha u z^T
"""
import importlib.util
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from scipy.special import gammaln

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def minilm():
    import powerlens._src.models as M
    try:
        return M.load("minilm")
    except Exception as exc:  # noqa: BLE001 - the weights package is part of the set-up; say why if absent
        pytest.skip(f"cannot load 'minilm' here: {type(exc).__name__}: {exc}")


# ------------------------------------------------------------------ independent NumPy reference

def _weights(model):
    L = model.layers
    assert L.config.n_kv_heads == L.config.n_heads and not L.config.causal and L.config.rope_theta is None
    assert np.all(np.asarray(L.window) == 0) and L.schedule == tuple(range(L.n_unique))
    f = lambda a: None if a is None else np.asarray(a, np.float64)
    return {k: f(getattr(L, k)) for k in ("W_q", "W_k", "W_v", "W_o", "b_q", "b_k", "scale")}


def _F(w, l, W_o=None):
    """F_l = W_o concat_h W_v,h (d, d)."""
    Wv = w["W_v"][l]
    return (w["W_o"][l] if W_o is None else W_o) @ Wv.reshape(-1, Wv.shape[-1])


def _principal(F):
    """Orthonormal basis of the principal subspace by |1 + lambda| (real v1, or the complex pair's plane)."""
    ev, V = np.linalg.eig(F)
    i = int(np.argmax(np.abs(1 + ev)))
    v = V[:, i]
    if abs(ev[i].imag) > 1e-9 * (1 + abs(ev[i])):
        return np.linalg.qr(np.stack([v.real, v.imag], 1))[0], ev[i]
    return (v.real / np.linalg.norm(v.real))[:, None], ev[i]


def _paper_forward(w, x0, valid, W_o_last=None):
    """States X_0..X_L (each (B, n, d)) of x <- N2(x + sum_h O_h V_h A_h x), biases of v/o dropped."""
    X = np.asarray(x0, np.float64)
    v = np.asarray(valid, bool)
    states = [X]
    U = w["W_v"].shape[0]
    for l in range(U):
        q = np.einsum("bnd,hed->bhne", X, w["W_q"][l]) + w["b_q"][l][None, :, None, :]
        k = np.einsum("bnd,hed->bhne", X, w["W_k"][l]) + w["b_k"][l][None, :, None, :]
        s = w["scale"][l] * q @ np.swapaxes(k, -1, -2)
        s = np.where(v[:, None, None, :], s, -np.inf)
        A = np.exp(s - s.max(-1, keepdims=True))
        A /= A.sum(-1, keepdims=True)
        val = np.einsum("bnd,hed->bhne", X, w["W_v"][l])
        M = np.swapaxes(A @ val, 1, 2).reshape(X.shape[0], X.shape[1], -1)      # (B, n, H e)
        W_o = W_o_last if (W_o_last is not None and l == U - 1) else w["W_o"][l]
        Y = X + M @ W_o.T
        X = Y / np.linalg.norm(Y, axis=-1, keepdims=True)
        states.append(X)
    return states


def _floats(line):
    return [float(t) for t in re.findall(r"[-+]?\d+\.\d+(?:e[-+]?\d+)?", line)]


# ------------------------------------------------------------------ the public API only

def _powerlens_imports(path):
    """Every import of powerlens in a file: ("import", name, alias) or ("from", module, names)."""
    import ast
    tree = ast.parse(open(path, encoding="utf-8").read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [("import", a.name, a.asname) for a in node.names if a.name.split(".")[0] == "powerlens"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "powerlens":
            out.append(("from", node.module, [a.name for a in node.names]))
    return out


@pytest.mark.parametrize("name", sorted(f[:-3] for f in os.listdir(EXAMPLES) if f.endswith(".py")))
def test_examples_import_powerlens_as_pl_only(name):
    """An example shows the public namespace: ``import powerlens as pl`` and nothing deeper."""
    assert _powerlens_imports(os.path.join(EXAMPLES, f"{name}.py")) == [("import", "powerlens", "pl")]


# ------------------------------------------------------------------ spectrum_of_a_model

def test_spectrum_example(minilm, tmp_path, capsys):
    out = _example("spectrum_of_a_model").main(["--out", str(tmp_path)])
    text = capsys.readouterr().out
    rows = [l for l in text.splitlines() if re.match(r"^\s+\d+\s+[-+]", l)]
    w = _weights(minilm)
    assert len(rows) == len(out["spectra"]) == 6
    differ = []
    for l, row in enumerate(rows):
        ev = np.linalg.eigvals(_F(w, l))
        shifted = ev[np.argmax(np.abs(1 + ev))]
        plain = ev[np.argmax(np.abs(ev))]
        key = np.sort(np.abs(1 + ev))[::-1]
        n_top = 2 if abs(shifted.imag) > 1e-9 else 1
        vals = _floats(row)  # re, im, |1+l|, re, im, |l|, ratio
        assert vals[0] == pytest.approx(shifted.real, abs=1e-4)
        assert vals[1] == pytest.approx(abs(shifted.imag), abs=1e-4)
        assert vals[2] == pytest.approx(abs(1 + shifted), abs=1e-4)
        assert vals[3] == pytest.approx(plain.real, abs=1e-4)
        assert vals[4] == pytest.approx(abs(plain.imag), abs=1e-4)
        assert vals[5] == pytest.approx(abs(plain), abs=1e-4)
        assert vals[6] == pytest.approx(key[n_top] / key[0], abs=1e-4)
        assert ("yes" in row) == (n_top == 2)
        if min(abs(plain - shifted), abs(plain - np.conj(shifted))) > 1e-6:
            differ.append(l)
        assert ("YES" in row) == (l in differ)
    assert f"orderings differ on {len(differ)} of 6 layers: {differ}" in text
    assert differ, "MiniLM has layers whose two orderings differ"   # the known finding (layers 1, 3, 4)
    js = json.load(open(tmp_path / "spectrum.json"))
    assert [r["orderings_differ"] for r in js["layers"]] == [l in differ for l in range(6)]
    assert open(tmp_path / "eigenvalues.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_spectrum_example_as_script(tmp_path):
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(EXAMPLES, "spectrum_of_a_model.py"), "--quick",
                        "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0 and "is not installed; install it with" in p.stderr:
        pytest.skip("minilm weights package not installed")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "showing 3" in p.stdout
    assert len([l for l in p.stdout.splitlines() if re.match(r"^\s+\d+\s+[-+]", l)]) == 3
    assert len(json.load(open(tmp_path / "spectrum.json"))["layers"]) == 3
    assert (tmp_path / "eigenvalues.png").stat().st_size > 10_000


# ------------------------------------------------------------------ align_your_prompts

def test_align_example(minilm, tmp_path, capsys):
    from powerlens._src.models import embed
    out = _example("align_your_prompts").main(["--quick", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    x0, valid = embed(minilm, out["texts"])
    valid = np.asarray(valid, bool)
    w = _weights(minilm)
    states = _paper_forward(w, x0, valid)
    d = x0.shape[-1]
    chance1 = np.exp(gammaln(d / 2) - gammaln((d + 1) / 2)) / np.sqrt(np.pi)
    rows = [l for l in text.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d", l)]
    assert len(rows) == 6
    n_tok = int(valid.sum())
    assert f"{n_tok} tokens" in text
    for t, row in enumerate(rows, start=1):
        B, _ = _principal(_F(w, t - 1))
        g = lambda X: np.linalg.norm(X @ B, axis=-1) / np.linalg.norm(X, axis=-1)
        g0, g1 = g(states[t - 1])[valid], g(states[t])[valid]
        vals = _floats(row)   # gamma shifted, gamma plain, chance, rho, rho random, rho other, p, rho plain
        assert vals[0] == pytest.approx(g1.mean(), abs=2e-4)
        assert vals[2] == pytest.approx(chance1 * (np.pi / 2 if B.shape[1] == 2 else 1.0), abs=1e-4)
        assert vals[3] == pytest.approx(np.mean(g1 > g0), abs=1.01 / n_tok)
        r = out["result"].measures["shifted"].rows()[t]
        assert r["gamma"] == pytest.approx(g1.mean(), abs=2e-5)
    summary = out["result"].summary("shifted")
    assert re.search(rf"shifted: mean γ {summary['mean_gamma']:.4f}", text)
    js = json.load(open(tmp_path / "align.json"))
    assert js["texts"] == out["texts"] and js["n_tokens"] == n_tok
    assert (tmp_path / "alignment.png").stat().st_size > 10_000


# ------------------------------------------------------------------ synthetic_sweep

def test_sweep_example(tmp_path, capsys):
    out = _example("synthetic_sweep").main(["--quick", "--out", str(tmp_path)])
    text = capsys.readouterr().out
    lam1 = np.linspace(0.5, 3.0, 6)                  # the --quick sweep of the defaults
    pred = 1.0 / (1.0 + lam1)
    rows = [_floats(l) for l in text.splitlines() if re.match(r"^\s+\d+\.\d+\s+\d", l)]
    assert len(rows) == 6
    got = np.array(rows)
    np.testing.assert_allclose(got[:, 0], lam1, atol=1e-4)      # printed lambda1 (from eig) = the swept value
    np.testing.assert_allclose(got[:, 1], pred, atol=1e-5)
    np.testing.assert_allclose(got[:, 2], pred, rtol=0.01)      # measured consensus rate
    np.testing.assert_allclose(out["measured"], pred, rtol=0.01)
    assert np.all(out["final_gamma"] > 0.999)                   # consensus aligned with v1
    js = json.load(open(tmp_path / "sweep.json"))
    np.testing.assert_allclose(js["measured_rate"], out["measured"])
    for f in ("rates.png", "consensus.png"):
        assert (tmp_path / f).stat().st_size > 10_000


# ------------------------------------------------------------------ steer_toward_a_word

def test_steer_example(minilm, tmp_path, capsys):
    from transformers import AutoTokenizer
    from powerlens._src.models import embed
    target = 0.9
    out = _example("steer_toward_a_word").main(["--model", "minilm", "--word", "king", "--quick",
                                                "--target", str(target), "--out", str(tmp_path)])
    text = capsys.readouterr().out
    js = json.load(open(tmp_path / "steer.json"))
    assert js["signed"] is True
    tid = AutoTokenizer.from_pretrained(minilm.info.tokenizer).convert_tokens_to_ids("king")
    assert js["direction"]["token_id"] == tid
    word = np.asarray(minilm.embeddings["word"], np.float64)[tid]
    u = word / np.linalg.norm(word)
    w = _weights(minilm)
    l = w["W_v"].shape[0] - 1
    V = w["W_v"][l].reshape(-1, u.size)                          # (H e, d)
    alpha = js["rank1"]["alpha"]
    assert float(re.search(r"alpha = ([\d.]+)", text).group(1)) == pytest.approx(alpha, rel=1e-5)
    wv = V @ u / np.linalg.norm(V @ u)                           # w = "value"
    delta = np.load(tmp_path / "delta_O.npy")
    np.testing.assert_allclose(delta, alpha * np.outer(u, wv), atol=1e-8 * alpha)
    # eigenvalues of F' = F + alpha u z^T, z = V^T w
    F = _F(w, l)
    z = V.T @ wv
    lam_pred = alpha * (z @ u) + z @ F @ u / (z @ u)
    assert js["rank1"]["predicted_top_eigenvalue"] == pytest.approx(lam_pred, rel=1e-8)
    ev = np.linalg.eigvals(F + alpha * np.outer(u, z))
    top = ev[np.argmax(np.abs(1 + ev))]
    assert js["rank1"]["exact_top_eigenvalue_shifted"][0] == pytest.approx(top.real, rel=1e-6)
    assert abs(top - lam_pred) / abs(top) < 0.01                 # the asymptotic formula at this alpha
    # the paper-rule dynamics with the steered W_o: every final token reaches the target, minimally
    x0, valid = embed(minilm, js["texts"])
    valid = np.asarray(valid, bool)
    cos = lambda X: ((X @ u) / np.linalg.norm(X, axis=-1))[valid]
    after = cos(_paper_forward(w, x0, valid, w["W_o"][l] + delta)[-1])
    assert after.min() == pytest.approx(target, abs=2e-4)
    assert cos(_paper_forward(w, x0, valid, w["W_o"][l] + 0.99 * delta)[-1]).min() < target - 1e-4
    np.testing.assert_allclose(js["paper_alignment_after"], after, atol=2e-4)
    before = cos(_paper_forward(w, x0, valid)[-1])
    np.testing.assert_allclose(out["before"], before, atol=2e-4)
    m = re.search(r"after mean ([-\d.]+) min ([-\d.]+)", text)
    assert float(m.group(1)) == pytest.approx(after.mean(), abs=2e-4)
    assert float(m.group(2)) == pytest.approx(after.min(), abs=2e-4)
    eff = js["effects"]["conditions"]
    assert eff["rank1"]["pooled_cos_mean"] > eff["before"]["pooled_cos_mean"] + 0.3
    assert (tmp_path / "alignment_hist.png").stat().st_size > 10_000
