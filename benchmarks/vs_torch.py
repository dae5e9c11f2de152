"""powerlens against the torch code a researcher would write instead, in one process.

Both frameworks run on all cores, float32, on the same weights; every workload first checks
that the two agree, then times each side (best of ``--repeat``, and of as many calls as fit in
``MIN_SECONDS``, after a warm-up; JAX with
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
       ``jax.grad`` against torch autograd. Two JAX forms: the first U-1 layers run forward
       and only the last is differentiated (what torch autograd does by itself, as only
       W_o_last requires grad), and the whole scan differentiated (4x the work).
    D  the sweep of ``benchmarks/simulate.py`` (S synthetic systems, d = 64, n = 32, 4 heads,
       T = 200, every measure): ``pl.simulate_sweep`` (the systems split over the CPU cores as
       host devices, micro-batches of 8 per vmap) against the same maths in batched torch
       (bmm over systems).
    E  gradient steering (``benchmarks/steering.py``'s problem: MiniLM's last layer, rank-1
       ``lowrank``, worst-token |cos| >= 0.9, 200 Adam steps) over 64 directions: the vmapped
       optimiser (``solve_many_jit``; and end to end ``pl.optimize_steering``) against the same
       steps batched over the directions in torch (one (64, ...) tensor per parameter,
       ``torch.optim.Adam`` with the same hyper-parameters and a ``LambdaLR`` equal to optax's
       cosine decay). Equality: float64 on both sides over the first 40 steps, and float32
       at full length read against float32's own spread (see ``workload_e``).

Run ``python benchmarks/vs_torch.py`` (add ``--tiny`` for the small configuration the test
suite runs, ``--only A,B`` to pick workloads, ``--models minilm --sizes 8x128`` to narrow A).
The matmul ceiling (a 2048^3 float32 matmul in each framework) is printed first, and again
after workload A, followed by each paper-rule row's matmul rate (its matmul FLOPs over its
time, :func:`paper_flops`) as a fraction of the faster of JAX's two large-matmul rates. Each
line prints the powerlens / torch speed ratio (> 1: powerlens is faster). At the end the run
writes ``docs/benchmarks/vs_torch.md`` (``benchmarks/benchdoc.py``: the command, the date, the
CPU and the versions, then workload A as a table, :func:`workload_a_table`, B-E as another,
:func:`bcde_table`, and the printed output); ``--tiny`` writes none unless given ``--doc``.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

# Every CPU core a JAX host device, as benchmarks/simulate.py does, so that D's sweep splits its
# systems over the cores (pl.simulate_sweep); set before jax is imported. A single-device
# program (A-C, E) runs on the first device, as without the flag.
# Only when run as a script: imported (by the tests), it must not change their subprocesses.
if __name__ == "__main__" and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={os.cpu_count() or 1}").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

import benchdoc  # noqa: E402
import powerlens as pl  # noqa: E402


# --------------------------------------------------------------------------- timing

MIN_SECONDS = 2.0
"""A fast call is timed until this many seconds are spent on it (at most 200 samples, at least
``repeat``), in turns with the other side (:func:`best_of_each`), so that a slow phase of a
shared machine falls on both sides of a ratio (why 2 s: docs/performance.md, "Timing")."""


@dataclasses.dataclass(frozen=True)
class Timing:
    """How each call is timed: at least ``repeat`` calls and ``min_seconds`` (:data:`MIN_SECONDS`;
    0 in the test suite's ``--tiny`` run, which checks equality and times nothing to trust)."""
    repeat: int = 3
    min_seconds: float = MIN_SECONDS


BLOCK_SECONDS = 0.1
""":func:`best_of_each` times each call for a block of this many seconds, and at least two calls
(the first after the other side's turn finds cold caches and sleeping threads), before the
next call's turn."""


def best_of_each(fns, timing: Timing) -> dict:
    """{name: best time} of the calls ``fns`` {name: fn}, timed in turns of blocks (a a a, b b b,
    a a a, ...; :data:`BLOCK_SECONDS`) so that the machine's slow and fast phases fall on every
    side of a ratio alike; each at least ``timing.repeat`` times and until ``timing.min_seconds``
    are spent on it (at most 200 samples). Blocks, not single calls: right after the other
    framework ran, a JAX call finds XLA's worker threads asleep (MiniLM 4 x 32: 7.3-8.0 ms in a
    block, 8.9-10.6 ms alternating call by call with torch), which a user's loop of JAX calls
    never sees."""
    for fn in fns.values():
        fn()                                    # warm-up (compiles)
    times = {name: [] for name in fns}
    more = lambda t: len(t) < timing.repeat or (sum(t) < timing.min_seconds and len(t) < 200)
    while any(more(t) for t in times.values()):
        for name, fn in fns.items():
            block, calls = 0.0, 0
            while more(times[name]) and (calls < 2 or block < BLOCK_SECONDS):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
                block, calls = block + times[name][-1], calls + 1
    return {name: min(t) for name, t in times.items()}


def best_of(fn, timing: Timing) -> float:
    return best_of_each({"one": fn}, timing)["one"]


def best_of_pair(ours, theirs, timing: Timing):
    """(best time of ``ours``, best time of ``theirs``), timed in turns (:func:`best_of_each`)."""
    t = best_of_each({"ours": ours, "theirs": theirs}, timing)
    return t["ours"], t["theirs"]


def jax_call(f):
    return lambda: jax.block_until_ready(f())


def paper_flops(cfg, steps: int, B: int, n: int) -> float:
    """The matmul FLOPs of ``steps`` paper-rule layers on B prompts of n tokens: the fused q/k/v
    projection 2 n d (H + 2G) e, the scores and the value mix 2 H n^2 e each (every key, as
    dense attention computes them), the output projection 2 n H e d."""
    d, H, G, e = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    per_prompt = 2 * n * d * (H + 2 * G) * e + 2 * 2 * H * n * n * e + 2 * n * H * e * d
    return float(steps * B * per_prompt)


def matmul_rates(timing: Timing):
    n = 2048
    a = np.random.default_rng(0).standard_normal((n, n), np.float32)
    ja = jnp.asarray(a)
    mm = jax.jit(lambda x: x @ x)
    ta = torch.from_numpy(a)
    tj, tt = best_of_pair(jax_call(lambda: mm(ja)), lambda: ta @ ta, timing)
    flops = 2 * n ** 3
    return flops / tj / 1e9, flops / tt / 1e9


# --------------------------------------------------------------------------- torch side

def torch_layers(layers):
    """The unique layers' arrays as torch tensors, one dict per layer; the scalar attention
    scale as a Python float (SDPA takes a float: a tensor's ``.item()`` is a graph break
    under ``torch.compile``)."""
    arrs = {k: np.asarray(a) for k, a in layers.arrays().items()}
    out = [{k: float(v[u]) if k == "scale" else torch.from_numpy(np.array(v[u])) for k, v in arrs.items()}
           for u in range(layers.n_unique)]
    for p in out:                       # the fused projection a researcher writes: one (d, (H+2G) e) matmul
        if "W_q" in p and "W_k" in p:
            d = p["W_v"].shape[-1]
            p["W_qkv_T"] = torch.cat([p["W_q"].reshape(-1, d), p["W_k"].reshape(-1, d),
                                      p["W_v"].reshape(-1, d)], 0).T.contiguous()
    return out


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
    q, k, v = (X @ p["W_qkv_T"]).split([H * e, G * e, G * e], dim=-1)    # fused q/k/v: one matmul
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
    return np.array(x0), np.array(v)                                  # writable: torch.from_numpy


def workload_a(models, sizes, timing, report):
    for name, model in models.items():
        L = model.layers
        cfg = L.config
        params = torch_layers(L)
        spectra = pl.layer_spectra(np.asarray(pl.layer_matrices(L)))
        subs = pl.reference_subspaces(spectra)
        tsubs = (torch.from_numpy(np.array(subs.basis)), torch.from_numpy(np.array(subs.dim)))
        sched = list(L.schedule)
        for B, n in sizes.get(name, sizes["*"]):
            x0, valid = prompts(model, B, n)
            tx, tv = torch.from_numpy(x0), torch.from_numpy(valid)
            for rule in ("paper", "full"):
                # equality
                ours = np.asarray(pl.run_states(model, x0, valid, dynamics=pl.Dynamics(rule=rule))[-1])
                with torch.inference_mode():
                    theirs = torch_run(cfg, params, sched, tx, tv, rule)[-1].numpy()
                err = float(np.max(np.abs(ours - theirs)[valid]) / max(np.max(np.abs(theirs[valid])), 1e-30))

                def t_states():
                    with torch.inference_mode():
                        torch_run(cfg, params, sched, tx, tv, rule)

                def t_meas():
                    with torch.inference_mode():
                        torch_run(cfg, params, sched, tx, tv, rule, tsubs)
                fns = {"pl": jax_call(lambda: pl.run_states(model, x0, valid, dynamics=pl.Dynamics(rule=rule))),
                       "torch": t_states}
                if rule == "paper":                  # every measure; timed in turns with the states
                    fns.update(pl_meas=jax_call(lambda: pl.simulate_batch(model.layers, x0, subs, valid=valid,
                                                                          dynamics=pl.Dynamics(rule=rule))), torch_meas=t_meas)
                t = best_of_each(fns, timing)
                report(dict(workload="A", model=name, size=f"{B}x{n}", rule=rule, what="states",
                            powerlens_s=t["pl"], torch_s=t["torch"], ratio=t["torch"] / t["pl"], rel_err=err))
                if rule == "paper":
                    report(dict(workload="A", model=name, size=f"{B}x{n}", rule=rule, what="measures",
                                powerlens_s=t["pl_meas"], torch_s=t["torch_meas"],
                                ratio=t["torch_meas"] / t["pl_meas"], measures_over_states=t["pl_meas"] / t["pl"]))


def workload_b(model, steps, timing, report):
    L = model.layers.shared(3, steps)
    cfg = L.config
    params = torch_layers(L)
    x0, valid = prompts(model, 1, 32)
    fake = model.replace(layers=L)
    ours = np.asarray(pl.run_states(fake, x0, valid, dynamics=pl.Dynamics())[-1])
    tx, tv = torch.from_numpy(x0), torch.from_numpy(valid)
    with torch.inference_mode():
        theirs = torch_run(cfg, params, [0] * steps, tx, tv, "paper")[-1].numpy()
    err = float(np.max(np.abs(ours - theirs)))

    def t_torch():
        with torch.inference_mode():
            torch_run(cfg, params, [0] * steps, tx, tv, "paper")
    t_pl, t_t = best_of_pair(jax_call(lambda: pl.run_states(fake, x0, valid, dynamics=pl.Dynamics())), t_torch, timing)
    report(dict(workload="B", model="minilm layer 3", size="1x32", rule="paper", what=f"T={steps}",
                powerlens_s=t_pl, torch_s=t_t, ratio=t_t / t_pl, abs_err=err))


def workload_c(model, timing, report):
    L = model.layers
    cfg = L.config
    x0, valid = prompts(model, 4, 32)
    u = np.random.default_rng(1).standard_normal(cfg.d_model).astype(np.float32)
    u /= np.linalg.norm(u)
    ju, jv = jnp.asarray(u), jnp.asarray(valid)

    U = L.n_unique

    def final(lay, x):
        return jax.vmap(lambda x1, v1: pl.run(lay, x1, v1, dynamics=pl.Dynamics(),
                                              observers={"final": pl.final()})["final"])(x, jv)

    def score(Y):
        g = jnp.abs(Y @ ju) / jnp.linalg.norm(Y, axis=-1)
        return jnp.sum(g * jv) / jnp.sum(jv)

    def loss_scan(W_o_last, layers, x):
        """The whole scan differentiated: W_o_last enters the stacked W_o, so every step's
        gather carries a cotangent and the backward pass runs through all U layers."""
        return score(final(layers.replace(W_o=layers.W_o.at[-1].set(W_o_last)), x))

    def loss(W_o_last, head, last, x):
        """The first U-1 layers forward, then the last one with W_o_last: only the last layer
        is differentiated, as torch autograd does on its own (only W_o_last requires grad)."""
        return score(final(last.replace(W_o=W_o_last[None]), final(head, x)))
    grad, grad_scan = jax.jit(jax.grad(loss)), jax.jit(jax.grad(loss_scan))
    jx = jnp.asarray(x0)
    # split once, as torch's params[:-1] and params[-1] are: the head is every layer under a
    # schedule of the first U-1 (no copy of its arrays), the last layer's arrays are taken once
    head, last = L.with_schedule(range(U - 1)), L.select([U - 1])
    gj = np.asarray(grad(L.W_o[-1], head, last, jx))
    gj_scan = np.asarray(grad_scan(L.W_o[-1], L, jx))
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
    W_last = L.W_o[-1]            # the parameter held once, as JAX code does (torch's clone is per call)
    variants = (("grad W_o", gj, lambda: grad(W_last, head, last, jx)),
                ("grad W_o whole scan", gj_scan, lambda: grad_scan(W_last, L, jx)))
    t = best_of_each({"torch": torch_grad, **{what: jax_call(f) for what, _, f in variants}}, timing)
    for what, g, f in variants:
        err = float(np.max(np.abs(g - gt)) / np.max(np.abs(gt)))
        report(dict(workload="C", model="minilm", size="4x32", rule="paper", what=what,
                    powerlens_s=t[what], torch_s=t["torch"], ratio=t["torch"] / t[what], rel_err=err))


def to_float64(a):
    """A float32 array as a float64 JAX array (call under ``jax.enable_x64``); others unchanged."""
    return jnp.asarray(np.asarray(a, np.float64)) if np.asarray(a).dtype == np.float32 else a


def workload_d(S, T, timing, report, check_steps=10):
    """The sweep of benchmarks/simulate.py. Equality: a few of the random systems amplify a
    rounding difference by ~1e6 or more within tens of steps (the first 64 systems in float64,
    both sides: the largest final difference 7.5e-12 after 25 steps, 1.5e-6 after 50; of all
    256 after 200 steps, 0.46), so one number cannot show it. Reported: ``abs_err``, the
    largest |difference| of a final token over the S systems in float32; ``abs_err_median``,
    the median over the systems of each one's largest; ``apart``, how many systems end more
    than 1e-4 apart; ``f64_abs_err``, the largest with both sides in float64 from the same
    inputs over the first ``check_steps`` steps (the same maths)."""
    from simulate import build                                       # the benchmark's own systems
    d, heads, n = 64, 4, 32
    _, stacked, subs, X0 = build(S, d, heads, n, T)
    run = pl.simulate_sweep                  # the systems over the cores (host devices), micro-batched
    tr = run(stacked, X0, subs)
    valid_t = torch.ones(S, n, dtype=torch.bool)

    def torch_sweep_of(dtype, steps=T):
        """The torch sweep of ``steps`` steps in ``dtype``: bmm over the S systems (one shared
        layer each), the same measures."""
        Wq, Wk, Wv, Wo = (torch.from_numpy(np.array(getattr(stacked, k))[:, 0]).to(dtype)
                          for k in ("W_q", "W_k", "W_v", "W_o"))
        scale = torch.from_numpy(np.array(stacked.scale)[:, 0]).to(dtype)
        basis = torch.from_numpy(np.array(subs.basis)[:, 0]).to(dtype)  # (S, m, d, k)
        dims = torch.from_numpy(np.array(subs.dim)[:, 0])                # (S, m)
        e = Wq.shape[2]

        def sweep():
            X = torch.from_numpy(np.array(X0)).to(dtype)
            out = []
            for _ in range(steps):
                q = torch.einsum("snd,shed->shne", X, Wq)
                k = torch.einsum("snd,shed->shne", X, Wk)
                v = torch.einsum("snd,shed->shne", X, Wv)
                A = torch.softmax(scale[:, None, None, None] * q @ k.transpose(-1, -2), -1)
                M = (A @ v).transpose(1, 2).reshape(S, n, heads * e)
                Y = TF.normalize(X + M @ Wo.transpose(1, 2), dim=-1)
                out.append(torch_measures(X, Y, valid_t, basis, dims[0]))   # pooled over systems
                X = Y
            return X
        return sweep

    torch_sweep = torch_sweep_of(torch.float32)
    check = min(T, check_steps)
    with torch.inference_mode():
        fin, fin64 = torch_sweep().numpy(), torch_sweep_of(torch.float64, check)().numpy()
    per_system = np.abs(np.asarray(tr.final) - fin).reshape(S, -1).max(axis=1)
    with jax.enable_x64(True):
        tree64 = lambda t: jax.tree_util.tree_map(to_float64, t)
        short = tree64(stacked).with_schedule([0] * check)
        ours64 = np.asarray(run(short, to_float64(X0), tree64(subs)).final)
    f64_err = float(np.max(np.abs(ours64 - fin64)))

    def t_torch():
        with torch.inference_mode():
            torch_sweep()
    t_pl, t_t = best_of_pair(jax_call(lambda: run(stacked, X0, subs)), t_torch, timing)
    report(dict(workload="D", model=f"{S} synthetic systems", size=f"{S}x{n}", rule="paper", what=f"T={T}",
                powerlens_s=t_pl, torch_s=t_t, ratio=t_t / t_pl, abs_err=float(per_system.max()),
                abs_err_median=float(np.median(per_system)), apart=f"{int(np.sum(per_system > 1e-4))}/{S}",
                f64_abs_err=f64_err, f64_steps=check))


# --------------------------------------------------------------------------- workload E

E_SENTENCES = ["The cat sat quietly on the warm windowsill.",
               "Power iteration finds the dominant eigenvector of a matrix."]


def e_config(steps):
    """The optimiser of ``benchmarks/steering.py``: MiniLM's last layer, rank-1 ``lowrank``, sign-free
    worst-token alignment 0.9, w from the value map, Adam with a cosine decay, augmented Lagrangian."""
    return dict(target=0.9, reduce="min", signed=False, rank=1, steps=steps, lr=1e-2, mu=100.0, dual_every=10,
                tol=1e-4, lr_floor=0.05, bisect_iters=40)


def torch_row_basis(rows, tol=1e-10):
    """Orthonormal basis (dim, k) of the span of ``rows`` (float64 SVD), as powerlens's ``_row_basis``."""
    _, sv, Vt = torch.linalg.svd(rows.to(torch.float64), full_matrices=False)
    k = max(int((sv > tol * sv[0]).sum()), 1)
    return Vt[:k].T


def torch_steer_problem(cfg, params, sched, tx, tv):
    """The torch user's preparation: the tokens entering the last layer (every earlier layer, paper rule,
    SDPA), that layer's pre-norm output p = X + Attn(X) (B, n, d) and head mix m (B, n, H e) (Attn = m W_o^T),
    the bases of span(p_i) and span(m_i) over the valid tokens, and V_cat (H e, d)."""
    X = torch_run(cfg, params, sched[:-1], tx, tv, "paper")[-1]
    p_last = params[sched[-1]]
    He = p_last["W_o"].shape[1]
    mix = dict(p_last, W_o=torch.eye(He))
    rope = rope_tables(X.shape[1], cfg.d_head, cfg.rope_theta) if cfg.rope_theta else None
    m = torch_attention(mix, X, torch_mask(cfg, tv), cfg, rope, False)
    p = X + m @ p_last["W_o"].T
    Bp = torch_row_basis(p[tv]).to(p.dtype)
    Bm = torch_row_basis(m[tv]).to(p.dtype)
    G = cfg.n_kv_heads
    V = p_last["W_v"].repeat_interleave(cfg.n_heads // G, dim=0).reshape(He, -1)
    return p, m, Bp, Bm, V


def torch_steer(p, m, valid, Bp, Bm, R, U, P0noise, Q0noise, *, target, reduce, signed, rank, steps, lr, mu,
                dual_every, tol, lr_floor, bisect_iters):
    """powerlens's ``solve_one`` (param ``lowrank``, w ``value``, the reduced problem of a last
    paper-rule layer), batched over the K directions U (K, d) in one tensor, with ``torch.optim.Adam``
    (b1 0.9, b2 0.999, eps 1e-8, as optax.adam) and a ``LambdaLR`` cosine decay equal to
    ``optax.cosine_decay_schedule(lr, steps, alpha=lr_floor)``. The K problems are independent, so
    one backward of the sum of their losses gives each its own gradient."""
    K = U.shape[0]
    B, n, _ = p.shape
    f = dict(dtype=p.dtype)                                              # float32, or float64 for the check
    inf = torch.tensor(float("inf"), **f)
    w_cf = U @ R.T                                                       # (K, H e)
    w_cf = w_cf / w_cf.norm(dim=-1, keepdim=True)
    pu = torch.einsum("bnd,kd->kbn", p, U)                               # (K, B, n)
    pp = (p * p).sum(-1)                                                 # (B, n)
    c_u = U @ Bp                                                         # (K, k_p)
    q = U - c_u @ Bp.T
    nq = q.norm(dim=-1)
    big = nq > 1e-6
    q_hat = torch.where(big[:, None], q / torch.where(big, nq, torch.ones_like(nq))[:, None], torch.zeros_like(q))
    p_red = torch.cat([p @ Bp, torch.zeros(B, n, 1, **f)], -1)               # (B, n, k_p + 1)
    m_red = m @ Bm                                                       # (B, n, k_m)
    u_red = torch.cat([c_u, nq[:, None]], -1)                            # (K, k_p + 1)

    def align_cos(yu, yy):
        cos = yu / yy.sqrt()
        cos = cos if signed else cos.abs()
        if reduce == "mean":
            w = valid.to(cos.dtype)
            return (cos * w).sum((1, 2)) / w.sum().clamp(min=1.0)
        return torch.where(valid, cos, inf).amin((1, 2))

    mw = torch.einsum("bne,ke->kbn", m, w_cf)

    def ray(log_a):
        c = log_a.exp()[:, None, None] * mw
        return align_cos(pu + c, pp + 2.0 * c * pu + c * c)

    with torch.no_grad():                                               # closed form at the target: bisection
        lo, hi = torch.full((K,), -14.0, **f), torch.full((K,), 14.0, **f)
        cf_feasible = ray(hi) >= target
        for _ in range(bisect_iters):
            mid = 0.5 * (lo + hi)
            ok = ray(mid) >= target
            lo, hi = torch.where(ok, lo, mid), torch.where(ok, mid, hi)
        n0 = hi.exp() * w_cf.norm(dim=-1)
        cf_align = ray(hi)
        w0 = (w_cf / w_cf.norm(dim=-1, keepdim=True)) @ Bm                # (K, k_m)
        P0, Q0 = P0noise.clone(), Q0noise.clone()
        P0[:, :, 0], Q0[:, :, 0] = u_red, w0

    def align_lowrank(P, Q):
        a = n0[:, None, None, None] * torch.einsum("bnm,kmr->kbnr", m_red, Q)
        Pu = (P * u_red[:, :, None]).sum(1)                             # (K, r)
        G = torch.einsum("kir,kis->krs", P, P)
        yu = pu + (a * Pu[:, None, None, :]).sum(-1)
        aG = torch.einsum("kbnr,krs->kbns", a, G)
        yy = pp + 2.0 * (a * torch.einsum("bni,kir->kbnr", p_red, P)).sum(-1) + (aG * a).sum(-1)
        return align_cos(yu, yy)

    def objective(P, Q, lam):
        N = (torch.einsum("kir,kis->krs", P, P) * torch.einsum("kir,kis->krs", Q, Q)).sum((1, 2))
        a = align_lowrank(P, Q)
        g = target - a
        L = N + (torch.maximum(torch.zeros_like(g), lam + mu * g).square() - lam * lam) / (2.0 * mu)
        return L, a, N

    P = P0.clone().requires_grad_(True)
    Q = Q0.clone().requires_grad_(True)
    opt = torch.optim.Adam([P, Q], lr=lr, betas=(0.9, 0.999), eps=1e-8)
    decay = lambda i: (1 - lr_floor) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)) + lr_floor
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    lam = torch.zeros(K, **f)
    hist_a, hist_N = [], []
    best_P, best_Q = P0.clone(), Q0.clone()
    best_N, best_a = torch.full((K,), float("inf"), **f), torch.full((K,), -float("inf"), **f)
    for i in range(steps):
        L, a, N = objective(P, Q, lam)
        hist_a.append(a.detach())
        hist_N.append(N.detach())
        opt.zero_grad(set_to_none=True)
        L.sum().backward()
        with torch.no_grad():
            better = (a >= target - tol) & (N < best_N)
            best_P = torch.where(better[:, None, None], P, best_P)
            best_Q = torch.where(better[:, None, None], Q, best_Q)
            best_N, best_a = torch.where(better, N, best_N), torch.where(better, a, best_a)
        opt.step()
        sched.step()
        if (i + 1) % dual_every == 0:
            lam = torch.clamp(lam + mu * (target - a.detach()), min=0.0)
    with torch.no_grad():                                               # the last iterate is checked too
        _, a, N = objective(P, Q, lam)
        better = (a >= target - tol) & (N < best_N)
        best_P = torch.where(better[:, None, None], P, best_P)
        best_Q = torch.where(better[:, None, None], Q, best_Q)
        best_N, best_a = torch.where(better, N, best_N), torch.where(better, a, best_a)
        found = torch.isfinite(best_N)
        fP = n0[:, None, None] * (torch.einsum("di,kir->kdr", Bp, best_P[:, :-1]) + q_hat[:, :, None] * best_P[:, -1:])
        fQ = torch.einsum("ei,kir->ker", Bm, best_Q)
        norm = ((fP.transpose(1, 2) @ fP) * (fQ.transpose(1, 2) @ fQ)).sum((1, 2)).sqrt()
        nan = torch.tensor(float("nan"), **f)
        return {"norm": torch.where(found, norm, nan), "alignment": torch.where(found, best_a, nan),
                "feasible": found, "closed_norm": n0, "closed_alignment": cf_align, "closed_feasible": cf_feasible,
                "history_alignment": torch.stack(hist_a, 1), "history_norm": torch.stack(hist_N, 1).sqrt() * n0[:, None]}


