"""Steering the last layer toward a chosen direction u (design.md §4).

    rank1(layers, u, alpha=, w=)           closed form O' = O + alpha u w^T, spectra before/after
    layer_w_choice(layers, w='auto')       which closed-form w a layer gets ('inverse' needs full-rank V_cat)
    minimal_alpha(layers, u, x0)           smallest alpha: (a) u principal, (b) every token aligned
    optimize_steering(layers, x0, AlignmentObjective(U, target))   optax, vmapped: min ||dO|| s.t. alignment
    optimize_steering(model, x0, TokenObjective(ids, p, max_kl))  min ||edit|| s.t. p(token) and a control-KL bound
    edit_effects(model, prompts, edits)    the methods compared on the model's own outputs
    output_effects(model, u, dO, prompts)  before / rank-1 / activation addition on the outputs
    parse_direction('token:WORD'|'f.npy'|'random', model=)
    make_edit / save_edit / load_edit / apply_edit   edits as files (edit_file), checked against the model
"""
from .directions import Direction, as_direction, parse_direction, random_direction, token_direction, unembedding_matrix
from .rank1 import Rank1Result, WChoice, checkpoint_delta, choose_w, layer_w_choice, rank1, resolve_w, steer_layers
from .alpha import (AlignmentAlpha, MinimalAlpha, PrincipalAlpha, alignment_alpha, entering_states, minimal_alpha,
                    principal_alpha)
from .optimize import AlignmentObjective, SteeringConfig, SteeringResult, TokenObjective, optimize_steering
from .effects import forward_final, output_effects, steered_model
from .token import CONTROL_PROMPTS, TokenSteeringResult
from .compare import edit_effects

__all__ = [
    "Direction", "as_direction", "parse_direction", "random_direction", "token_direction", "unembedding_matrix",
    "Rank1Result", "WChoice", "checkpoint_delta", "choose_w", "layer_w_choice", "rank1", "resolve_w", "steer_layers",
    "AlignmentAlpha", "MinimalAlpha", "PrincipalAlpha", "alignment_alpha", "entering_states", "minimal_alpha",
    "principal_alpha", "SteeringResult", "optimize_steering", "AlignmentObjective", "TokenObjective", "SteeringConfig", "forward_final", "output_effects", "steered_model",
    "CONTROL_PROMPTS", "TokenSteeringResult", "edit_effects",
]
