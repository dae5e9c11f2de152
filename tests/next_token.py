"""The tests' own next-token distribution of a model, computed from its public pieces (not
from the steering code under test)."""
from __future__ import annotations

import numpy as np

import powerlens as pl


def last_token_probs(model, texts) -> np.ndarray:
    """p(. | text) "float64[B V]" at each text's last valid token: the model's own pass
    (``run_states`` with ``Dynamics.full()``), then its logits, softmaxed in float64."""
    x0, valid = pl.embed(model, texts)
    h = np.asarray(pl.run_states(model, x0, valid, dynamics=pl.Dynamics.full())[-1])
    v = np.asarray(valid, bool)
    last = v.shape[1] - 1 - np.argmax(v[:, ::-1], axis=1)
    z = np.asarray(pl.logits(model, h[np.arange(len(last)), last]), np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)
