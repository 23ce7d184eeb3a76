"""What makes a folder a build output: its marker file (one home; read by ``pipeline`` and ``engine.job``)."""

from __future__ import annotations

from pathlib import Path

from precision_pipeline.core.store import read_json_safe

OUTPUT_MARKER = ".precision-build.json"
"""The file that makes a folder a build output (written by the first build into it)."""
OUTPUT_FORMAT = "precision-pipeline-build"
OUTPUT_VERSION = 1


SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr", "/var")
"""Top-level folders of the operating system (Filesystem Hierarchy Standard): never an output folder themselves."""
SYSTEM_TREES = ("/boot", "/dev", "/etc", "/proc", "/sys")
"""System folders no output is ever written under (configuration, kernel and device trees)."""


def refuse_filesystem_root(path: Path, field: str = "--out", what: str = "a build output") -> Path:
    """``path`` resolved, unless it is a filesystem root (``/``), one of ``SYSTEM_DIRS`` or inside one of
    ``SYSTEM_TREES`` (``/etc/x``): UserError (exit 2) on ``field`` then. A build (``--out``), the engine build
    Job and the nightly's output root (``OUT/<profile>/``, ``OUT/nightly/``) never write there (a nightly
    ``--out /etc`` built into /etc/fp8-h100: hostile s7 #37)."""
    from precision_pipeline.core.errors import UserError

    p = Path(path).expanduser().resolve()
    if p == Path(p.anchor):
        raise UserError(field, f"{p} is the filesystem root, not {what}.", f"give a folder for {what}, e.g. {field} artifacts.")
    tree = next((d for d in SYSTEM_TREES if p.is_relative_to(d)), None)
    if str(p) in SYSTEM_DIRS or tree:
        where = f"inside the system folder {tree}" if tree and str(p) != tree else "a system folder"
        raise UserError(field, f"{p} is {where}, not {what}.", f"give a folder for {what}, e.g. {field} artifacts.")
    return p


def read_output_marker(out: Path) -> dict | None:
    """The marker of build output ``out`` ({"format", "version", ...}), or None when it has none (or not ours)."""
    m = read_json_safe(Path(out) / OUTPUT_MARKER)
    return m if isinstance(m, dict) and m.get("format") == OUTPUT_FORMAT else None


__all__ = ["OUTPUT_MARKER", "OUTPUT_FORMAT", "OUTPUT_VERSION", "read_output_marker", "refuse_filesystem_root"]
