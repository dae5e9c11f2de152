"""The ``powerlens`` command line.

    powerlens simulate  (--spectrum 3,1.5+0.5j,... | --weights system.npz) [options] --out DIR
    powerlens spectrum  (MODEL | --weights system.npz) --out DIR
    powerlens align     MODEL (--text "..." ... | --prompts FILE) --out DIR
    powerlens steer     MODEL --direction token:WORD|file.npy|random ... --out DIR
    powerlens reproduce [--models ...] [--out results] [--quick] [--seed S]
    powerlens sweep     SPEC.toml --out DIR [--processes N | --coordinator HOST:PORT ...]

MODEL is a model folder, a .gguf file, a hub id in the local Hugging Face cache, or an
alias: minilm, smollm2, gemma3. ``powerlens COMMAND --help`` lists a command's options.

Every error on bad input is printed as one line naming what is wrong (exit status 2);
``--debug`` anywhere on the command line shows the traceback instead.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

from ._src.runtime.cache import compilation_cache as _compilation_cache       # light: neither imports JAX
from ._src.runtime.threads import limit_blas_threads as _limit_blas_threads
from ._src.commands.steer_limits import STEER_MAX_PROMPTS, STEER_MAX_STEPS  # noqa: F401  (imports nothing)

# transformers announces at import that torch is missing; torch is never needed here (only
# tokenizers are used), so the notice would alarm for nothing
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

MODEL_ALIASES = ("minilm", "smollm2", "gemma3")     # powerlens._src.models.load's ALIASES and ASSEMBLED (tests agree)
MODEL_HELP = ("a model folder, a .gguf file, a hub id in the local Hugging Face cache, or an alias: "
              + ", ".join(MODEL_ALIASES))

# The choices of the options, as the library names them (powerlens._src.dynamics.ATTENTION_MODES and
# RULES, powerlens._src.analysis.ORDERS; the tests check that they agree). Written out here so that
# building the parser, --help and every usage error import no numerical library.
ATTENTION_MODES = ("softmax", "uniform", "identity")
RULES = ("paper", "post_ln", "pre_ln", "full")
ORDERS = ("shifted", "plain")

# pl.load's storage dtypes and matmul precisions offered on the command line (a subset of
# powerlens._src.models.reader.FLOAT_NAMES and powerlens._src.dynamics.params.PRECISIONS; the tests check it)
DTYPES = ("float32", "bfloat16", "float16")
PRECISIONS = ("highest", "high", "default")

SEED_LIMIT = 2 ** 31          # powerlens._src.dynamics.synthetic.SEED_LIMIT (a sweep row's int32 seed)
STEER_DESCRIPTION = """\
steer moves one layer of a model (or an explicit system) toward a direction u.

  --objective alignment (default): the last layer's output matrix O += alpha u w^T, with alpha
      given (--alpha) or the smallest one at which every final token of the paper rule has
      cos(x, u) >= --target-alignment; --optimize learns a rank-r change instead (optax).
  --objective token (decoders, --direction token:WORD): four methods make WORD the model's own
      next token at every prompt with p >= --target-prob and mean control KL <= --max-kl:
      the closed form at the paper's alpha, the closed form at the token's alpha, a learned
      rank-r dO (--steps Adam steps) and activation addition (--steps Adam steps); the two
      optimised methods run at the frontier levels 0.1/0.3/0.5/0.9 and --target-prob at once
      (frontier.png). Progress goes to stderr (--quiet: none).

