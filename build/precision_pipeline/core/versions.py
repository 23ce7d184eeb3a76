"""Installed distribution versions (one home; used by the engine's toolchain probe and the gate's record)."""

from __future__ import annotations

import importlib.metadata
from typing import Optional


def dist_version(*names: str) -> Optional[str]:
    """The installed version of the first of ``names`` that is installed, else None."""
    for n in names:
        try:
            return importlib.metadata.version(n)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


__all__ = ["dist_version"]