def compare_steering(ours, theirs, prefix=""):
    """||dO|| (median and max relative difference over the directions where both are feasible), the
    closed-form norm (relative) and the alignment reached (absolute), and the feasible counts."""
    g = lambda r, k: np.asarray(r[k], np.float64)
    both = g(ours, "feasible").astype(bool) & g(theirs, "feasible").astype(bool)
    rel = np.abs(g(ours, "norm") - g(theirs, "norm"))[both] / g(theirs, "norm")[both]
    rel_cf = np.abs(g(ours, "closed_norm") - g(theirs, "closed_norm")) / g(theirs, "closed_norm")
    da = np.abs(g(ours, "alignment") - g(theirs, "alignment"))[both]
    stat = lambda f, a: float(f(a)) if a.size else float("nan")
    return {prefix + "norm_rel_median": stat(np.median, rel), prefix + "norm_rel_max": stat(np.max, rel),
            prefix + "closed_rel_max": float(rel_cf.max()), prefix + "align_abs_max": stat(np.max, da),
            prefix + "feasible": f"{int(g(ours, 'feasible').sum())}/{int(g(theirs, 'feasible').sum())}/{len(both)}"}


def history_rel(ours, theirs):
    """The largest relative difference, over directions and Adam steps, of the per-step ||dO|| and
    alignment histories."""
    out = 0.0
    for k in ("history_norm", "history_alignment"):
        a, b = np.asarray(ours[k], np.float64), np.asarray(theirs[k], np.float64)
        out = max(out, float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-300))))
    return out


