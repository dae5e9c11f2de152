"""Benchmark: gradient steering, the token objective against torch, and the alignment objective
vmapped against a Python loop.

``--problem token`` (the default): ``objective="token"`` (powerlens._src.steering.token) on SmolLM2,
64 target tokens, 200 Adam steps, rank-1 ``lowrank`` edits dO = n0 P Q^T of the last layer's
W_o, target probability 0.5 at each prompt's last token, mean control KL <= 0.5 nats, against
the same problem in torch. Both sides start from the same point (powerlens's closed-form ray
start, :func:`start_point`) and run the same maths per Adam step, for all K targets at once:

    the last layer at each row's last token only (only it reaches the head): its entering
      state and head mix (RMSNorm, fused q/k/v, RoPE, GQA attention over every token) do not
      depend on the edit and are computed once, outside the loop (as are the 29 layers
      before it); per step, the attention output mix (W_o + dO_k)^T with dO_k = (n0 P) Q^T
      applied as (mix Q)(n0 P)^T, the residual and the SiLU-gated MLP,
    the model's final norm and LM head there, and the constraints through one logsumexp
      (log p(t | b) = z_t - lse(z), KL = sum p_0 (log p_0 - z) + lse(z): no log-softmax formed),
    loss = ||dO||^2 / n0^2 + the augmented-Lagrangian terms of g_b = log 0.5 - log p(t | b)
      and g_kl = mean KL - 0.5 (one multiplier each, updated every 10 steps),
    Adam (b1 0.9, b2 0.999, eps 1e-8), step size on a cosine decay from 3e-3 to 1.5e-4.

powerlens: the library's own loop, :func:`~powerlens._src.steering.token.token_adam` (the loop of
``solve_token_one``: :func:`~powerlens._src.steering.lagrangian.constrained_adam`, one ``lax.scan``
over the steps), vmapped over the targets in one compiled program and sharded over the JAX
devices (:func:`~powerlens._src.steering.optimize.map_targets`, as ``optimize_steering`` runs it).
torch: the K edits batched in every tensor, eager autograd, ``torch.optim.Adam`` with a
``LambdaLR`` equal to optax's cosine decay, no Python loop over the targets
(:func:`torch_token_solve`).

Agreement. float64 (JAX x64, torch double), both sides from powerlens's own float64 start and
the same entering tokens, over the first ``--check-steps-f64`` (12, past the first multiplier
update) steps: the per-step ||dO||^2 / n0^2 and min_b log p(t | b), the best iterate, the
multipliers, the controls' log p, and powerlens's loop against the public
``pl.optimize_steering`` over the same steps; asserted to 1e-8 relative. float32 at the same
start, asserted to 1e-4: the tokens entering the layer (torch's own preparation), the
controls' log p, the start's ||dO||^2 / n0^2 and min_b log p(t | b), and that start against
``pl.optimize_steering``'s. Reported: the float32 differences over the first ``--check-steps``
(3) steps (Adam's first steps are sign-like, m / (sqrt(v) + eps) ~ +-1 for any gradient size,
so a coordinate whose gradient sits at float32 rounding may step either way, in either
framework or in two compiled programs of one). Timing: best of ``--repeats`` runs of ``--steps`` steps each, JAX's first
call (compilation) apart; both frameworks on ``--threads`` CPU cores (torch
``set_num_threads``; XLA through the process's CPU affinity, set before JAX starts).

``--problem minilm|synthetic|alignment`` (the earlier workloads): the alignment objective's
optax solve for 64 directions, one vmapped run against one call per direction:

  solve only   the same pure ``solve_one`` (powerlens._src.steering.optimize), same optax steps,
               same prepared problem; one jit-compiled ``vmap`` over the directions vs one
               jit-compiled call per direction;
  public API   ``optimize_steering(layers, x0, D)`` once with all directions vs once per
               direction (each call also prepares its problem).

  minilm     all-MiniLM-L6-v2 (d = 384, 12 heads), its last layer steered, 2 prompts
             (24 tokens), 64 random unit directions, sign-free worst-token alignment 0.9
  synthetic  one softmax layer, d = 16, 4 heads, non-normal spectrum (2, 1, -0.5),
             4 prompts x 8 tokens in a cone, 64 targets at 0.9 rad from its axis

    python benchmarks/steering.py [--problem token|minilm|synthetic|alignment|all]
                                  [--steps 200] [--targets 64] [--tiny]

``--tiny`` (seconds; what the test suite runs): the token objective on a random two-layer
Llama-like decoder, 2 targets, 3 steps; it writes no results file unless given ``--doc``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)


def _configure_process(argv):
    """Run as a script, before JAX starts: the alignment workloads see every CPU core as a JAX
    host device (so the vmapped run splits its directions over them), and the token workload's
    ``--threads`` cores are the process's CPU affinity, which XLA sizes its thread pool by."""
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={os.cpu_count() or 1}").strip()
    threads = _threads_arg(argv)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if threads and cpus and threads < len(cpus):
        os.sched_setaffinity(0, cpus[:threads])


