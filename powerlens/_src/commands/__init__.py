"""Implementations of the ``powerlens`` sub-commands (the parser lives in powerlens.cli)."""
