"""bert converter (to be written)."""