def _threads_arg(argv, default=2):
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return int(argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return default


if __name__ == "__main__":
    _configure_process(sys.argv[1:])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import benchdoc  # noqa: E402

import powerlens as pl  # noqa: E402
from powerlens._src.dynamics import synthetic as S  # noqa: E402
from powerlens._src.steering.optimize import (AlignSettings, last_layer_terms, optimize_steering,  # noqa: E402
                                              prepare_problem, solve_many_jit, solve_many_sharded, solve_one_jit)
from powerlens._src.steering.rank1 import host_matrices  # noqa: E402


# =========================================================================== the token objective

TOKEN_PROMPTS = ("The capital of France is", "The city where the Eiffel Tower stands is")
"""The steered prompts (SmolLM2); the controls are powerlens's default ones."""

TOKEN_CONFIG = dict(target_prob=0.5, max_kl=0.5, rank=1, lr=3e-3, mu=10.0, dual_every=10, tol=1e-4, lr_floor=0.05)
"""The optimiser's settings: ``optimize_steering(objective="token")``'s defaults."""

AGREE_RTOL = 1e-4
"""The agreement the start must reach (relative, float32)."""

AGREE64_RTOL = 1e-8
"""The agreement the first steps must reach in float64 (relative)."""


def tiny_llama(seed: int = 0):
    """The ``--tiny`` model: a random two-layer Llama-like decoder (d 32, 4 query heads over 2
    key/value heads of 8, RoPE, RMSNorm, SiLU-gated MLP of 64, final RMSNorm, tied head of 64
    tokens), float32."""
    from powerlens._src.dynamics.params import LayerConfig, make_layers
    from powerlens._src.models.base import Model, ModelInfo
    rng = np.random.default_rng(seed)
    U, d, H, G, e, f, vocab = 2, 32, 4, 2, 8, 64, 64
    cfg = LayerConfig(d_model=d, n_heads=H, n_kv_heads=G, d_head=e, causal=True, norm="rmsnorm", norm_eps=1e-5,
                      norm_placement="pre", rope_theta=10000.0, ffn_activation="silu_glu")
    r = lambda *s: (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)
    one = lambda *s: (1.0 + 0.1 * rng.standard_normal(s)).astype(np.float32)
    layers = make_layers(W_v=r(U, G, e, d), W_o=r(U, d, H * e), W_q=r(U, H, e, d), W_k=r(U, G, e, d),
                         W_in=r(U, f, d), W_gate=r(U, f, d), W_out=r(U, d, f), norm_scale=one(U, d),
                         ffn_norm_scale=one(U, d), config=cfg)
    layers = layers.replace(**{k: a.astype(jnp.float32) for k, a in layers.arrays().items()
                               if jnp.issubdtype(a.dtype, jnp.floating)})
    return Model(layers=layers, embeddings={"word": jnp.asarray(3.0 * r(vocab, d))},
                 final_norm_scale=jnp.asarray(one(d)),
                 info=ModelInfo(family="llama", source="", decoder=True, pad_token_id=0))


def token_problem(model, prompts, controls):
    """The prepared problem, exactly as :func:`~powerlens._src.steering.token.optimize_token` builds it
    (last layer, ``lowrank``): the prompts and controls embedded and padded to one batch of M =
    B + C rows, the tokens X entering the last layer (M, n, d), valid, each row's last token, the
    edit-independent states ``pre`` (:func:`~powerlens._src.steering.token.prepare_states`: the last
    layer's entering state and head mix at each row's last token), the controls' unedited log p
    (C, V); also x_all (the embeddings, for torch's own preparation)."""
    from powerlens._src.models.embed import embed_ids, padded_ids, prompt_ids
    from powerlens._src.steering.token import (_pad_to, control_batch, edited_final_states, entering, last_positions,
                                          next_token_logp, prepare_states)
    layers = model.layers
    pid, pvalid = padded_ids(model, prompt_ids(model, list(prompts)))
    x0, vb = (np.asarray(a) for a in embed_ids(model, pid, pvalid))
    cid, cvalid = control_batch(model, controls)
    xc, cv = (np.asarray(a) for a in embed_ids(model, cid, cvalid))
    n = max(x0.shape[1], xc.shape[1])
    (xp, vp), (xc, cv) = _pad_to(x0, vb.astype(bool), n), _pad_to(xc, cv.astype(bool), n)
    x_all, v_all = np.concatenate([xp, xc]), np.concatenate([vp, cv])
    l = layers.n_unique - 1
    t0 = layers.schedule.steps_of(l)[0]
    assert t0 == len(layers.schedule) - 1, "the benchmark steers the last layer, applied once, last"
    valid = jnp.asarray(v_all)
    X = entering(layers, jnp.asarray(x_all), valid, t0)
    last = last_positions(valid)
    B = x0.shape[0]
    pre = prepare_states(layers, X, valid, last, param="lowrank", before_add=(l,), after_add=())
    h = edited_final_states(layers, pre, valid, last, None, layer=l, param="lowrank", tail=(l,))
    base_logp = next_token_logp(model, h)[B:]
    return {"x0": x0, "valid0": vb, "x_all": x_all, "valid": v_all, "X": X, "last": last, "pre": pre,
            "base_logp": base_logp, "n_prompts": B, "layer": l}


def start_point(model, prob, ids, controls, steps: int):
    """powerlens's own start and first ``steps`` steps: ``pl.optimize_steering(objective="token")``
    (its closed-form ray start, the scale n0 and the choice of w) and the initial factors P, Q
    "(K, d, r)", "(K, H e, r)" that its solver builds from them (``initial_params``)."""
    from powerlens._src.steering.optimize import initial_params
    from powerlens._src.steering.rank1 import inverse_map
    c = TOKEN_CONFIG
    t = time.perf_counter()
    res = optimize_steering(model, prob["x0"], pl.TokenObjective(ids, c["target_prob"], c["max_kl"], controls),
                            valid=prob["valid0"],
                            config=pl.SteeringConfig(rank=c["rank"], steps=steps, lr=c["lr"], mu=c["mu"],
                                                     dual_every=c["dual_every"], tol=c["tol"]))
    api_s = time.perf_counter() - t
    layers, l = model.layers, prob["layer"]
    dtype = layers.W_v.dtype
    _, Vc, _ = host_matrices(layers, l)
    R = jnp.asarray(inverse_map(Vc, l) if res.w == "inverse" else Vc, dtype)
    U = jnp.asarray(res.directions, dtype)
    keys = jax.random.split(jax.random.PRNGKey(0), len(ids))
    n0 = jnp.asarray(res.closed_norm, dtype)

    def init(u, n, key):
        w_cf = R @ u
        w_cf = w_cf / jnp.linalg.norm(w_cf) if res.w == "value" else w_cf
        return initial_params("lowrank", n, w_cf / jnp.linalg.norm(w_cf), u, c["rank"], key, dtype)
    params0 = jax.vmap(init)(U, n0, keys)
    return res, U, params0, n0, api_s


def powerlens_token_loop(model, prob, U, target_ids, log_targets, params0, n0, *, steps: int):
    """powerlens's Adam loop of the token objective for K targets from ``params0`` (P (K, d, r),
    Q (K, H e, r)) and n0 (K,): the library's own :func:`~powerlens._src.steering.token.token_adam`
    (the loop inside ``solve_token_one``: constrained_adam over the token constraints, the final
    step at the last tokens, the head, the fused logsumexp), run through
    :func:`~powerlens._src.steering.optimize.map_targets` as ``optimize_steering`` runs it: one
    compiled program, vmapped over the targets, sharded over the devices. Returns
    constrained_adam's dict with a leading K axis."""
    from powerlens._src.steering.optimize import map_targets
    from powerlens._src.steering.token import TokenSettings, token_adam
    c, l = TOKEN_CONFIG, prob["layer"]
    static = {"settings": TokenSettings(layer=l, tail=(l,), n_prompts=prob["n_prompts"], param="lowrank",
                                        max_kl=c["max_kl"], steps=int(steps), lr=c["lr"], mu=c["mu"],
                                        dual_every=c["dual_every"], tol=c["tol"], lr_floor=c["lr_floor"])}
    shared = (model, prob["pre"], jnp.asarray(prob["valid"]), prob["last"], prob["base_logp"])
    return map_targets(token_adam, 5, shared, (U, target_ids, log_targets, params0, n0), static)


def rope_of(cfg, n: int):
    """The RoPE tables (cos, sin) "(n, e)" as powerlens forms them
    (:func:`powerlens._src.dynamics.attention.apply_rope`: the frequencies in float32, as transformers
    does, the cosines by XLA), for torch's last layer: both sides then rotate by the same
    numbers (the frameworks' float32 cosines can differ in the last bit, which the float64
    check would see)."""
    e = cfg.d_head
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, e, 2, dtype=jnp.float32) / e))
    emb = jnp.tile(jnp.arange(n, dtype=jnp.float32)[:, None] * inv_freq[None, :], (1, 2))
    return np.asarray(jnp.cos(emb)), np.asarray(jnp.sin(emb))


