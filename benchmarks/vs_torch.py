"""powerlens against the torch code a researcher would write instead, in one process.

Both frameworks run on all cores, float32, on the same weights; every workload first checks
that the two agree, then times each side (best of ``--repeat`` after a warm-up; JAX with
``block_until_ready``, torch under ``torch.inference_mode`` unless it needs gradients).

    A  MiniLM and SmolLM2, rules ``paper`` and ``full``, prompts x tokens in 1x16, 8x128,
       32x128, 8x512 (SmolLM2 also 1x2048): states only (powerlens ``run_states``) and with
       every measure (powerlens ``simulate_batch``: gamma, gamma_before, rho against the
       principal, random and other-layer subspaces; consensus, rank collapse, pairwise
       cosine), against eager torch with ``scaled_dot_product_attention`` (and the same
       measures written in torch). ``torch.compile`` is tried once and reported.
    B  one real layer iterated as a shared-weight system: MiniLM layer 3, 1 x 32 tokens,
       T = 1,000 steps (paper rule, states kept), against a torch loop over the steps.
    C  the gradient of a scalar of the final states (mean gamma against a fixed direction u)
       with respect to the last layer's W_o, through all MiniLM layers (paper rule):
       ``jax.grad`` against torch autograd.
    D  the sweep of ``benchmarks/simulate.py`` (S synthetic systems, d = 64, n = 32, 4 heads,
       T = 200, every measure) against the same maths in batched torch (bmm over systems).

Run ``python benchmarks/vs_torch.py`` (add ``--tiny`` for the small configuration the test
suite runs, ``--only A,B`` to pick workloads). The matmul ceiling (a 2048^3 float32 matmul in
each framework) is printed first. Each line prints the powerlens / torch speed ratio
(> 1: powerlens is faster).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

import powerlens as pl  # noqa: E402


# --------------------------------------------------------------------------- timing

def best_of(fn, repeat: int) -> float:
    fn()                                        # warm-up (compiles)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def jax_call(f):
    return lambda: jax.block_until_ready(f())


def matmul_rates(repeat: int):
    n = 2048
    a = np.random.default_rng(0).standard_normal((n, n), np.float32)
    ja = jnp.asarray(a)
    mm = jax.jit(lambda x: x @ x)
    tj = best_of(jax_call(lambda: mm(ja)), repeat)
    ta = torch.from_numpy(a)
    tt = best_of(lambda: ta @ ta, repeat)
    flops = 2 * n ** 3
    return flops / tj / 1e9, flops / tt / 1e9


# --------------------------------------------------------------------------- torch side

def torch_layers(layers):
    """The unique layers' arrays as torch tensors, one dict per layer."""
    names = [k for k in layers.__dataclass_fields__ if k != "config"]
    arrs = {k: np.asarray(getattr(layers, k)) for k in names if getattr(layers, k) is not None}
    return [{k: torch.from_numpy(np.ascontiguousarray(v[u])) for k, v in arrs.items()}
            for u in range(layers.n_unique)]


