"""How far your own prompts align with each layer's principal eigenvector.

The prompts are embedded with the model's tokenizer and embeddings, then run through the
attention layers under the `paper` rule x <- N2(x + Attn(x)) (FFN dropped), or with
--rule faithful under the model's own norm placement. For each layer t (design.md §3):

    γ_t   mean over tokens of ||P_S x_i|| / ||x_i|| after layer t, S = S_t the layer's
          principal subspace; beside it the chance level for a random direction in R^d
    ρ_t   share of tokens whose alignment grows across layer t, beside the same share
          against a random subspace and against another layer's S (controls), and a
          one-sided binomial p-value for ρ_t > 1/2

both in the shifted (|1 + λ|) and plain (|λ|) orderings. With --shared-layer L --steps T
layer L is iterated T times as a shared-weight (ALBERT-like) system instead.
Written to --out: alignment.png and align.json.

    python examples/align_your_prompts.py --text "The cat sat on the mat." --text "Paris is in France."
    python examples/align_your_prompts.py --model smollm2 --prompts my_prompts.txt --rule faithful
    python examples/align_your_prompts.py --shared-layer 2 --steps 20
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

import powerlens as pl

DEFAULT_TEXTS = ["The cat sat on the mat because it was warm.",
                 "Paris is the capital and largest city of France.",
                 "I like to drink green tea in the morning."]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="minilm", help="minilm, smollm2, a HF folder, a cached hub id or a .gguf")
    ap.add_argument("--text", action="append", help="a prompt (repeat for several)")
    ap.add_argument("--prompts", help="a text file, one prompt per line")
    ap.add_argument("--rule", default="paper", choices=["paper", "faithful"])
    ap.add_argument("--shared-layer", type=int, default=None, help="iterate this layer as a shared-weight system")
    ap.add_argument("--steps", type=int, default=None, help="steps for --shared-layer")
    ap.add_argument("--quick", action="store_true", help="small settings: two short prompts")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random-subspace control")
    ap.add_argument("--out", default=os.path.join("examples_out", "align"), help="output folder")
    args = ap.parse_args(argv)
    texts = list(args.text or [])
    if args.prompts:
        with open(args.prompts) as fh:
            texts += [line.strip() for line in fh if line.strip()]
    if not texts:
        texts = ["The cat sat on the mat.", "Paris is in France."] if args.quick else DEFAULT_TEXTS

    model = pl.load(args.model)
    res = pl.align(model, texts, dynamics=pl.Dynamics(rule=args.rule), shared_layer=args.shared_layer,
                   steps=args.steps, seed=args.seed)
    print(f"{args.model}: rule {res.rule}, {res.mode}, {res.n_prompts} prompts, {res.n_tokens} tokens")
    print(f"{'t':>3} {'layer':>5} {'γ shifted':>9} {'γ plain':>8} {'chance':>7} {'ρ shifted':>9} "
          f"{'ρ random':>8} {'ρ other':>8} {'p-value':>9} {'ρ plain':>8}")
    fmt = lambda v, w=8, p=4: f"{'-':>{w}}" if not np.isfinite(v) else f"{v:{w}.{p}f}"
    ms, mp = res.measures["shifted"], res.measures["plain"]
    for t in ms.t[1:]:
        pv = "-" if not np.isfinite(ms.rho_pvalue[t]) else f"{ms.rho_pvalue[t]:.2e}"
        layer = ms.layer[t] if args.shared_layer is None else args.shared_layer
        print(f"{t:3d} {layer:5d} {fmt(ms.gamma[t], 9)} {fmt(mp.gamma[t])} "
              f"{fmt(ms.chance_gamma[t], 7)} {fmt(ms.rho[t], 9)} {fmt(ms.rho_random[t])} "
              f"{fmt(ms.rho_other_layer[t])} {pv:>9} {fmt(mp.rho[t])}")
    for order in ("shifted", "plain"):
        s = res.summary(order)
        print(f"{order:>7}: mean γ {s['mean_gamma']:.4f} (chance {s['mean_chance']:.4f}), "
              f"γ above chance on {s['share_gamma_above_chance']:.0%} of steps; mean ρ {s['mean_rho']:.3f} "
              f"(random control {s['mean_rho_random_control']:.3f}), ρ significant (p<0.01) on "
              f"{s['share_rho_significant']:.0%} of steps")

    os.makedirs(args.out, exist_ok=True)
    figs = res.plot(args.out, title=args.model)
    with open(os.path.join(args.out, "align.json"), "w") as fh:
        json.dump({"model": args.model, "texts": texts, **res.to_json()}, fh, indent=1)
    print(f"wrote {', '.join(figs)} and {os.path.join(args.out, 'align.json')}")
    return {"result": res, "texts": texts, "model": model, "out": args.out}


if __name__ == "__main__":
    main()
