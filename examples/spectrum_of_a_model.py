"""The spectrum of every attention layer of a pretrained model.

Each unique layer t has the matrix F_t = W_o · concat_h(W_v,h) (d, d) that the token
dynamics iterate (design.md §1). The `paper` layer x <- N2(x + F x) is a power step on
I + F, so the eigenvalue that wins is the one of largest |1 + λ| (the *shifted*
ordering), not the one of largest |λ| (the *plain* ordering of the paper's wording).

Printed per layer: the shifted principal eigenvalue λ1 and |1 + λ1|, the plain one and
|λ|, the power-method rate |μ2/μ1| (shifted), whether λ1 is a complex pair, and a flag
where the two orderings disagree. Written to --out: eigenvalues.png (each layer's
eigenvalues in the complex plane, with circles of constant |1 + λ| around -1) and
spectrum.json (the same numbers as powerlens' `spectrum` command).

    python examples/spectrum_of_a_model.py                           # MiniLM, 6 layers
    python examples/spectrum_of_a_model.py --model smollm2 --quick   # first 3 of 30 layers
"""
from __future__ import annotations

import argparse
import json
import os

import numpy as np

import powerlens as pl


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="minilm", help="minilm, smollm2, a HF folder, a cached hub id or a .gguf")
    ap.add_argument("--layers", type=int, default=None, help="only the first N unique layers (default: all)")
    ap.add_argument("--quick", action="store_true", help="small settings: the first 3 layers")
    ap.add_argument("--out", default=os.path.join("examples_out", "spectrum"), help="output folder")
    args = ap.parse_args(argv)
    n_layers = 3 if args.quick and args.layers is None else args.layers

    model = pl.load(args.model)
    if n_layers is None:
        spectra = pl.model_spectra(model)                      # float64 eig of every F_t
    else:
        F = np.asarray(pl.layer_matrices(model.layers), np.float64)[:n_layers]
        spectra = pl.layer_spectra(F)
    cfg = model.layers.config
    print(f"{args.model}: {model.info.family}, d={cfg.d_model}, {cfg.n_heads} heads "
          f"({cfg.n_kv_heads} kv), {model.layers.n_unique} unique layers; showing {len(spectra)}")
    print(f"{'layer':>5} {'shifted λ1':>22} {'|1+λ1|':>9} {'plain λ1':>22} {'|λ1|':>9} {'|μ2/μ1|':>8} "
          f"{'complex':>7} {'differ':>6}")
    for s in spectra:
        a, b = s.shifted, s.plain
        print(f"{s.layer:5d} {a.top.real:+11.5f}{a.top.imag:+10.5f}j {a.mu1:9.5f} "
              f"{b.top.real:+11.5f}{b.top.imag:+10.5f}j {b.mu1:9.5f} {a.ratio:8.5f} "
              f"{'yes' if a.is_complex else 'no':>7} {'YES' if s.orderings_differ else '-':>6}")
    differ = [s.layer for s in spectra if s.orderings_differ]
    print(f"orderings differ on {len(differ)} of {len(spectra)} layers: {differ}")

    os.makedirs(args.out, exist_ok=True)
    fig = pl.plots.plot_eigenvalues(spectra, os.path.join(args.out, "eigenvalues.png"),
                                 title=f"Eigenvalues of F_t = O_t V_t, {args.model}")
    with open(os.path.join(args.out, "spectrum.json"), "w") as fh:
        json.dump({"model": args.model, "layers": pl.spectra_json(spectra)}, fh, indent=1)
    print(f"wrote {fig} and {os.path.join(args.out, 'spectrum.json')}")
    return {"spectra": spectra, "out": args.out}


if __name__ == "__main__":
    main()