def rope_tables(n, e, theta, device=None):
    inv = 1.0 / (theta ** (torch.arange(0, e, 2, dtype=torch.float32) / e))
    f = torch.arange(n, dtype=torch.float32)[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def torch_attention(p, X, mask, cfg, rope, keep_bias):
    """Attn(X) for X (B, n, d) with SDPA; mask (B, 1, n, n) bool (True = attend)."""
    B, n, d = X.shape
    H, G, e = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    q = X @ p["W_q"].reshape(H * e, d).T
    k = X @ p["W_k"].reshape(G * e, d).T
    v = X @ p["W_v"].reshape(G * e, d).T
    if "b_q" in p:
        q = q + p["b_q"].reshape(-1)
        k = k + p["b_k"].reshape(-1)
    if "b_v" in p and keep_bias:
        v = v + p["b_v"].reshape(-1)
    q = q.view(B, n, H, e).transpose(1, 2)
    k = k.view(B, n, G, e).transpose(1, 2)
    v = v.view(B, n, G, e).transpose(1, 2)
    if rope is not None:
        cos, sin = rope
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
    if G != H:
        k = k.repeat_interleave(H // G, dim=1)
        v = v.repeat_interleave(H // G, dim=1)
    o = TF.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=float(p["scale"]))
    out = o.transpose(1, 2).reshape(B, n, H * e) @ p["W_o"].T
    if "b_o" in p and keep_bias:
        out = out + p["b_o"]
    return out


def torch_norm(cfg, X, scale, bias):
    if cfg.norm == "rmsnorm":
        return X * torch.rsqrt(X.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * scale
    return TF.layer_norm(X, X.shape[-1:], scale, bias, cfg.norm_eps)


def torch_ffn(cfg, p, X):
    h = X @ p["W_in"].T
    if "b_in" in p:
        h = h + p["b_in"]
    if cfg.ffn_activation == "silu_glu":
        h = TF.silu(X @ p["W_gate"].T) * h
    else:
        h = TF.gelu(h)
    out = h @ p["W_out"].T
    return out + p["b_out"] if "b_out" in p else out


def torch_step(cfg, p, X, mask, rope, rule):
    if rule == "paper":
        return TF.normalize(X + torch_attention(p, X, mask, cfg, rope, False), dim=-1)
    if cfg.norm_placement == "post":                                   # rule full, BERT
        h = torch_norm(cfg, X + torch_attention(p, X, mask, cfg, rope, True), p["norm_scale"], p.get("norm_bias"))
        return torch_norm(cfg, h + torch_ffn(cfg, p, h), p["ffn_norm_scale"], p.get("ffn_norm_bias"))
    h = X + torch_attention(p, torch_norm(cfg, X, p["norm_scale"], p.get("norm_bias")), mask, cfg, rope, True)
    return h + torch_ffn(cfg, p, torch_norm(cfg, h, p["ffn_norm_scale"], p.get("ffn_norm_bias")))


def torch_mask(cfg, valid):
    """(B, 1, n, n) bool: key padding, and causal for decoders."""
    B, n = valid.shape
    m = valid[:, None, None, :].expand(B, 1, n, n)
    if cfg.causal:
        m = m & torch.ones(n, n, dtype=torch.bool).tril()
    return m


def torch_measures(X0, X1, valid, basis, dim):
    """gamma, gamma_before, rho (m,) against the m bases (m, d, k) — or, per system,
    (B, m, d, k) — and the consensus measures of X1: the same maths as powerlens."""
    w = valid.to(X1.dtype)
    tot = w.sum()
    spec = "bnd,mdk->bnmk" if basis.dim() == 3 else "bnd,bmdk->bnmk"

    def gam(X):
        C = torch.einsum(spec, X, basis)
        return C.norm(dim=-1) / X.norm(dim=-1, keepdim=True)          # (B, n, m)
    g0, g1 = gam(X0), gam(X1)
    wm = lambda a: (a * w[..., None]).sum((0, 1)) / tot
    defined = dim > 0
    nan = torch.tensor(float("nan"))
    gamma = torch.where(defined, wm(g1), nan)
    gamma_b = torch.where(defined, wm(g0), nan)
    rho = torch.where(defined, wm((g1 > g0).to(X1.dtype)), nan)
    cnt = w.sum(1, keepdim=True)
    mean = (X1 * w[..., None]).sum(1, keepdim=True) / cnt[..., None]
    R = (X1 - mean) * w[..., None]
    Xw = X1 * w[..., None]
    mu = (R.pow(2).sum((1, 2)) / Xw.pow(2).sum((1, 2))).sqrt()
    n1inf = lambda A: A.abs().sum(1).amax(-1) * A.abs().sum(2).amax(-1)
    res = (n1inf(R) / n1inf(Xw)).sqrt()
    s = ((w / X1.norm(dim=-1))[..., None] * X1).sum(1)
    pc = ((s * s).sum(-1) - cnt[:, 0]) / (cnt[:, 0] * (cnt[:, 0] - 1)).clamp(min=1)
    return gamma, gamma_b, rho, mu, res, pc


def torch_run(cfg, params, schedule, X, valid, rule, subs=None):
    """All states (T+1, B, n, d), or with ``subs`` the final state and the per-step measures."""
    B, n, d = X.shape
    mask = torch_mask(cfg, valid)
    rope = rope_tables(n, cfg.d_head, cfg.rope_theta) if cfg.rope_theta else None
    states, meas = [X], []
    for t, u in enumerate(schedule):
        Y = torch_step(cfg, params[u], X, mask, rope, rule)
        if subs is None:
            states.append(Y)
        else:
            meas.append(torch_measures(X, Y, valid, subs[0][u], subs[1][u]))
        X = Y
    return torch.stack(states) if subs is None else (X, meas)


# --------------------------------------------------------------------------- workloads

def prompts(model, B, n, seed=0):
    rng = np.random.default_rng(seed)
    vocab = model.embeddings["word"].shape[0]
    ids = rng.integers(5, min(vocab, 20000), size=(B, n))
    valid = np.ones((B, n), bool)
    if B > 1:
        valid[-1, n // 2:] = False                                   # one padded prompt
    x0, v = pl.embed_ids(model, ids, valid)
    return np.asarray(x0), np.asarray(v)


def workload_a(models, sizes, repeat, report):
    for name, model in models.items():
        L = model.layers
        cfg = L.config
        params = torch_layers(L)
        spectra = pl.layer_spectra(np.asarray(pl.layer_matrices(L)))
        subs = pl.reference_subspaces(spectra)
        tsubs = (torch.from_numpy(np.asarray(subs.basis)), torch.from_numpy(np.asarray(subs.dim)))
        sched = list(L.schedule)
        for B, n in sizes.get(name, sizes["*"]):
            x0, valid = prompts(model, B, n)
            tx, tv = torch.from_numpy(x0), torch.from_numpy(valid)
            for rule in ("paper", "full"):
                # equality
                ours = np.asarray(pl.run_states(model, x0, valid, rule=rule)[-1])
                with torch.inference_mode():
                    theirs = torch_run(cfg, params, sched, tx, tv, rule)[-1].numpy()
                err = float(np.max(np.abs(ours - theirs)[valid]) / max(np.max(np.abs(theirs[valid])), 1e-30))
                t_pl = best_of(jax_call(lambda: pl.run_states(model, x0, valid, rule=rule)), repeat)

                def t_states():
                    with torch.inference_mode():
                        torch_run(cfg, params, sched, tx, tv, rule)
                t_t = best_of(t_states, repeat)
                line = dict(workload="A", model=name, size=f"{B}x{n}", rule=rule, what="states",
                            powerlens_s=t_pl, torch_s=t_t, ratio=t_t / t_pl, rel_err=err)
                report(line)
                if rule == "paper":
                    t_pm = best_of(jax_call(lambda: pl.simulate_batch(model.layers, x0, subs, valid=valid,
                                                                       rule=rule)), repeat)

                    def t_meas():
                        with torch.inference_mode():
                            torch_run(cfg, params, sched, tx, tv, rule, tsubs)
                    t_tm = best_of(t_meas, repeat)
                    report(dict(workload="A", model=name, size=f"{B}x{n}", rule=rule, what="measures",
                                powerlens_s=t_pm, torch_s=t_tm, ratio=t_tm / t_pm,
                                measures_over_states=t_pm / t_pl))


def workload_b(model, steps, repeat, report):
    L = model.layers.shared(3, steps)
    cfg = L.config
    params = torch_layers(L)
    x0, valid = prompts(model, 1, 32)
    fake = model.replace(layers=L)
    ours = np.asarray(pl.run_states(fake, x0, valid, rule="paper")[-1])
    tx, tv = torch.from_numpy(x0), torch.from_numpy(valid)
    with torch.inference_mode():
        theirs = torch_run(cfg, params, [0] * steps, tx, tv, "paper")[-1].numpy()
    err = float(np.max(np.abs(ours - theirs)))
    t_pl = best_of(jax_call(lambda: pl.run_states(fake, x0, valid, rule="paper")), repeat)

    def t_torch():
        with torch.inference_mode():
            torch_run(cfg, params, [0] * steps, tx, tv, "paper")
    t_t = best_of(t_torch, repeat)
    report(dict(workload="B", model="minilm layer 3", size="1x32", rule="paper", what=f"T={steps}",
                powerlens_s=t_pl, torch_s=t_t, ratio=t_t / t_pl, abs_err=err))


def workload_c(model, repeat, report):
    L = model.layers
    cfg = L.config
    x0, valid = prompts(model, 4, 32)
    u = np.random.default_rng(1).standard_normal(cfg.d_model).astype(np.float32)
    u /= np.linalg.norm(u)
    ju, jv = jnp.asarray(u), jnp.asarray(valid)

    def loss(W_o_last, layers, x):
        lay = layers.replace(W_o=layers.W_o.at[-1].set(W_o_last))
        Y = jax.vmap(lambda x1, v1: pl.run(lay, x1, v1, rule="paper", attention="softmax",
                                           observers={"final": pl.final()})["final"])(x, jv)
        g = jnp.abs(Y @ ju) / jnp.linalg.norm(Y, axis=-1)
        return jnp.sum(g * jv) / jnp.sum(jv)
    grad = jax.jit(jax.grad(loss))
    jx = jnp.asarray(x0)
    gj = np.asarray(grad(L.W_o[-1], L, jx))
    params = torch_layers(L)
    tx, tv, tu = torch.from_numpy(x0), torch.from_numpy(valid), torch.from_numpy(u)
    sched = list(L.schedule)

    def torch_grad():
        W = params[-1]["W_o"].clone().requires_grad_(True)
        ps = params[:-1] + [dict(params[-1], W_o=W)]
        Y = torch_run(cfg, ps, sched, tx, tv, "paper")[-1]
        g = (Y @ tu).abs() / Y.norm(dim=-1)
        val = (g * tv).sum() / tv.sum()
        val.backward()
        return W.grad
    gt = torch_grad().numpy()
    err = float(np.max(np.abs(gj - gt)) / np.max(np.abs(gt)))
    t_pl = best_of(jax_call(lambda: grad(L.W_o[-1], L, jx)), repeat)
    t_t = best_of(torch_grad, repeat)
    report(dict(workload="C", model="minilm", size="4x32", rule="paper", what="grad W_o",
                powerlens_s=t_pl, torch_s=t_t, ratio=t_t / t_pl, rel_err=err))


def workload_d(S, T, repeat, report):
    sys.path.insert(0, HERE)
    from simulate import build                                       # the benchmark's own systems
    d, heads, n = 64, 4, 32
    _, stacked, subs, X0 = build(S, d, heads, n, T)
    valid = jnp.ones(X0.shape[:2], bool)
    run = jax.jit(lambda lay, x, s: jax.vmap(lambda l1, x1, s1: pl.simulate(l1, x1, s1))(lay, x, s))
    tr = run(stacked, X0, subs)
    # torch: bmm over the S systems (one shared layer each), the same measures
    Wq, Wk, Wv, Wo = (torch.from_numpy(np.asarray(getattr(stacked, k))[:, 0]) for k in ("W_q", "W_k", "W_v", "W_o"))
    scale = torch.from_numpy(np.asarray(stacked.scale)[:, 0])
    basis = torch.from_numpy(np.asarray(subs.basis)[:, 0])             # (S, m, d, k)
    dims = torch.from_numpy(np.asarray(subs.dim)[:, 0])                # (S, m)
    valid_t = torch.ones(S, n, dtype=torch.bool)
    e = Wq.shape[2]

    def torch_sweep():
        X = torch.from_numpy(np.asarray(X0))
        out = []
        for _ in range(T):
            q = torch.einsum("snd,shed->shne", X, Wq)
            k = torch.einsum("snd,shed->shne", X, Wk)
            v = torch.einsum("snd,shed->shne", X, Wv)
            A = torch.softmax(scale[:, None, None, None] * q @ k.transpose(-1, -2), -1)
            M = (A @ v).transpose(1, 2).reshape(S, n, heads * e)
            Y = TF.normalize(X + M @ Wo.transpose(1, 2), dim=-1)
            out.append(torch_measures(X, Y, valid_t, basis, dims[0]))   # pooled over systems
            X = Y
        return X
    with torch.inference_mode():
        fin = torch_sweep().numpy()
    err = float(np.max(np.abs(np.asarray(tr.final) - fin)))
    t_pl = best_of(jax_call(lambda: run(stacked, X0, subs)), repeat)

    def t_torch():
        with torch.inference_mode():
            torch_sweep()
    t_t = best_of(t_torch, repeat)
    report(dict(workload="D", model=f"{S} synthetic systems", size=f"{S}x{n}", rule="paper", what=f"T={T}",
                powerlens_s=t_pl, torch_s=t_t, ratio=t_t / t_pl, abs_err=err))


def try_compile(model, report):
    """torch.compile on the paper-rule states of MiniLM at 8x128: its time, or why it fails."""
    L = model.layers
    cfg, params, sched = L.config, torch_layers(L), list(L.schedule)
    x0, valid = prompts(model, 8, 128)
    tx, tv = torch.from_numpy(x0), torch.from_numpy(valid)
    try:
        f = torch.compile(lambda x, v: torch_run(cfg, params, sched, x, v, "paper")[-1])
        with torch.inference_mode():
            f(tx, tv)
        t = best_of(lambda: f(tx, tv), 3)
        report(dict(workload="A", model="minilm", size="8x128", rule="paper", what="torch.compile", torch_s=t))
    except Exception as exc:                                          # noqa: BLE001 - reported
        report(dict(workload="A", model="minilm", size="8x128", rule="paper", what="torch.compile",
                    error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the small configuration the test suite runs")
    ap.add_argument("--only", default="A,B,C,D", help="workloads to run, comma separated")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile attempt")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    only = set(args.only.split(","))
    lines = []

    def report(line):
        lines.append(line)
        keys = ("workload", "model", "size", "rule", "what")
        head = " ".join(str(line.get(k, "")) for k in keys)
        nums = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in line.items() if k not in keys)
        print(f"{head:<45} {nums}", flush=True)

    gj, gt = matmul_rates(1 if args.tiny else 3)
    print(f"matmul 2048^3 float32: jax {gj:.0f} GFLOP/s, torch {gt:.0f} GFLOP/s (torch threads "
          f"{torch.get_num_threads()})")
    minilm = pl.load("minilm")
    if args.tiny:
        sizes = {"*": [(1, 16), (2, 8)]}
        models = {"minilm": minilm}
    else:
        sizes = {"*": [(1, 16), (8, 128), (32, 128), (8, 512)],
                 "smollm2": [(1, 16), (8, 128), (32, 128), (8, 512), (1, 2048)]}
        models = {"minilm": minilm, "smollm2": pl.load("smollm2")}
    if "A" in only:
        workload_a(models, sizes, args.repeat, report)
        if not args.tiny and not args.no_compile:
            try_compile(minilm, report)
    if "B" in only:
        workload_b(minilm, 20 if args.tiny else 1000, args.repeat, report)
    if "C" in only:
        workload_c(minilm, args.repeat, report)
    if "D" in only:
        workload_d(8 if args.tiny else 256, 10 if args.tiny else 200, args.repeat, report)
    ratios = [x["ratio"] for x in lines if x.get("what") == "states" and "ratio" in x]
    if ratios:
        print(f"A states only: min {min(ratios):.2f}x, median {float(np.median(ratios)):.2f}x over "
              f"{len(ratios)} (model, size, rule)")
    return lines


if __name__ == "__main__":
    main()