# --------------------------------------------------------------------------- the torch side

def torch_token_problem(model, prob, X=None):
    """The torch user's preparation, from powerlens's converted weights (float32, or float64 for
    the check): the layers as tensors, the tokens entering the last layer (the earlier layers
    once, ``torch.no_grad``, SDPA; or ``X`` given), and what of the last layer does not depend
    on the edit, computed once: its entering state x and head mix (the fused q/k/v projection,
    RoPE, GQA attention in ``scaled_dot_product_attention``) at each row's last token; the head,
    the final norm and the controls' unedited log p."""
    import torch
    from vs_torch import torch_layers, torch_run
    L = model.layers
    cfg = L.config
    params = torch_layers(L)
    l = prob["layer"]
    p = params[l]
    dt = np.asarray(L.W_v).dtype
    tx = torch.from_numpy(np.array(prob["x_all"], dt))
    tv = torch.from_numpy(np.array(prob["valid"], bool))
    if X is None:
        with torch.no_grad():
            X = torch_run(cfg, params, list(L.schedule)[:-1], tx, tv, "full")[-1] if len(L.schedule) > 1 else tx
    head = torch.from_numpy(np.array(model.lm_head if model.lm_head is not None else model.embeddings["word"], dt))
    fscale = torch.from_numpy(np.array(model.final_norm_scale, dt))
    last = torch.from_numpy(np.array(prob["last"], np.int64))
    rope = tuple(torch.from_numpy(t.astype(dt)) for t in rope_of(cfg, X.shape[1])) if cfg.rope_theta else None
    with torch.no_grad():
        mix = torch_head_mix(cfg, p, X, tv, rope)[torch.arange(X.shape[0]), last]
    out = {"cfg": cfg, "p": p, "X": X, "x": X[torch.arange(X.shape[0]), last], "mix": mix, "head": head,
           "fscale": fscale, "n_prompts": prob["n_prompts"]}
    with torch.no_grad():
        z = torch_logits(out, torch_final_step(out, None))
        out["base_logp"] = torch.log_softmax(z, -1)[prob["n_prompts"]:]
    return out


def torch_head_mix(cfg, p, X, valid, rope):
    """The heads' outputs before W_o "(M, n, H e)" of the last (pre-norm Llama) layer on X (M, n, d):
    RMSNorm, the fused q/k/v projection, RoPE, GQA in ``scaled_dot_product_attention``."""
    import torch
    import torch.nn.functional as TF
    from vs_torch import rotate_half, torch_mask, torch_norm
    M, n, d = X.shape
    H, G, e = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    q, k, v = (torch_norm(cfg, X, p["norm_scale"], None) @ p["W_qkv_T"]).split([H * e, G * e, G * e], dim=-1)
    q, k, v = (t.view(M, n, -1, e).transpose(1, 2) for t in (q, k, v))
    if rope is not None:
        cos, sin = rope
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
    o = TF.scaled_dot_product_attention(q, k, v, attn_mask=torch_mask(cfg, valid), scale=float(p["scale"]),
                                        enable_gqa=G != H)
    return o.transpose(1, 2).reshape(M, n, H * e)


def torch_final_step(tp, factors):
    """The last layer's output at each row's last token "(K, M, d)" with W_o + fP_k fQ_k^T for
    the K edits (factors fP (K, d, r), fQ (K, H e, r); None: unedited, "(M, d)"): attention
    output mix W_o^T + (mix fQ) fP^T, then the residual and the SiLU-gated MLP, as powerlens's
    ``final_step``."""
    from vs_torch import torch_ffn, torch_norm
    cfg, p, mix = tp["cfg"], tp["p"], tp["mix"]
    a = mix @ p["W_o"].T
    if factors is not None:
        fP, fQ = factors
        a = a + (mix @ fQ) @ fP.transpose(1, 2)                           # (K, M, d)
    h = tp["x"] + a
    return h + torch_ffn(cfg, p, torch_norm(cfg, h, p["ffn_norm_scale"], None))