def workload_e(model, K, steps, timing, report, check_steps=40):
    """The vmapped steering optimiser over K directions against the same Adam steps batched in torch.

    solve: the optimisation alone on the same prepared problem (both sides get the same entering
      tokens, p, m and bases): powerlens's ``solve_many_jit`` (one compiled vmap over the directions,
      the scan over the Adam steps inside; the vmapped optimiser that ``optimize_steering`` calls
      on one device) against ``torch_steer``.
    api: end to end, ``pl.optimize_steering(layers, x0, D)`` against the torch user's whole pipeline
      (``torch_steer_problem`` then ``torch_steer``).

    Equality. The optimisation is chaotic: one float64 rounding difference grows about e-fold every
    4 Adam steps (measured), and float32 rounding changes Adam's first, sign-like steps on
    coordinates whose gradient is at rounding level, so after 200 steps single directions land on
    visibly different iterates in *either* framework (powerlens's own vmapped run against its
    per-direction loop, or against itself in float64, differ as much). Hence three checks:
      f64_hist_rel_max  both sides in float64 for ``check_steps`` steps: the largest relative
                        difference of every per-step ||dO|| and alignment (the same maths: ~1e-12);
      norm_rel_*        float32 at full length: ||dO|| of torch against powerlens, median and max;
      self_rel_*        float32 against float64 powerlens: the spread float32 itself causes, the
                        scale that the float32 differences above are to be read against;
    and closed_rel_max (the bisection for the closed form, not chaotic: float32 rounding, ~1e-6)."""
    from powerlens._src.steering.optimize import AlignSettings, last_layer_terms, prepare_problem, solve_many_jit
    from powerlens._src.steering.rank1 import host_matrices
    L = model.layers
    cfg = L.config
    c = e_config(steps)
    x0, valid = pl.embed(model, E_SENTENCES)
    x0, valid = np.asarray(x0), np.asarray(valid)
    rng = np.random.default_rng(0)
    D = rng.standard_normal((K, cfg.d_model))
    D /= np.linalg.norm(D, axis=1, keepdims=True)
    # the prepared problem (powerlens's own preparation; shared by both sides for "solve")
    X, vb, tail, l, kb = prepare_problem(L, x0, valid)
    assert tail == (l,) and l == L.n_unique - 1, (tail, l)
    _, V, _ = host_matrices(L, l)
    R = jnp.asarray(V, jnp.float32)
    pm = last_layer_terms(L, X, vb, l, kb, "softmax", None)
    U = jnp.asarray(D, jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(0), K)
    kw = dict(layer=l, tail=tail, rule="paper", attention="softmax", keep_bias=kb, target=c["target"],
              reduce=c["reduce"], param="lowrank", rank=c["rank"], steps=steps, lr=c["lr"], mu=c["mu"],
              dual_every=c["dual_every"], tol=c["tol"], w_kind="value", signed=c["signed"],
              bisect_iters=c["bisect_iters"], lr_floor=c["lr_floor"])
    solve = lambda: solve_many_jit(L, X, vb, U, keys, R, None, pm, settings=AlignSettings(**kw))
    ours = jax.tree_util.tree_map(np.asarray, solve())
    # solve_one's initial noise (overwritten in column 0; all of it at rank 1), drawn from the same keys
    kp1, km, r = pm["Bp"].shape[1] + 1, pm["Bm"].shape[1], c["rank"]

    def noise(key):
        k1, k2 = jax.random.split(key)
        return (1e-2 * jax.random.normal(k1, (kp1, r), jnp.float32) / np.sqrt(kp1),
                1e-2 * jax.random.normal(k2, (km, r), jnp.float32) / np.sqrt(km))
    nP, nQ = (torch.from_numpy(np.array(a)) for a in jax.vmap(noise)(keys))
    T = lambda a, dt=None: torch.from_numpy(np.array(a, dt))
    targs = (T(pm["p"]), T(pm["m"]), T(vb), T(pm["Bp"]), T(pm["Bm"]), T(R), T(U), nP, nQ)
    theirs = {k: v.numpy() for k, v in torch_steer(*targs, **c).items()}
    cmp = compare_steering(ours, theirs)
    # float64 on both sides, from the same (float32) inputs
    with jax.enable_x64(True):
        f64 = to_float64
        L64 = jax.tree_util.tree_map(f64, L)
        pm64 = {k: f64(v) for k, v in pm.items()}
        args64 = (L64, f64(X), vb, f64(U), keys, f64(R), None, pm64)
        ours64 = jax.tree_util.tree_map(np.asarray, solve_many_jit(*args64, settings=AlignSettings(**kw)))
        short = dict(kw, steps=min(check_steps, steps))
        ours64s = jax.tree_util.tree_map(np.asarray, solve_many_jit(*args64, settings=AlignSettings(**short)))
    t64 = [a if a.dtype == torch.bool else a.double() for a in targs]
    theirs64s = {k: v.numpy() for k, v in torch_steer(*t64, **dict(c, steps=short["steps"])).items()}
    self_cmp = compare_steering(ours, ours64)
    cmp.update(f64_hist_rel_max=history_rel(ours64s, theirs64s), f64_steps=short["steps"],
               self_rel_median=self_cmp["norm_rel_median"], self_rel_max=self_cmp["norm_rel_max"])
    t_pl, t_t = best_of_pair(jax_call(solve), lambda: torch_steer(*targs, **c), timing)
    report(dict(workload="E", model="minilm last layer", size=f"{K} dirs", rule="paper",
                what=f"solve {steps} Adam steps", powerlens_s=t_pl, torch_s=t_t, ratio=t_t / t_pl, **cmp))
    # end to end: the public API against the torch user's whole pipeline
    api = lambda: pl.optimize_steering(
        L, x0, pl.AlignmentObjective(D, c["target"], c["reduce"], c["signed"]), valid=valid,
        config=pl.SteeringConfig(rank=c["rank"], steps=steps, lr=c["lr"], mu=c["mu"], dual_every=c["dual_every"],
                                 tol=c["tol"], w="value"))
    params, sched = torch_layers(L), list(L.schedule)
    tx, tv, tU = T(x0), T(valid), T(D, np.float32)

    def torch_api():
        with torch.no_grad():
            p, m, Bp, Bm, Vt = torch_steer_problem(cfg, params, sched, tx, tv)
        if Bp.shape[1] + 1 != kp1 or Bm.shape[1] != km:
            raise AssertionError(f"torch bases {Bp.shape}, {Bm.shape} differ from powerlens's ({kp1 - 1}, {km})")
        return torch_steer(p, m, tv, Bp, Bm, Vt, tU, nP, nQ, **c)
    res = api()
    a_ours = {k: getattr(res, k) for k in ("norm", "alignment", "feasible", "closed_norm", "closed_alignment")}
    a_theirs = {k: v.numpy() for k, v in torch_api().items()}
    cmp = compare_steering(a_ours, a_theirs)
    t_pl, t_t = best_of_pair(lambda: api().norm, torch_api, timing)
    report(dict(workload="E", model="minilm last layer", size=f"{K} dirs", rule="paper",
                what=f"api {steps} Adam steps", powerlens_s=t_pl, torch_s=t_t, ratio=t_t / t_pl, **cmp))

