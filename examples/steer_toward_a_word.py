"""Steer a model's last attention layer toward the read-out direction of a word.

u is the unit unembedding row of WORD's token (lm_head, or the tied word embeddings).
The last layer's output weight gets a rank-1 change O' = O + α u wᵀ (design.md §4), so
F' = F + α u zᵀ with z = V_catᵀ w. α is not searched: under the `paper` rule the
output of the steered layer is y_i ∝ p_i + α s_i u with p_i, s_i computable from the
tokens entering it, so cos(y_i, u) = (b_i + α s_i) / sqrt(p⊥_i² + (b_i + α s_i)²) and the
smallest α giving every token cos >= --target has a closed form
(pl.alignment_alpha). A token with s_i < 0 turns away from u as α grows;
then (--sign auto) the target is put on the sign-free |cos|, the paper's alignment γ.

Printed: α, ||ΔO||_F, the predicted (α z·u + zᵀFu / z·u) and exact top eigenvalue of F',
the final tokens' alignment with u before/after under the `paper` rule, and what the
model's own forward pass (FFN included) does: mean cos with u of the final hidden states
and, for a decoder, the next-token top-k and the word's probability, against activation
addition (h <- h + βu at the same layer, same mean change of the layer output).
Written to --out: alignment_hist.png, topk.png (decoders) and steer.json.

    python examples/steer_toward_a_word.py                               # SmolLM2, " Paris"
    python examples/steer_toward_a_word.py --model minilm --word king --quick
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

import powerlens as pl

DEFAULT_TEXTS = ["My favourite city is", "The weather today is", "For dinner we will cook"]


def paper_final_cos(layers, x0, valid, u):
    """cos(x_i, u) of every valid token after all layers of the `paper` dynamics (flat)."""
    Y = np.asarray(pl.run_batch(layers, x0, valid, dynamics=pl.Dynamics.paper(), observe=("final",))["final"],
                   np.float64)
    return ((Y @ u) / np.linalg.norm(Y, axis=-1))[np.asarray(valid)]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2, minilm, a HF folder, a cached hub id or a .gguf")
    ap.add_argument("--word", default="Paris", help="steer toward this word's token (must be one token)")
    ap.add_argument("--text", action="append", help="a prompt (repeat for several)")
    ap.add_argument("--target", type=float, default=0.9, help="alignment every final token must reach, in (0, 1)")
    ap.add_argument("--w", default="value", choices=["value", "inverse"],
                    help="value: w = V u/||V u|| (largest z·u); inverse: z = u")
    ap.add_argument("--sign", default="auto", choices=["auto", "signed", "free"],
                    help="target cos(y_i, u) >= c (signed), |cos| >= c (free, the paper's γ), or signed "
                         "when feasible else free (auto)")
    ap.add_argument("--quick", action="store_true", help="small settings: one prompt, no perplexity")
    ap.add_argument("--out", default=os.path.join("examples_out", "steer"), help="output folder")
    args = ap.parse_args(argv)
    texts = args.text or (DEFAULT_TEXTS[:1] if args.quick else DEFAULT_TEXTS)

    model = pl.load(args.model)
    direction = pl.parse_direction(f"token:{args.word}", model=model)
    u = direction.vector
    x0, valid = pl.embed(model, texts)
    X, vb = pl.entering_states(model.layers, x0, valid)          # tokens entering the last layer (paper rule)
    signed = args.sign != "free"
    try:
        aa = pl.alignment_alpha(model.layers, X, u, target=args.target, valid=vb, w=args.w, signed=signed)
    except ValueError as exc:      # a token with s_i < 0 cannot reach +u; the sign-free |cos| can
        if args.sign != "auto":
            raise
        print(f"signed target infeasible ({str(exc).split(':')[0]}); using the sign-free |cos(y_i, u)| instead")
        signed = False
        aa = pl.alignment_alpha(model.layers, X, u, target=args.target, valid=vb, w=args.w, signed=False)
    r = pl.rank1(model.layers, u, alpha=aa.alpha, w=args.w)
    before = paper_final_cos(model.layers, x0, valid, u)
    after = paper_final_cos(r.layers, x0, valid, u)
    print(f"{args.model}: steer layer {r.layer} toward token {direction.token!r} (id {direction.token_id}), "
          f"{len(texts)} prompts, {int(np.sum(valid))} tokens, target alignment {args.target}")
    print(f"alpha = {r.alpha:.6g} (closed form, w={args.w}), ||ΔO||_F = {r.delta_norm:.6g}, z·u = {r.zu:.4g}")
    print(f"top eigenvalue of F': predicted {r.predicted_eigenvalue:.6g}, exact (branch) "
          f"{r.branch_eigenvalue.real:.6g}{r.branch_eigenvalue.imag:+.3g}j, shifted top "
          f"{r.exact_top.real:.6g}{r.exact_top.imag:+.3g}j; |cos(v1', u)| = {abs(r.branch_eigenvector @ u):.4f}")
    print(f"paper-rule final alignment cos(x_i, u): before mean {before.mean():.4f} min {before.min():.4f}; "
          f"after mean {after.mean():.4f} min {after.min():.4f} (min |cos| {np.abs(after).min():.4f}, "
          f"target {'cos' if signed else '|cos|'} >= {args.target})")

    eff = pl.output_effects(model, u, r.delta_O, texts, target_id=direction.token_id, k=50,
                         neutral=None if args.quick else ["The weather is nice today.", "She opened the door."])
    c = eff["conditions"]
    print(f"model's own forward (FFN included), activation addition with β = {eff['beta']:.4g}:")
    for name in ("before", "rank1", "activation_addition"):
        line = f"  {name:>19}: mean cos(h_i, u) {c[name]['alignment']:+.4f}"
        if eff["decoder"]:
            top = ", ".join(f"{t['token']!r} {t['prob']:.3f}" for t in c[name]["topk"][0][:5])
            line += f", p({direction.token!r}) = {c[name]['target_prob_mean']:.4g}; top-5 [{top}]"
            line += f", perplexity {c[name]['perplexity']:.2f}" if "perplexity" in c[name] else ""
        else:
            line += f", pooled-embedding cos {c[name]['pooled_cos_mean']:+.4f}"
        print(line)

    os.makedirs(args.out, exist_ok=True)
    figs = [pl.plots.plot_histogram_before_after(before, after, os.path.join(args.out, "alignment_hist.png"),
                                              xlabel="cos(final token, u), paper rule",  # signed, always
                                              title=f"Steering toward {direction.token!r}: α = {r.alpha:.3g}")]
    if eff["decoder"]:      # the union of the top-5 before and after, probabilities from the top-50 lists
        top = lambda name: {t["id"]: t for t in c[name]["topk"][0]}
        ids = list(dict.fromkeys(list(top("before"))[:5] + list(top("rank1"))[:5]))
        prob = lambda name: [top(name)[i]["prob"] if i in top(name) else 0.0 for i in ids]
        labels = [(top("before") | top("rank1"))[i]["token"] for i in ids]
        figs.append(pl.plots.plot_bars(labels, prob("before"), prob("rank1"), os.path.join(args.out, "topk.png"),
                                    title=f"Next token after {texts[0]!r}, rank-1 steering toward {direction.token!r}"))
    with open(os.path.join(args.out, "steer.json"), "w") as fh:
        json.dump({"model": args.model, "texts": texts, "direction": direction.to_json(), "target": args.target,
                   "signed": signed,
                   "rank1": r.to_json() | {"spectrum": None}, "alignment_alpha": aa.to_json(),
                   "paper_alignment_before": before.tolist(), "paper_alignment_after": after.tolist(),
                   "effects": eff}, fh, indent=1)
    np.save(os.path.join(args.out, "delta_O.npy"), r.delta_O)
    print(f"wrote {', '.join(figs)}, steer.json and delta_O.npy in {args.out}")
    return {"rank1": r, "alpha": aa, "signed": signed, "before": before, "after": after, "effects": eff, "u": u,
            "out": args.out}


if __name__ == "__main__":
    main()
