"""Errors with field/reason/fix, the artifact store (atomic writes, locks, hashing) and the stage runner."""