def try_compile(model, timing, report):
    """torch.compile on the paper-rule states of MiniLM at 8x128: its time, or why it fails."""
    L = model.layers
    cfg, params, sched = L.config, torch_layers(L), list(L.schedule)
    x0, valid = prompts(model, 8, 128)
    tx, tv = torch.from_numpy(x0), torch.from_numpy(valid)
    try:
        f = torch.compile(lambda x, v: torch_run(cfg, params, sched, x, v, "paper")[-1])
        with torch.inference_mode():
            f(tx, tv)
        t = best_of(lambda: f(tx, tv), timing)
        report(dict(workload="A", model="minilm", size="8x128", rule="paper", what="torch.compile", torch_s=t))
    except Exception as exc:                                          # noqa: BLE001 - reported
        report(dict(workload="A", model="minilm", size="8x128", rule="paper", what="torch.compile",
                    error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))


# --------------------------------------------------------------------------- the results file

MODEL_NAMES = {"minilm": "MiniLM", "smollm2": "SmolLM2"}

A_COLUMNS = ("model", "prompts × tokens", "paper rule, states: powerlens / torch", "ratio",
             "paper rule, every measure: ratio (time over states only)", "full block, states: powerlens / torch",
             "ratio")
"""Workload A's table: one row per model and size; a ratio is torch's time over powerlens's
(> 1: powerlens is faster)."""

