"""Closed-form and gradient-based rank-1 steering of the last layer."""
