"""Where the project's folders are (one home for these paths).

The package lives at ``<repo>/build/precision_pipeline``; ``build/`` is a *source root* (like
``src/``), not build output. Shipped data the pipeline reads (``precision_profiles/``,
``triton_repo/``) stays at the repository's top level, as the design card lays it out.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""``build/precision_pipeline``: the package's own source (hashed into stage keys)."""
SOURCE_ROOT = PACKAGE_DIR.parent
"""``build/``: the folder to put on ``sys.path`` (the Triton CPU reference backend does)."""
REPO_ROOT = SOURCE_ROOT.parent
"""The repository: ``tasks.py``, ``precision_profiles/``, ``triton_repo/``, ``k8s/``, ``artifacts/``."""


def cache_dir() -> Path:
    """Cache root: ``$PRECISION_CACHE_DIR`` or ``<repo>/.cache`` (gitignored): the converted default
    model, gate references, test checkpoints, the prepared Triton server, model fingerprints."""
    return Path(os.environ.get("PRECISION_CACHE_DIR", REPO_ROOT / ".cache"))
