"""What makes a folder a build output: its marker file (one home; read by ``pipeline`` and ``engine.job``)."""

from __future__ import annotations

from pathlib import Path

from precision_pipeline.core.store import read_json_safe

OUTPUT_MARKER = ".precision-build.json"
"""The file that makes a folder a build output (written by the first build into it)."""
OUTPUT_FORMAT = "precision-pipeline-build"
OUTPUT_VERSION = 1


def refuse_filesystem_root(path: Path, field: str = "--out", what: str = "a build output") -> Path:
    """``path`` resolved, unless it is a filesystem root (``/``): UserError (exit 2) on ``field`` then. A build
    (``--out``), the engine build Job and the nightly's output root (``OUT/<profile>/``, ``OUT/nightly/``) never
    write into the root of a file system."""
    from precision_pipeline.core.errors import UserError

    p = Path(path).expanduser().resolve()
    if p == Path(p.anchor):
        raise UserError(field, f"{p} is the filesystem root, not {what}.", f"give a folder for {what}, e.g. {field} artifacts.")
    return p


def read_output_marker(out: Path) -> dict | None:
    """The marker of build output ``out`` ({"format", "version", ...}), or None when it has none (or not ours)."""
    m = read_json_safe(Path(out) / OUTPUT_MARKER)
    return m if isinstance(m, dict) and m.get("format") == OUTPUT_FORMAT else None


__all__ = ["OUTPUT_MARKER", "OUTPUT_FORMAT", "OUTPUT_VERSION", "read_output_marker", "refuse_filesystem_root"]
