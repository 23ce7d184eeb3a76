"""Analyses beside the build: per-layer sensitivity."""
