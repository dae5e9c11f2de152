"""The bounds of ``powerlens steer``'s options and their checks, in a module that imports
nothing (the parser reads them for --help and checks them before any numerical library is
imported; ``steer`` and ``steer --objective token`` share them)."""

STEER_MAX_STEPS = 100_000     # Adam steps of steer --optimize
STEER_MAX_PROMPTS = 256       # prompts of each kind: --text/--prompts together, --controls, --paraphrases


def check_steps_option(args) -> None:
    """``--steps``: None (the optimiser's default) or a positive integer."""
    if getattr(args, "steps", None) is not None and args.steps < 1:
        raise ValueError(f"--steps must be a positive integer, got {args.steps}")


def check_prompt_count(texts) -> None:
    """At most STEER_MAX_PROMPTS prompts (--text and --prompts together)."""
    if len(texts) > STEER_MAX_PROMPTS:
        raise ValueError(f"{len(texts)} prompts (--text, --prompts); steer takes at most {STEER_MAX_PROMPTS}")