AGREEMENT = ("rel_err", "abs_err_median", "f64_abs_err", "norm_rel_median", "f64_hist_rel_max")
"""The fields of a B-E line shown as its agreement with torch (``abs_err`` only where the line
has none of these)."""


def seconds(t: float) -> str:
    """A time to 3 significant digits, in ms below a second: 1.80 ms, 61.0 ms, 261 ms, 1.44 s."""
    value, unit = (t * 1e3, "ms") if t < 1 else (t, "s")
    digits = max(0, 2 - int(math.floor(math.log10(value)))) if value > 0 else 2
    return f"{value:.{digits}f} {unit}"


def workload_a_table(lines) -> list:
    """Workload A's lines (the dicts :func:`main` reports) as :data:`A_COLUMNS`' Markdown table;
    a cell whose line is missing is "–"."""
    rows = {}
    for x in lines:
        if x.get("workload") == "A" and "ratio" in x:
            rows.setdefault((x["model"], x["size"]), {})[(x["rule"], x["what"])] = x
    table = []
    for (model, size), got in rows.items():
        cells = [MODEL_NAMES.get(model, model), size.replace("x", " × ")]
        for rule, what in (("paper", "states"), ("paper", "measures"), ("full", "states")):
            x = got.get((rule, what))
            if what == "measures":
                cells.append(None if x is None else f"{x['ratio']:.2f}× ({x['measures_over_states']:.2f})")
            elif x is None:
                cells += [None, None]
            else:
                cells += [f"{seconds(x['powerlens_s'])} / {seconds(x['torch_s'])}", f"{x['ratio']:.2f}×"]
        table.append(cells)
    return benchdoc.markdown_table(A_COLUMNS, table)