Writes steer.json, edit.npz (the edit as a file: powerlens.load_edit / apply_edit, or
steer MODEL --apply edit.npz) and figures; --objective token also delta_O.npy and frontier.png.
"""


def _common_dynamics(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention", choices=ATTENTION_MODES, default="softmax",
                   help="attention mode (default: softmax)")
    p.add_argument("--rule", choices=[r for r in RULES if r != "full"], default="paper",
                   help="layer rule: paper x<-N2(x+Attn x); post_ln x<-LN(x+Attn x); pre_ln x<-x+Attn(LN x) "
                        "(an explicit system has no FFN, so no 'full')")
    p.add_argument("--order", choices=ORDERS, default="shifted",
                   help="which eigenvalue is principal: by |1+lambda| (shifted, default) or |lambda| (plain)")
    p.add_argument("--keep-bias", action="store_true",
                   help="keep the constant c = O b_v + b_o in the paper rule (dropped by default)")
    p.add_argument("--x64", action="store_true", help="run in float64")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _model_source(p: argparse.ArgumentParser, *, optional: bool) -> None:
    p.add_argument("model", nargs="?" if optional else None, help=MODEL_HELP)
    p.add_argument("--allow-download", action="store_true",
                   help="fetch a hub id missing from the local Hugging Face cache (needs network; off by default)")


def _weights_dtype(p: argparse.ArgumentParser) -> None:
    """MODEL's ``--dtype`` and ``--precision``, passed to ``pl.load(dtype=, precision=)``."""
    p.add_argument("--dtype", default=None, metavar="|".join(DTYPES),
                   help="with MODEL: hold the weights in this dtype (default: the checkpoint's own; bf16 stays "
                        "bf16); each step computes in float32, one layer cast at a time")
    p.add_argument("--precision", default=None, metavar="|".join(PRECISIONS),
                   help="with MODEL: matmul precision of each step (default highest: full float32, never TF32)")


def _output(p: argparse.ArgumentParser, *, default=None,
            help="output folder (written atomically; a folder powerlens wrote is replaced whole)") -> None:
    p.add_argument("--out", help=help, default=default, required=default is None)
    p.add_argument("--overwrite", action="store_true",
                   help="start afresh in a folder powerlens wrote with other settings or by another command "
                        "(reproduce; the other commands replace such a folder anyway); a folder holding files "
                        "powerlens did not write is never emptied")


def _prompt_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", action="append", help="a prompt (repeat for several)")
    p.add_argument("--prompts", metavar="FILE", help="a text file with one prompt per line")