def torch_logits(tp, h):
    """The final RMSNorm and the LM head: "(..., V)"."""
    from vs_torch import torch_norm
    return torch_norm(tp["cfg"], h, tp["fscale"], None) @ tp["head"].T


def torch_constraints(tp, z, rows, log_targets, max_kl):
    """(g (K, B + 1), min_b log p(t | b) (K,)) from the logits z (K, M, V), as powerlens's
    ``token_constraints``: one logsumexp, the log-softmax never formed."""
    import torch
    B, base = tp["n_prompts"], tp["base_logp"]
    lse = torch.logsumexp(z, -1)                                         # (K, M)
    lp_t = z[:, :B].gather(-1, rows)[..., 0] - lse[:, :B]                # (K, B)
    p0 = base.exp()
    kl = ((p0 * (base - z[:, B:])).sum(-1) + lse[:, B:] * p0.sum(-1)).mean(-1)   # (K,)
    return torch.cat([log_targets[:, None] - lp_t, (kl - max_kl)[:, None]], 1), lp_t.amin(1)


def torch_token_solve(tp, P0, Q0, n0, target_ids, log_targets, *, steps, lr, mu, dual_every, tol, max_kl, lr_floor):
    """The same optimisation in torch (module docstring), the K targets batched in every tensor:
    P (K, d, r), Q (K, H e, r), dO = (n0 P) Q^T applied as (mix Q)(n0 P)^T; ``torch.optim.Adam``
    (as optax.adam) with a ``LambdaLR`` equal to ``optax.cosine_decay_schedule(lr, steps,
    alpha=lr_floor)``; the K losses summed, so one backward gives each its own gradient; one
    multiplier per constraint (B + 1 per target), updated every ``dual_every`` steps; the best
    feasible iterate kept."""
    import torch
    K, B = P0.shape[0], tp["n_prompts"]
    rows = target_ids.view(K, 1, 1).expand(K, B, 1)

    def constraints(P, Q):
        z = torch_logits(tp, torch_final_step(tp, (n0.view(K, 1, 1) * P, Q)))
        return torch_constraints(tp, z, rows, log_targets, max_kl)

    def size(P, Q):
        return ((P.transpose(1, 2) @ P) * (Q.transpose(1, 2) @ Q)).sum((1, 2))

    def objective(P, Q, lam):
        N = size(P, Q)
        g, aux = constraints(P, Q)
        pen = (torch.clamp(lam + mu * g, min=0.0).square() - lam * lam).sum(1) / (2.0 * mu)
        return N + pen, g, aux, N

    P = P0.clone().requires_grad_(True)
    Q = Q0.clone().requires_grad_(True)
    opt = torch.optim.Adam([P, Q], lr=lr, betas=(0.9, 0.999), eps=1e-8)
    decay = lambda i: (1 - lr_floor) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)) + lr_floor
    sched = torch.optim.lr_scheduler.LambdaLR(opt, decay)
    f = dict(dtype=P0.dtype)                                             # float32, or float64 for the check
    lam = torch.zeros(K, B + 1, **f)
    best = [P0.clone(), Q0.clone(), torch.full((K,), float("inf"), **f), torch.zeros(K, **f)]
    hist_aux, hist_N = [], []

    def keep(g, aux, N):
        with torch.no_grad():
            better = (g <= tol).all(1) & (N < best[2])
            best[0] = torch.where(better[:, None, None], P, best[0])
            best[1] = torch.where(better[:, None, None], Q, best[1])
            best[2], best[3] = torch.where(better, N, best[2]), torch.where(better, aux, best[3])

    for i in range(steps):
        L, g, aux, N = objective(P, Q, lam)
        hist_aux.append(aux.detach())
        hist_N.append(N.detach())
        opt.zero_grad(set_to_none=True)
        L.sum().backward()
        keep(g, aux, N)
        opt.step()
        sched.step()
        if (i + 1) % dual_every == 0:
            lam = torch.clamp(lam + mu * g.detach(), min=0.0)
    with torch.no_grad():                                               # the last iterate is checked too
        _, g, aux, N = objective(P, Q, lam)
        keep(g, aux, N)
    return {"params": {"P": best[0], "Q": best[1]}, "size": best[2], "aux": best[3], "multiplier": lam,
            "history_aux": torch.stack(hist_aux, 1), "history_size": torch.stack(hist_N, 1)}