def bcde_table(lines) -> list:
    """Workloads B-E as a Markdown table: what was run, both times, the ratio and the agreement
    fields (:data:`AGREEMENT`)."""
    rows = []
    for x in lines:
        if x.get("workload") in ("B", "C", "D", "E") and "ratio" in x:
            fields = [k for k in AGREEMENT if k in x] or [k for k in ("abs_err",) if k in x]
            rows.append([x["workload"], f"{x['model']} {x['size']} {x['what']}", seconds(x["powerlens_s"]),
                         seconds(x["torch_s"]), f"{x['ratio']:.2f}×",
                         ", ".join(f"{k} {x[k]:.2g}" for k in fields) or None])
    return benchdoc.markdown_table(("workload", "what", "powerlens", "torch", "ratio", "agreement"), rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="the small configuration the test suite runs")
    ap.add_argument("--only", default="A,B,C,D,E", help="workloads to run, comma separated")
    ap.add_argument("--models", default="minilm,smollm2", help="workload A's models, comma separated")
    ap.add_argument("--sizes", default="", help="workload A's prompts x tokens, e.g. 8x128,1x16 (default: all)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile attempt")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch's intra-op threads (default 0: all cores)")
    benchdoc.add_doc_option(ap, "vs_torch")
    args = ap.parse_args(argv)
    with benchdoc.Capture() as printed:
        lines = run_workloads(args)
    tables = [workload_a_table(lines)] if any(x.get("workload") == "A" for x in lines) else []
    if any(x.get("workload") in ("B", "C", "D", "E") for x in lines):
        tables.append(bcde_table(lines))
    benchdoc.write_if_asked(args, "vs_torch", argv, tables, printed.text, packages=("torch",),
                            summary="powerlens against the torch code a researcher would write instead: workloads "
                                    "A-E (the script's docstring), both sides on every core, float32, timed in "
                                    "turns; a ratio is torch's time over powerlens's (> 1: powerlens is faster).")
    return lines