def _system_source(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("system (one of --weights or --spectrum)")
    g.add_argument("--weights", metavar="NPZ",
                   help="weights file: W_q, W_k, W_v (H,e,d) or (L,H,e,d); W_o (d,H*e) or (L,d,H*e); "
                        "optional b_q, b_k, b_v (H,e), b_o (d,), scale, window, causal; "
                        "W_q/W_k may be left out for uniform/identity attention")
    g.add_argument("--spectrum", help="eigenvalues of a synthetic F, comma separated; a+bj stands for the pair a+-bj")
    g.add_argument("--kind", choices=["symmetric", "normal", "nonnormal"], default="normal",
                   help="synthetic F: symmetric, normal (Schur blocks) or nonnormal (random similarity)")
    g.add_argument("--dim", type=int, default=None, help="width d of a synthetic system (pads with zero eigenvalues)")
    g.add_argument("--heads", type=int, default=1, help="heads of a synthetic system (default 1)")
    g.add_argument("--beta", type=float, default=1.0, help="inverse temperature of synthetic queries/keys")
    g.add_argument("--norm", choices=["l2", "layernorm", "rmsnorm"], default=None,
                   help="norm for post_ln/pre_ln on explicit systems (default layernorm; paper always uses l2)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="powerlens", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("simulate", help="run the token dynamics of a synthetic system or a weights file")
    _system_source(p)
    _common_dynamics(p)
    p.add_argument("--steps", type=int, default=None,
                   help="iterate one layer T times as a shared-weight system (default: synthetic 50, "
                        "weights file: each of its L layers once)")
    p.add_argument("--shared-layer", type=int, default=None, help="with --steps and a multi-layer file: which layer")
    p.add_argument("--tokens", type=int, default=16, help="number of random unit initial tokens (default 16)")
    p.add_argument("--batch", type=int, default=1, help="number of random prompts (default 1)")
    p.add_argument("--init", metavar="NPY", help="initial tokens (n, d) or (B, n, d) instead of random ones")
    p.add_argument("--save-states", action="store_true", help="also write states.npy (T+1, n, d) or (T+1, B, n, d)")
    _output(p)
    p.set_defaults(func=_simulate)

    p = sub.add_parser("spectrum", help="spectra of every layer's F_t = O_t V_t, both orderings")
    _model_source(p, optional=True)
    _weights_dtype(p)
    _system_source(p)
    p.add_argument("--x64", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress bar (a large model's layers, one at a time)")
    _output(p)
    p.set_defaults(func=_spectrum)

    p = sub.add_parser("align", help="gamma_t and rho_t of a pretrained model on your prompts")
    _model_source(p, optional=False)
    _weights_dtype(p)
    _prompt_options(p)
    p.add_argument("--rule", choices=["paper", "faithful"], default="paper",
                   help="paper: x<-N2(x+Attn x); faithful: the model's own norm placement (post_ln or pre_ln)")
    p.add_argument("--shared-layer", type=int, default=None, help="iterate this layer as a shared-weight system")
    p.add_argument("--steps", type=int, default=None, help="with --shared-layer: number of iterations")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-subspace control")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _output(p)
    p.set_defaults(func=_align)

    p = sub.add_parser("steer", help="steer a layer toward a direction or a next token; save and apply edits",
                       description=STEER_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_source(p, optional=True)
    _weights_dtype(p)
    p.add_argument("--weights", metavar="NPZ", help="an explicit system instead of MODEL (with --init)")
    p.add_argument("--init", metavar="NPY", help="initial tokens for --weights")
    p.add_argument("--direction", help="token:WORD, a .npy vector, or random (needed unless --apply)")
    p.add_argument("--apply", metavar="EDIT",
                   help="apply a saved edit (edit.npz, written by steer) to MODEL and report its effects on "
                        "the prompts, instead of learning one")
    p.add_argument("--alpha", type=float, help="the perturbation size alpha (closed form)")
    p.add_argument("--target-alignment", type=float,
                   help="alignment cos(x, u) every final token must reach (default 0.99; signed: the tokens "
                        "must point toward u, see --sign-free): the closed form takes the smallest such alpha; "
                        "--optimize uses it as its constraint")
    p.add_argument("--sign-free", action="store_true",
                   help="target the sign-free alignment |cos(x, u)| (the paper's gamma) instead of the signed one")
    p.add_argument("--optimize", action="store_true",
                   help="gradient-based steering (optax): min ||dO||_F subject to the target alignment")
    p.add_argument("--rank", type=int, default=1,
                   help="rank of the learned change with --optimize (1 .. min(d, H*d_head), default 1)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"Adam steps of --optimize (default 300, at most {STEER_MAX_STEPS}); with --objective token "
                        f"for each of the two optimised methods, all frontier levels at once")
    p.add_argument("--objective", choices=["alignment", "token"], default="alignment",
                   help="alignment: the paper rule's final-token alignment with the direction (default); token: "
                        "the model's own next-token probability of the direction's token (decoders, "
                        "--direction token:WORD), with all four methods compared at the frontier levels "
                        "0.1/0.3/0.5/0.9 and --target-prob")
    p.add_argument("--target-prob", type=float, default=0.5,
                   help="with --objective token: p(token | prompt) every prompt must reach (default 0.5)")
    p.add_argument("--max-kl", type=float, default=0.5,
                   help="with --objective token: bound on the mean KL(before || after) over the control prompts "
                        "(nats, default 0.5)")
    p.add_argument("--controls", metavar="FILE", help="with --objective token: control prompts, one per line "
                                                       f"(at most {STEER_MAX_PROMPTS}; default: a few neutral "
                                                       "prompts shipped with powerlens)")
    p.add_argument("--paraphrases", metavar="FILE",
                   help="with --objective token: paraphrase prompts, one per line, on which the edits are evaluated "
                        f"(generalisation; at most {STEER_MAX_PROMPTS}; three are shipped for "
                        "\"The capital of France is\")")
    p.add_argument("--layer", type=int, default=None,
                   help="with --objective token: the edited layer, counted from 0; -1 is the last (the default)")
    p.add_argument("--w", choices=["auto", "inverse", "value"], default="auto",
                   help="closed-form choice of w: inverse (z = u; needs a full-rank value matrix), value "
                        "(w = V_cat u / ||V_cat u||), or auto (default: inverse where possible, else value)")
    _prompt_options(p)
    p.add_argument("--seed", type=int, default=0, help="seed of a random direction and of the optimiser")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _output(p)
    p.set_defaults(func=_steer)

    p = sub.add_parser("reproduce", help="the whole study: synthetic claims, real models, steering, report")
    p.add_argument("--models", nargs="*", default=[], help="extra Hugging Face ids to look up in the local cache")
    _output(p, default="results", help="output folder (default results/); a run with the same settings resumes "
                                         "into it, one with other settings is refused unless --overwrite")
    p.add_argument("--quick", action="store_true", help="smaller sweeps (about 2 minutes)")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives the same results.json")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes for the real models (default: one per model, at most 2 per core; "
                        "1: all in this process)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress on stderr (sections, the workers' models and sections)")
    p.add_argument("--sections", nargs="*", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_reproduce)
    from ._src.commands.sweep import add_sweep_parser; add_sweep_parser(sub)  # noqa: E702
    return parser


def _simulate(args):
    if args.spectrum and args.steps is None:
        args.steps = 50
    from ._src.commands.simulate import cmd_simulate
    return cmd_simulate(args)


def _spectrum(args):
    if args.model and (args.weights or args.spectrum):
        raise ValueError("give either MODEL or --weights/--spectrum, not both")
    if args.model:
        from ._src.commands.models import cmd_spectrum_model
        return cmd_spectrum_model(args)
    args.steps = None
    args.attention = None  # spectra need only W_v and W_o
    from ._src.commands.simulate import cmd_spectrum_weights
    return cmd_spectrum_weights(args)


def _align(args):
    from ._src.runtime.figures import FigureProcess
    # forked before JAX is imported: the child imports the drawing modules on the other core
    # while this process loads the model and computes, then draws the figures
    with FigureProcess(["powerlens._src.analysis.alignment"]) as figures:
        from ._src.commands.models import cmd_align
        return cmd_align(args, figures=figures)


def check_seed(args) -> None:
    """``--seed``, where a command has one: an integer in 0 .. SEED_LIMIT - 1."""
    seed = getattr(args, "seed", None)
    if seed is not None and not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"--seed must be an integer in 0 .. {SEED_LIMIT - 1}, got {seed}")


def _file(flag: str, path) -> None:
    if path and not os.path.isfile(path):
        raise ValueError(f"{flag} file {path!r} does not exist")


def _positive(args, *flags: str, what: str = "a positive integer") -> None:
    for flag in flags:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and value <= 0:
            raise ValueError(f"{flag} must be {what}, got {value}")


def check_model_name(name, allow_download: bool = False) -> None:
    """MODEL, refused at once when it is certainly unknown: not an alias, not a path, and (a hub
    id) not in the local Hugging Face cache unless --allow-download (what
    :func:`powerlens._src.models.load.resolve` finds, looked up without loading it)."""
    from ._src.io import hub_cache_path
    if name is None or name in MODEL_ALIASES or os.path.exists(name):
        return
    if ("/" in name or not name.endswith(".gguf")) and (allow_download or hub_cache_path(name) is not None):
        return
    raise ValueError(f"cannot find model {name!r}: not an alias ({', '.join(MODEL_ALIASES)}), not a path, and not in "
                     f"the local Hugging Face cache; to fetch it from the hub, pass --allow-download on a machine "
                     f"that is online")


def check_options(args) -> None:
    """Every option value, file and model name that can be checked before a numerical library
    is imported (one line each, exit 2, in under a tenth of a second): counts and ranges,
    that the files named exist (a sweep spec: that it is readable TOML), that MODEL is known.
    What needs the model or the arrays (a layer index, a spectrum's text, a file's shapes) is
    checked where they are read."""
    import math
    check_seed(args)
    cmd = args.command
    if cmd == "steer":
        check_steer_options(args)
    check_model_name(getattr(args, "model", None), getattr(args, "allow_download", False))
    check_weights_dtype(args)
    if cmd in ("simulate", "spectrum"):
        if args.weights and args.spectrum:
            raise ValueError("give either --weights or --spectrum, not both")
        if not (args.weights or args.spectrum or getattr(args, "model", None)):
            raise ValueError("give either --weights system.npz or --spectrum (a synthetic system)")
    for flag in ("--weights", "--init", "--prompts", "--controls", "--paraphrases"):
        _file(flag, getattr(args, flag[2:], None))
    if cmd in ("simulate", "spectrum"):
        _positive(args, "--heads", "--dim", what="positive")
        if not math.isfinite(args.beta):
            raise ValueError(f"--beta must be finite, got {args.beta}")
    if cmd == "simulate":
        _positive(args, "--steps")
        _positive(args, "--tokens", "--batch", what="positive")
    if cmd == "align":
        if not (args.text or args.prompts):
            raise ValueError("no prompts: give --text \"...\" (repeatable) or --prompts FILE")
        if (args.shared_layer is None) != (args.steps is None):
            raise ValueError("--shared-layer and --steps go together")
        _positive(args, "--steps")
    if cmd == "steer":
        d = args.direction or ""
        if d.endswith(".npy"):
            _file("--direction", d)
    if cmd == "sweep":
        from ._src.io import read_toml
        from ._src.runtime.distributed import check_init_timeout
        _positive(args, "--processes", "--num-processes")
        check_init_timeout(args.init_timeout)
        read_toml(args.spec)
    if cmd == "reproduce":
        _positive(args, "--jobs")


def check_weights_dtype(args) -> None:
    """``--dtype`` and ``--precision``, where a command has them: one of :data:`DTYPES` and
    :data:`PRECISIONS`, and only with MODEL (an explicit system's file keeps its own dtype)."""
    if not hasattr(args, "precision"):
        return
    if args.dtype is not None and args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.precision is not None and args.precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {args.precision!r}")
    if getattr(args, "weights", None) and (args.dtype is not None or args.precision is not None):
        raise ValueError(f"{'--dtype' if args.dtype is not None else '--precision'} applies to MODEL, not to "
                         f"--weights (an explicit system keeps its file's dtype)")


def check_steer_options(args) -> None:
    """steer's option values that need no model (before anything is imported): one line each."""
    if args.apply is not None:
        clash = [f for f, v in (("--direction", args.direction), ("--alpha", args.alpha),
                                ("--target-alignment", args.target_alignment), ("--optimize", args.optimize),
                                ("--weights", args.weights)) if v]
        if clash:
            raise ValueError(f"--apply uses a saved edit; {clash[0]} cannot be combined with it")
        if not os.path.isfile(args.apply):
            raise ValueError(f"--apply edit file {args.apply!r} does not exist")
    elif not args.direction:
        raise ValueError("give --direction (token:WORD, a .npy vector, or random), or --apply EDIT")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be a positive integer, got {args.steps}")
    if args.steps is not None and args.steps > STEER_MAX_STEPS:
        raise ValueError(f"--steps {args.steps} is more than {STEER_MAX_STEPS}, the most Adam steps steer runs")
    if args.rank < 1:
        raise ValueError(f"--rank must be a positive integer, got {args.rank}")
    if args.alpha is not None and (args.target_alignment is not None or args.optimize):
        raise ValueError("--alpha fixes the change; it cannot be combined with --target-alignment or --optimize")
    if args.objective == "alignment" and args.apply is None:
        token_only = [f for f, v in (("--controls", args.controls), ("--paraphrases", args.paraphrases),
                                     ("--layer", args.layer)) if v is not None]
        if token_only:
            raise ValueError(f"{token_only[0]} needs --objective token")
        if args.steps is not None and not args.optimize:
            raise ValueError("--steps sets the Adam steps of --optimize; give --optimize too")
    if args.alpha is not None:
        import math
        if not (math.isfinite(args.alpha) and args.alpha > 0):
            raise ValueError(f"--alpha must be a finite number > 0, got {args.alpha}")
        if args.alpha > 3.4028234663852886e38:
            raise ValueError(f"--alpha {args.alpha:g} overflows float32 (the largest float32 is 3.4e+38); "
                             f"give a smaller --alpha")


def _steer(args):
    check_steer_options(args)
    if args.apply is not None:
        from ._src.commands.steer import cmd_steer_apply
        return cmd_steer_apply(args)
    if args.objective == "token":
        from ._src.commands.steer_token import cmd_steer_token
        return cmd_steer_token(args)
    from ._src.commands.steer import cmd_steer
    return cmd_steer(args)


def _reproduce(args):
    from ._src.reproduce import cmd_reproduce
    from ._src.runtime.threads import single_threaded_main
    user_env = dict(os.environ)        # what the workers start from, not this process's one thread
    single_threaded_main(os.environ)   # this process's XLA on one thread (False where JAX had started already)
    return cmd_reproduce(args, worker_base_env=user_env)


_NEGATIVE_VALUE = re.compile(r"^-\.?\d")


def join_negative_values(argv):
    """``--spectrum -0.5,1`` -> ``--spectrum=-0.5,1``: argparse takes a value that starts with
    '-' and is not a plain number for an option, so an option followed by such a value is
    joined to it first."""
    out = []
    for a in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_VALUE.match(a):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def describe_failure(exc: BaseException) -> str:
    """One line for an error that reached the top: what failed, and what to do."""
    name = type(exc).__name__
    if isinstance(exc, MemoryError):
        return "out of memory; use fewer tokens, prompts or steps (or drop --save-states)"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else name
    if "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text:
        return f"the accelerator or host ran out of memory ({text[:160]}); use fewer tokens, prompts or steps"
    if isinstance(exc, OSError):
        where = f" {exc.filename!r}" if getattr(exc, "filename", None) else ""
        return f"cannot access{where}: {exc.strerror or text}"
    return f"{name}: {text}"


def main(argv=None) -> int:
    parser = build_parser()
    argv = join_negative_values(sys.argv[1:] if argv is None else list(argv))
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    args = parser.parse_args(argv)
    _limit_blas_threads()
    _compilation_cache()
    try:
        check_options(args)                     # before any numerical library is imported
        if args.command in ("simulate", "spectrum", "align", "steer"):     # a refused folder costs no compute
            from ._src.io import decide_folder
            decide_folder(args.out, command=args.command)
        if getattr(args, "x64", False):
            import jax
            with jax.enable_x64(True):          # scoped: a library caller's process keeps its setting
                return int(args.func(args) or 0)
        return int(args.func(args) or 0)
    except KeyboardInterrupt as exc:            # Ctrl-C; SIGTERM or SIGHUP while workers run (runtime.workers)
        kept = "finished chunks are kept" if args.command in ("reproduce", "sweep") else "nothing was written"
        print(f"powerlens {args.command}: interrupted; {kept}", file=sys.stderr)
        from ._src.runtime.workers import exit_status
        return _leave(exit_status(exc))
    except Exception as exc:                    # every failure is one line, exit 2 (--debug: the traceback)
        if debug:
            raise
        if isinstance(exc, (ValueError, FileNotFoundError, FloatingPointError)) and str(exc).strip():
            message = " ".join(str(exc).split())
        else:
            message = describe_failure(exc) + " (run with --debug for the traceback)"
        print(f"powerlens {args.command}: error: {message}", file=sys.stderr)
        return _leave(2)


def _leave(status: int) -> int:
    """``status``; a failed process of a multi-process run ends here instead, without the exit
    handler of jax.distributed that would wait for the others (:func:`leave_on_failure`)."""
    from ._src.runtime.distributed import leave_on_failure
    leave_on_failure(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
