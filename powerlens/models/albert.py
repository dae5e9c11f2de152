"""albert converter (to be written)."""