def run_workloads(args) -> list:
    """Every workload ``args`` asks for, each reported as it finishes; the reported lines."""
    timing = Timing(args.repeat, 0.0 if args.tiny else MIN_SECONDS)
    torch.set_num_threads(args.torch_threads or os.cpu_count() or 1)
    only = set(args.only.split(","))
    lines = []

    def report(line):
        lines.append(line)
        keys = ("workload", "model", "size", "rule", "what")
        head = " ".join(str(line.get(k, "")) for k in keys)
        nums = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                        for k, v in line.items() if k not in keys)
        print(f"{head:<45} {nums}", flush=True)

    matmul_timing = Timing(1 if args.tiny else 3, timing.min_seconds)
    gj, gt = matmul_rates(matmul_timing)
    print(f"matmul 2048^3 float32: jax {gj:.0f} GFLOP/s, torch {gt:.0f} GFLOP/s (torch threads "
          f"{torch.get_num_threads()})")
    minilm = pl.load("minilm")
    if args.tiny:
        sizes = {"*": [(1, 16), (2, 8)]}
        models = {"minilm": minilm}
    else:
        sizes = {"*": [(1, 16), (8, 128), (32, 128), (8, 512)],
                 "smollm2": [(1, 16), (8, 128), (32, 128), (8, 512), (1, 2048)]}
        models = {name: minilm if name == "minilm" else pl.load(name) for name in args.models.split(",")}
    if args.sizes:
        sizes = {"*": [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]}
    if "A" in only:
        workload_a(models, sizes, timing, report)
        gj_after, _ = matmul_rates(matmul_timing)
        ceiling = max(gj, gj_after)             # the faster of the two: the stricter fraction
        print(f"matmul 2048^3 float32 after A: jax {gj_after:.0f} GFLOP/s; the rates below are "
              f"against {ceiling:.0f}")
        for x in lines:
            if x.get("what") == "states" and x.get("rule") == "paper":
                B, n = (int(v) for v in x["size"].split("x"))
                cfg = models[x["model"]].layers.config
                rate = paper_flops(cfg, len(models[x["model"]].layers.schedule), B, n) / x["powerlens_s"] / 1e9
                print(f"A {x['model']} {x['size']} paper states: {rate:.0f} GFLOP/s, "
                      f"{100 * rate / ceiling:.0f} % of the large matmul", flush=True)
        if not args.tiny and not args.no_compile:
            try_compile(minilm, timing, report)
    if "B" in only:
        workload_b(minilm, 20 if args.tiny else 1000, timing, report)
    if "C" in only:
        workload_c(minilm, timing, report)
    if "D" in only:
        workload_d(8 if args.tiny else 256, 10 if args.tiny else 200, timing, report)
    if "E" in only:
        workload_e(minilm, 8 if args.tiny else 64, 20 if args.tiny else 200, timing, report)
    ratios = [x["ratio"] for x in lines if x.get("what") == "states" and "ratio" in x]
    if ratios:
        print(f"A states only: min {min(ratios):.2f}x, median {float(np.median(ratios)):.2f}x over "
              f"{len(ratios)} (model, size, rule)")
    return lines


if __name__ == "__main__":
    main()