def rel_diff(a, b) -> float:
    """max |a - b| / max |b| (arrays of any shape; 0 for two empty arrays)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30)) if b.size else 0.0


def step_flops(cfg, K: int, M: int, vocab: int, f: int) -> float:
    """The matmul FLOPs of one Adam step that depend on the edits, at the M scored tokens: the
    K MLPs 3 x 2 K M d f and the head 2 K M d V forward, as much again backward (gradients of
    the inputs only: the weights are constants)."""
    d = cfg.d_model
    return 2.0 * float(3 * 2 * K * M * d * f + 2 * K * M * d * vocab)


SETTLE_SECONDS = 1.0
"""Pause before timing torch right after JAX ran: XLA's CPU worker threads keep spinning for a
moment after a computation, and torch's threads on the same cores run several times slower
meanwhile (measured: ~0.5 s after a JAX call)."""


def settle() -> None:
    time.sleep(SETTLE_SECONDS)


def best_time(fn, repeats: int) -> float:
    best = np.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


PROFILE_PARTS = ("final step", "norm+head+constraints", "loss forward+backward")


def token_profile(model, prob, tp, fP, fQ, ids, log_t, repeats: int) -> dict:
    """Seconds of one step's parts on each side, for the same K edits (factors fP (K, d, r), fQ
    (K, H e, r), numpy): the final step at the last tokens (the edit, the residual and the
    MLP), the final norm, head and constraints (the fused logsumexp) on its output, and the
    forward + backward of the summed constraint values through both."""
    import torch
    from powerlens._src.steering.token import final_step, token_constraints
    from powerlens._src.models.forward import logits
    c, l, pre, B = TOKEN_CONFIG, prob["layer"], prob["pre"], prob["n_prompts"]
    lp, base = model.layers.layer(l), prob["base_logp"]
    jstep = lambda P, Q: jax.vmap(lambda p, q: final_step(lp, pre["x"], pre["mix"], (p, q)))(P, Q)
    jhead = lambda H: jax.vmap(lambda h, t, lt: token_constraints(logits(model, h), t, lt, base, c["max_kl"], B)[0])(
        H, ids, log_t)
    jf, jh = jax.jit(jstep), jax.jit(jhead)
    jg = jax.jit(jax.grad(lambda P, Q: jnp.sum(jhead(jstep(P, Q))), argnums=(0, 1)))
    P, Q = jnp.asarray(fP), jnp.asarray(fQ)
    H = jf(P, Q)
    out = {}
    for name, fn in zip(PROFILE_PARTS, (lambda: jf(P, Q), lambda: jh(H), lambda: jg(P, Q))):
        jax.block_until_ready(fn())
        out[("powerlens", name)] = best_time(lambda: jax.block_until_ready(fn()), repeats)
    settle()
    tP, tQ = torch.from_numpy(np.array(fP)), torch.from_numpy(np.array(fQ))
    K = tP.shape[0]
    rows = torch.from_numpy(np.array(ids, np.int64)).view(K, 1, 1).expand(K, B, 1)
    tlog = torch.from_numpy(np.array(log_t))
    thead = lambda Y: torch_constraints(tp, torch_logits(tp, Y), rows, tlog, c["max_kl"])[0]
    with torch.no_grad():
        Y = torch_final_step(tp, (tP, tQ))
    gP, gQ = tP.clone().requires_grad_(True), tQ.clone().requires_grad_(True)

    def tgrad():
        gP.grad = gQ.grad = None
        thead(torch_final_step(tp, (gP, gQ))).sum().backward()
    with torch.no_grad():
        for name, fn in zip(PROFILE_PARTS[:2], (lambda: torch_final_step(tp, (tP, tQ)), lambda: thead(Y))):
            fn()
            out[("torch", name)] = best_time(fn, repeats)
    tgrad()
    out[("torch", PROFILE_PARTS[2])] = best_time(tgrad, repeats)
    return out


def _agreement(ours, theirs) -> dict:
    """The per-step and best-iterate differences of two runs of the loop (max relative)."""
    return {"||dO||^2/n0^2 per step": rel_diff(ours["history_size"], theirs["history_size"]),
            "min log p(target) per step": rel_diff(ours["history_aux"], theirs["history_aux"]),
            "best P": rel_diff(ours["params"]["P"], theirs["params"]["P"]),
            "best Q": rel_diff(ours["params"]["Q"], theirs["params"]["Q"]),
            "multipliers": rel_diff(ours["multiplier"], theirs["multiplier"])}


def api_difference(ours, res, n0, upto=None) -> float:
    """powerlens's loop (``ours``) against the public ``pl.optimize_steering`` result ``res``
    over the same steps (its first ``upto`` steps): ||dO|| and min_b p(t | b) per step."""
    k = slice(None, upto)
    return max(rel_diff((np.sqrt(ours["history_size"]) * np.asarray(n0)[:, None])[:, k], res.history_norm[:, k]),
               rel_diff(np.exp(ours["history_aux"])[:, k], res.history_min_target_prob[:, k]))


def check_float64(model, prompts, controls, ids, steps: int) -> dict:
    """Both sides in float64 (JAX x64, torch double) from powerlens's own float64 start
    (:func:`start_point`), over ``steps`` Adam steps, each side's own forward pass from the same
    entering tokens (powerlens's). Returns the differences (:func:`_agreement`, the controls'
    base log p, and powerlens's loop against ``pl.optimize_steering`` over the same steps)."""
    import torch
    from vs_torch import to_float64
    with jax.enable_x64(True):
        model64 = jax.tree_util.tree_map(to_float64, model)
        prob = token_problem(model64, prompts, controls)
        res, U, params0, n0, _ = start_point(model64, prob, ids, controls, steps)
        log_t = jnp.full((len(ids),), np.log(TOKEN_CONFIG["target_prob"]), jnp.float64)
        ours = jax.tree_util.tree_map(np.asarray, powerlens_token_loop(
            model64, prob, U, jnp.asarray(ids, jnp.int32), log_t, params0, n0, steps=steps))
        tp = torch_token_problem(model64, prob, X=torch.from_numpy(np.array(prob["X"])))
    T = lambda a, dt=np.float64: torch.from_numpy(np.array(a, dt))
    theirs = torch_token_solve(tp, T(params0["P"]), T(params0["Q"]), T(n0), T(ids, np.int64), T(np.asarray(log_t)),
                               steps=steps, **{k: TOKEN_CONFIG[k] for k in ("max_kl", "lr", "mu", "dual_every", "tol",
                                                                              "lr_floor")})
    theirs = jax.tree_util.tree_map(lambda a: a.detach().numpy(), theirs)
    assert ours["history_size"].dtype == np.float64 and theirs["history_size"].dtype == np.float64
    return {"controls' base log p": rel_diff(tp["base_logp"].numpy(), prob["base_logp"]), **_agreement(ours, theirs),
            "powerlens's loop vs pl.optimize_steering": api_difference(ours, res, n0)}


def run_token(args) -> dict:
    """The token-objective benchmark (module docstring): agreement, then timing and a profile."""
    import torch
    torch.set_num_threads(args.threads)
    c = TOKEN_CONFIG
    if args.tiny:
        model = tiny_llama()
        vocab = model.embeddings["word"].shape[0]
        rng = np.random.default_rng(1)
        prompts = [list(rng.integers(1, vocab, 5)), list(rng.integers(1, vocab, 4))]
        controls = [list(rng.integers(1, vocab, 6)), list(rng.integers(1, vocab, 3))]
        ids = rng.choice(np.arange(1, vocab), args.targets, replace=False)
        label = f"random 2-layer Llama-like decoder (d={model.layers.config.d_model})"
    else:
        model = pl.load("smollm2")
        vocab = model.embeddings["word"].shape[0]
        prompts, controls = list(TOKEN_PROMPTS), None
        ids = np.random.default_rng(0).choice(np.arange(1000, 20000), args.targets, replace=False)
        label = "SmolLM2-135M last layer"
    cfg = model.layers.config
    prob = token_problem(model, prompts, controls)
    K, (M, n) = len(ids), prob["valid"].shape
    f = model.layers.W_in.shape[1]
    print(f"[token] {label}: d={cfg.d_model}, {cfg.n_heads} query / {cfg.n_kv_heads} key-value heads, vocab "
          f"{vocab}; {prob['n_prompts']} prompts + {M - prob['n_prompts']} controls padded to {n} tokens; {K} "
          f"targets, rank {c['rank']}, target_prob {c['target_prob']}, max_kl {c['max_kl']}; {args.steps} Adam steps; "
          f"{args.threads} threads each (torch {torch.__version__}, jax {jax.__version__}, {jax.default_backend()}, "
          f"{jax.device_count()} JAX devices)")
    tid = jnp.asarray(ids, jnp.int32)
    log_t = jnp.full((K,), np.log(c["target_prob"]), model.layers.W_v.dtype)
    tkw = {k: c[k] for k in ("max_kl", "lr", "mu", "dual_every", "tol", "lr_floor")}
    loop = lambda steps: powerlens_token_loop(model, prob, U, tid, log_t, params0, n0, steps=steps)

    # ---- the start, and float32 agreement there
    S0 = args.check_steps
    res, U, params0, n0, api_s = start_point(model, prob, ids, controls, S0)
    print(f"  start: pl.optimize_steering(objective='token', steps={S0}) {api_s:.1f} s (compilation included); "
          f"closed-form ray feasible for {int(res.closed_feasible.sum())}/{K} targets, w={res.w!r}")
    ours0 = jax.tree_util.tree_map(np.asarray, loop(S0))
    api_rel = api_difference(ours0, res, n0, upto=1)                   # the start is the public API's
    tp = torch_token_problem(model, prob)
    T = lambda a, dt=np.float32: torch.from_numpy(np.array(a, dt))
    tP0, tQ0, tn0 = T(params0["P"]), T(params0["Q"]), T(n0)
    tids, tlog = T(ids, np.int64), T(log_t)
    theirs0 = torch_token_solve(tp, tP0, tQ0, tn0, tids, tlog, steps=S0, **tkw)
    theirs0 = jax.tree_util.tree_map(lambda a: a.detach().numpy(), theirs0)
    v = np.asarray(prob["valid"], bool)                                  # padding rows are no token
    agree = {"entering states": rel_diff(tp["X"].numpy()[v], np.asarray(prob["X"])[v]),
             "controls' base log p": rel_diff(tp["base_logp"].numpy(), prob["base_logp"]),
             "start: ||dO||^2/n0^2, min log p(target)": max(
                 rel_diff(ours0["history_size"][:, 0], theirs0["history_size"][:, 0]),
                 rel_diff(ours0["history_aux"][:, 0], theirs0["history_aux"][:, 0]))}
    # float32 Adam: the first steps are sign-like (m / (sqrt(v) + eps) ~ +-1 whatever the gradient's
    # size), so a coordinate whose gradient is at float32 rounding may step either way in either
    # framework: reported only; the maths of the steps is checked in float64 below
    later = {**_agreement(ours0, theirs0), "powerlens's loop vs pl.optimize_steering": api_difference(ours0, res, n0)}
    print(f"  float32 over steps 1-{S0} (reported, not asserted): "
          + ", ".join(f"{k} {v:.1e}" for k, v in later.items()))
    worst = max(agree.values())
    moved = rel_diff(ours0["history_size"][:, -1], ours0["history_size"][:, 0])   # the steps change the edit
    print(f"  float32 at the same start (max relative difference, torch vs powerlens; asserted): "
          + ", ".join(f"{k} {v:.1e}" for k, v in agree.items()) + f"; powerlens's start vs pl.optimize_steering's "
          f"{api_rel:.1e}; the edit's size moved by {moved:.1e} -> "
          f"{'agree' if max(worst, api_rel) < AGREE_RTOL else 'DISAGREE'} (tolerance {AGREE_RTOL:g})")
    if not max(worst, api_rel) < AGREE_RTOL:
        raise AssertionError(f"torch and powerlens disagree at the start: {agree}, api {api_rel:.2e}")

    # ---- float64 agreement over the first steps (past the first multiplier update)
    S64 = args.check_steps_f64
    agree64 = check_float64(model, prompts, controls, ids, S64)
    worst64 = max(agree64.values())
    print(f"  float64 over the first {S64} Adam steps, both sides from the same start (max relative difference; "
          f"asserted): " + ", ".join(f"{k} {v:.1e}" for k, v in agree64.items())
          + f" -> {'agree' if worst64 < AGREE64_RTOL else 'DISAGREE'} (tolerance {AGREE64_RTOL:g})")
    if not worst64 < AGREE64_RTOL:
        raise AssertionError(f"torch and powerlens disagree in float64 over {S64} steps: {agree64}")

    # ---- timing: the first call (compilation included) apart, then --repeats runs of --steps steps each
    S = args.steps
    run_pl = lambda: jax.block_until_ready(loop(S))
    run_t = lambda: torch_token_solve(tp, tP0, tQ0, tn0, tids, tlog, steps=S, **tkw)
    t = time.perf_counter()
    run_pl()                                                                # compilation and a first run
    first_s = time.perf_counter() - t
    torch_token_solve(tp, tP0, tQ0, tn0, tids, tlog, steps=1, **tkw)          # torch's warm-up (allocations)
    t_pl, t_t = np.inf, np.inf
    for _ in range(args.repeats):                                           # in turns
        settle()
        t = time.perf_counter()
        ours = run_pl()
        t_pl = min(t_pl, time.perf_counter() - t)
        settle()
        t = time.perf_counter()
        theirs = run_t()
        t_t = min(t_t, time.perf_counter() - t)
    compile_s = max(first_s - t_pl, 0.0)
    feas = lambda r: int(np.sum(np.isfinite(np.asarray(r["size"]))))
    flops = step_flops(cfg, K, M, vocab, f)
    ratio = t_t / t_pl
    print(f"  {S} Adam steps x {K} targets: powerlens {t_pl:.2f} s ({1e3 * t_pl / S:.1f} ms/step, compilation "
          f"~{compile_s:.1f} s apart) | torch {t_t:.2f} s ({1e3 * t_t / S:.1f} ms/step) | ratio torch/powerlens "
          f"{ratio:.2f}x (target >= 3x)")
    print(f"  ~{flops / 1e9:.1f} GFLOP per step (forward + backward at the {M} scored tokens): powerlens "
          f"{flops / (t_pl / S) / 1e9:.1f} GFLOP/s, torch {flops / (t_t / S) / 1e9:.1f} GFLOP/s; feasible "
          f"after {S} steps: powerlens {feas(ours)}/{K}, torch {feas({'size': theirs['size'].numpy()})}/{K}")
    prof = {}
    if args.profile:
        fP = np.asarray(n0)[:, None, None] * np.asarray(params0["P"])
        prof = token_profile(model, prob, tp, fP, np.asarray(params0["Q"]), ids, log_t, max(1, args.repeats))
        for side in ("powerlens", "torch"):
            print(f"  profile, {side}: " + ", ".join(f"{name} {1e3 * prof[(side, name)]:.1f} ms"
                                                    for name in PROFILE_PARTS))
    return {"problem": f"{label}, {K} targets", "steps": S, "targets": K, "powerlens_s": t_pl, "torch_s": t_t,
            "compile_s": compile_s, "ratio": ratio, "agree": agree, "agree_max": worst, "api_rel": api_rel,
            "later_steps": later, "moved": moved, "agree64": agree64, "agree64_max": worst64,
            "check_steps_f64": S64, "devices": jax.device_count(), "profile": prof}


# =========================================================================== the alignment objective

def alignment_problem(name, K, rng):
    if name == "synthetic":
        d = 16
        layers = S.synthetic_system([2.0, 1.0, -0.5], kind="nonnormal", heads=4, d=d, seed=1)
        c = S.sphere_tokens(rng, 1, d)[0]
        x0 = np.stack([S.cone_tokens(rng, 8, c, 0.4) for _ in range(4)])
        return layers, x0, np.ones(x0.shape[:2], bool), S.cone_tokens(rng, K, c, 0.9), "synthetic, d=16, 4 heads, 4x8 tokens"
    from powerlens._src.models import embed, load
    model = load("minilm")
    x0, valid = embed(model, ["The cat sat quietly on the warm windowsill.",
                              "Power iteration finds the dominant eigenvector of a matrix."])
    D = rng.standard_normal((K, model.layers.config.d_model))
    D /= np.linalg.norm(D, axis=1, keepdims=True)
    n_tok = int(np.asarray(valid).sum())
    return model.layers, np.asarray(x0), np.asarray(valid), D, f"all-MiniLM-L6-v2 last layer, d=384, {n_tok} tokens"


def run_alignment(name, args):
    rng = np.random.default_rng(0)
    layers, x0, valid, D, label = alignment_problem(name, args.targets, rng)
    X, vb, tail, l, kb = prepare_problem(layers, x0, valid)
    _, V, _ = host_matrices(layers, l)
    dtype = layers.W_v.dtype
    R = jnp.asarray(V, dtype)
    pm = last_layer_terms(layers, X, vb, l, kb, "softmax", None) if tail == (l,) else None
    U = jnp.asarray(D, dtype)
    keys = jax.random.split(jax.random.PRNGKey(0), len(D))
    kw = dict(layer=l, tail=tail, rule="paper", attention="softmax", keep_bias=kb, target=0.9, reduce="min",
              param="lowrank", rank=1, steps=args.steps, lr=1e-2, mu=100.0, dual_every=10, tol=1e-4,
              w_kind="value", signed=False)
    kw = {"settings": AlignSettings(**kw)}
    vec1 = lambda: solve_many_jit(layers, X, vb, U, keys, R, None, pm, **kw)
    vec = lambda: solve_many_sharded(layers, X, vb, U, keys, R, None, pm, **kw)
    loop = lambda: [solve_one_jit(layers, X, vb, U[i], keys[i], R, None, pm, **kw) for i in range(len(D))]

    def timed(f):
        out = jax.block_until_ready(f())
        best = np.inf
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = jax.block_until_ready(f())
            best = min(best, time.perf_counter() - t)
        return best, out

    t_vec1, _ = timed(vec1)
    t_vec, r_vec = timed(vec)
    t_loop, r_loop = timed(loop)
    # the same at the level of the public API: one optimize_steering call with all directions
    # against one call per direction (each call prepares its problem: entering states, bases)
    api_kw = dict(valid=valid, config=pl.SteeringConfig(rank=1, steps=args.steps, w="value"))
    objective = lambda d: pl.AlignmentObjective(d, 0.9, "min", signed=False)
    t_api_vec, _ = timed(lambda: optimize_steering(layers, x0, objective(D), **api_kw).norm)
    t_api_loop, _ = timed(lambda: [optimize_steering(layers, x0, objective(D[i]), **api_kw).norm
                                   for i in range(len(D))])
    norm_loop = np.array([float(r["norm"]) for r in r_loop])
    rel = np.abs(np.asarray(r_vec["norm"]) - norm_loop) / norm_loop
    ratio = np.asarray(r_vec["norm"]) / np.asarray(r_vec["closed_norm"])
    print(f"[{name}] {label}; {len(D)} directions, {args.steps} Adam steps, rank 1, backend "
          f"{jax.default_backend()} ({os.cpu_count()} cpus)")
    print(f"  solve only : vmapped over {jax.device_count()} devices {t_vec:.4f} s (on one device {t_vec1:.4f} s) | "
          f"loop {t_loop:.4f} s | ratio {t_loop / t_vec:.1f}x (one device {t_loop / t_vec1:.1f}x) (target >= 8x)")
    print(f"  public API : one optimize_steering call {t_api_vec:.3f} s | one call per direction "
          f"{t_api_loop:.3f} s | ratio {t_api_loop / t_api_vec:.1f}x (target >= 8x)")
    print(f"  results: ||dO|| vmapped vs loop, median rel. diff {np.median(rel):.1e}, max {np.max(rel):.1e} "
          f"(float32 paths) | feasible {int(np.asarray(r_vec['feasible']).sum())}"
          f"/{len(D)} | median ||dO|| gradient / closed form {np.nanmedian(ratio):.3f}")
    return {"problem": label, "devices": jax.device_count(), "solve_vmapped": t_vec, "solve_one_device": t_vec1,
            "solve_loop": t_loop, "api_vmapped": t_api_vec, "api_loop": t_api_loop}


def token_table(r) -> list:
    return benchdoc.markdown_table(
        ("problem", "Adam steps", "powerlens per step", "torch per step", "torch / powerlens", "powerlens compilation",
         f"agreement, first {r['check_steps_f64']} steps (float64, relative)", "agreement at the start (float32)"),
        [[r["problem"], r["steps"], f"{1e3 * r['powerlens_s'] / r['steps']:.1f} ms",
          f"{1e3 * r['torch_s'] / r['steps']:.1f} ms", f"{r['ratio']:.2f}×", f"{r['compile_s']:.1f} s",
          f"{r['agree64_max']:.0e}", f"{r['agree_max']:.0e}"]])


def alignment_table(results) -> list:
    rows = [[r["problem"], f"{r['solve_vmapped']:.4f} s ({r['devices']} devices), {r['solve_one_device']:.4f} s (1)",
             f"{r['solve_loop']:.4f} s", f"{r['solve_loop'] / r['solve_vmapped']:.1f}×",
             f"{r['api_vmapped']:.3f} s", f"{r['api_loop']:.3f} s", f"{r['api_loop'] / r['api_vmapped']:.1f}×"]
            for r in results]
    return benchdoc.markdown_table(("problem", "solve: vmapped", "solve: one call per direction", "ratio",
                                    "API: one call", "API: one call per direction", "ratio"), rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problem", default="token", choices=["token", "minilm", "synthetic", "alignment", "all"],
                    help="token (default): the token objective against torch; minilm, synthetic or alignment "
                         "(both): the alignment objective vmapped against a loop; all")
    ap.add_argument("--steps", type=int, default=None, help="Adam steps (default 200; --tiny 3)")
    ap.add_argument("--targets", "--directions", type=int, default=None, dest="targets",
                    help="targets (token ids, or directions) (default 64; --tiny 2)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="timed runs, best kept (default 1 for token, 10 for the alignment problems)")
    ap.add_argument("--check-steps", type=int, default=3, help="steps both sides run for the float32 agreement check")
    ap.add_argument("--check-steps-f64", type=int, default=12,
                    help="steps both sides run for the float64 agreement check (default 12: past the first "
                         "multiplier update)")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads of each framework (default 2)")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the per-part profile")
    ap.add_argument("--tiny", action="store_true", help="the token objective on a tiny random decoder, in seconds")
    benchdoc.add_doc_option(ap, "steering")
    args = ap.parse_args(argv)
    if args.tiny and args.problem != "token":
        raise SystemExit("steering.py: error: --tiny runs the token problem only")
    for name in ("steps", "targets", "repeats", "check_steps", "check_steps_f64", "threads"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise SystemExit(f"steering.py: error: --{name.replace('_', '-')} must be >= 1, got {v}")
    args.steps = args.steps or (3 if args.tiny else 200)
    args.targets = args.targets or (2 if args.tiny else 64)
    names = {"token": ["token"], "minilm": ["minilm"], "synthetic": ["synthetic"],
             "alignment": ["minilm", "synthetic"], "all": ["token", "minilm", "synthetic"]}[args.problem]
    tables, token = [], None
    with benchdoc.Capture() as printed:
        if "token" in names:
            token = run_token(argparse.Namespace(**{**vars(args), "repeats": args.repeats or 1}))
            tables.append(token_table(token))
        aligned = [run_alignment(name, argparse.Namespace(**{**vars(args), "repeats": args.repeats or 10}))
                   for name in names if name != "token"]
        if aligned:
            tables.append(alignment_table(aligned))
    summary = ("Gradient steering. The token objective (rank-1 edits of the last layer's W_o, target "
               "probability 0.5, control KL <= 0.5 nats) for all targets at once: powerlens's compiled, "
               "vmapped Adam loop (sharded over the JAX devices) against the same maths in batched eager torch "
               f"(`torch.optim.Adam`), from the same start, {args.threads} CPU threads each, both evaluating the "
               "edited last layer, the head and a fused logsumexp at the scored tokens only; the two agree in "
               f"float64 over the first {args.check_steps_f64} Adam steps and at the start in float32 (both "
               "asserted); their float32 differences over the first steps are printed (Adam's first steps are "
               "sign-like, so float32 rounding of a tiny gradient can flip a step).") if token else ""
    if aligned:
        summary += (" The alignment objective's optax solve for many directions, vmapped against one call "
                    "per direction; best of the repeats, compilation excluded.")
    benchdoc.write_if_asked(args, "steering", argv, tables, printed.text, packages=("optax", "torch"),
                            summary=summary.strip())
    return {"token": token, "alignment": aligned}


if __name__ == "__main__":
    main()
