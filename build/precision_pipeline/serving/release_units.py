"""Engine units in a serving repository: installed as verified copies of a build's unit (``install_unit``),
never sharing an inode with a build output, so a kept release survives edits of the output it came from."""

from __future__ import annotations

import contextlib

import os
import shutil
from pathlib import Path
from typing import Iterable

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import hash_file, read_json
from precision_pipeline.serving import llmapi_unit, pack
from precision_pipeline.serving.release_configs import load_config, set_params
from precision_pipeline.serving.release_state import crash_point, note_recovered


def is_any_unit(name: str) -> bool:
    """An engine unit (``tensorrt_llm_<h12>``) or an LLM-API unit (``llm_api_<h12>``, serving/llmapi_unit.py)."""
    return pack.is_unit(name) or llmapi_unit.is_llm_api_unit(name)


def served_path(root: str, repo_dir: Path, name: str) -> str:
    """Where a unit's payload is in the serving container: an engine unit's ``engine/`` (its config's
    gpt_model_path), an LLM-API unit's ``checkpoint/`` (its 1/model.yaml ``model``)."""
    sub = llmapi_unit.CHECKPOINT_DIR if llmapi_unit.is_llm_api_unit(name) else "engine"
    return pack.serving_path(root, Path(repo_dir).name, name, sub)


def resolve_unit_source(engine_unit: Path) -> Path:
    """A unit directory (engine or LLM-API unit), or a packed repository holding exactly one unit."""
    p = Path(engine_unit)
    if is_any_unit(p.name) and (p / "config.pbtxt").is_file():
        return p
    units = [q for q in p.iterdir() if is_any_unit(q.name)] if p.is_dir() else []
    if len(units) != 1:
        raise UserError("engine_unit", f"{p} is neither an engine unit (tensorrt_llm_<h12>/) nor a packed repository with one unit.",
                        "pass <build output>/model_repository or its tensorrt_llm_<h12> directory.")
    return units[0]


def unit_record(unit_src: Path) -> dict[str, list]:
    """``unit_files`` of the pack that wrote ``unit_src`` (its repository's pack.json): {path in the unit:
    [size in bytes, sha256]}. UserError (exit 2) when pack.json records none for this unit."""
    pj_path = unit_src.parent / pack.PACK_FILE
    try:
        pj = read_json(pj_path, {}) or {}
    except ValueError:
        pj = {}
    files = pj.get("unit_files") if isinstance(pj, dict) and pj.get("engine_unit") == unit_src.name else None
    if not isinstance(files, dict) or "config.pbtxt" not in files \
            or not all(isinstance(r, list) and len(r) == 2 for r in files.values()):
        raise UserError("--out", f"{pj_path} records no per-file sizes and checksums of {unit_src.name} (packed before "
                        "pack recorded them, or not the output of a pack), so its copy in the serving repository "
                        "cannot be verified.", "rebuild the output (`invoke build --profile P --out OUT` packs it "
                        "again), then promote it.")
    return files


def file_differs(path: Path, row: list, sha256: bool = True) -> str | None:
    """Why the file ``path`` is not the one recorded as ``row`` = [size in bytes, sha256], or None: missing, another
    size (checked first: no read), another sha256 (the whole file is read; skipped when not ``sha256``). The one
    per-file check of units: installs (``copy_unit``, ``unit_differs``), kept units before they become live
    (``verify_kept``) and the units a server is about to load (``check_sizes``, sizes only)."""
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != row[0]:
        return f"is {size:,} bytes, not the recorded {row[0]:,}"
    if sha256 and hash_file(path) != row[1]:
        return f"has the recorded size ({size:,} bytes) but another sha256 (recorded {str(row[1])[:12]}…)"
    return None


def installed_record(dst: Path, files: dict[str, list]) -> dict[str, list]:
    """The record of an installed unit ``dst``: the build's ``files`` (verified at the copy) with the rewritten file's
    row replaced by the installed one's (config.pbtxt: gpt_model_path; an LLM-API unit's 1/model.yaml: model).
    Reads only that file."""
    rel = llmapi_unit.MODEL_YAML_FILE if llmapi_unit.is_llm_api_unit(Path(dst).name) else "config.pbtxt"
    return {**files, rel: [(dst / rel).stat().st_size, hash_file(dst / rel)]}


def verify_kept(repo_dir: Path, unit: str, state: dict, field: str, serving: str) -> bool:
    """Before a kept unit becomes live again (a rollback, the fallback): every file releases.json's ``unit_files``
    recorded for ``unit`` at its install (``installed_record``) must have its size and sha256 (``file_differs``;
    a full read of the unit). A damaged file, or another unit's files under this name (swapped folders), is a
    UserError on ``field`` (exit 2) naming the unit and the file; ``serving`` still serves. Returns False (nothing
    checked) for a unit installed before the record existed."""
    files = (state.get("unit_files") or {}).get(unit)
    if not isinstance(files, dict):
        return False
    for rel, row in sorted(files.items()):
        why = file_differs(Path(repo_dir) / unit / rel, row)
        if why:
            raise UserError(field, f"{unit}/{rel} {why} at its install: the kept unit's files changed on disk (damaged, "
                            f"edited, or another unit's folder under this name), so nothing was switched ({serving} "
                            "still serves).", "roll back to another kept release (`invoke releases` lists them), or "
                            "promote that unit's build again: a verified copy replaces the folder.")
    return True


def unit_damage(repo_dir: Path, unit: str, state: dict | None) -> str | None:
    """Why ``unit``'s folder in ``repo_dir`` is not what releases.json's ``unit_files`` recorded at its install, by
    size only (``file_differs`` without the sha256: a stat per file, no read, instant for a 405B unit), e.g.
    "engine/rank0.safetensors is 1,000,000 bytes, not the recorded 325,677,320"; None when it agrees or has no record
    (installed before the record existed)."""
    files = ((state or {}).get("unit_files") or {}).get(unit)
    if not isinstance(files, dict):
        return None
    for rel, row in sorted(files.items()):
        if why := file_differs(Path(repo_dir) / unit / rel, row, sha256=False):
            return f"{rel} {why}"
    return None


def check_sizes(repo_dir: Path, units: Iterable[str], state: dict | None, field: str) -> None:
    """Before a server starts on ``repo_dir``: every file releases.json's ``unit_files`` recorded for each of
    ``units`` must exist with its recorded size (``file_differs`` without the sha256: a stat per file, no read, so
    it stays instant for a 405B unit). UserError on ``field`` (exit 2, nothing started) naming the unit and the file
    otherwise (hostile s15c T112: a truncated current checkpoint reached tritonserver, which failed with its option
    table and Python frames). Units without a record (installed before it existed) are not checked."""
    for unit in units:
        why = unit_damage(repo_dir, unit, state) or edited_since_install(repo_dir, unit, state)
        if why:
            raise UserError(field, f"{unit}/{why} at its install: a unit the server would load changed on disk "
                            "(truncated, edited or deleted), so nothing was started.",
                            "roll back to another kept release (`invoke rollback --repo REPO`; `invoke releases` lists "
                            "them), or promote that unit's build again: a verified copy replaces the folder.")


ENTRY_FILES = {"preprocessing": ("config.pbtxt", "1/model.py", "tokenizer/tokenizer_config.json"),
               "postprocessing": ("config.pbtxt", "1/model.py"),
               "tensorrt_llm_bls": ("config.pbtxt", "1/model.py")}
"""The files a (re)load of the repository's python entry models reads, per model (``pack.FIXED_MODELS`` but the
ensemble; ``copy_python_models`` writes the model.py files, ``release_recover.init_repository`` the tokenizer the
preprocessing and postprocessing configs name in ``tokenizer_dir``). A python stub whose model.py is gone never starts,
and Triton 2.51 then keeps the load pending for good (hostile s17c H16/H17)."""


def entry_model_problems(repo_dir: Path, models: Iterable[str] = tuple(ENTRY_FILES)) -> dict[str, str]:
    """``{model: why}`` for each of ``models`` one of whose ``ENTRY_FILES`` is gone from ``repo_dir`` (deleted, moved):
    the server cannot load it (a restart, or the watchdog's reload after its instance died), with where to copy it
    back from. {} when every file is there."""
    out = {}
    for m in models:
        gone = [f for f in ENTRY_FILES.get(m, ()) if not (Path(repo_dir) / m / f).is_file()]
        if gone:
            src = "preprocessing/tokenizer/" if gone[0].startswith("tokenizer/") else f"{m}/{gone[0]}"
            out[m] = (f"{Path(repo_dir) / m / gone[0]} is missing (restore it from a build's packed repository: "
                      f"<build out>/model_repository/{src})")
    return out


def _install_time(state: dict | None, unit: str) -> float | None:
    """When ``unit`` was last recorded as installed (the newest ``releases`` row of it: ``time``, written after its
    files were copied), as seconds since the epoch; None without a row or a readable time."""
    import datetime as _dt

    times = []
    for r in (state or {}).get("releases", []):
        if r.get("unit") == unit and r.get("time"):
            with contextlib.suppress(ValueError, TypeError):
                times.append(_dt.datetime.strptime(r["time"], "%Y-%m-%dT%H:%M:%S%z").timestamp())
    return max(times) if times else None


def edited_since_install(repo_dir: Path, unit: str, state: dict | None) -> str | None:
    """``check_sizes``' content check, as cheap as the stat it makes: a recorded file of ``unit`` whose modification
    time is later than the unit's install record (``_install_time`` + 1 s) was written after the install, so its
    sha256 is compared with the record (``file_differs``; hostile s17 F9: one byte flipped in place with the size
    kept was served after a restart). Files untouched since the install are not read. None when all agree."""
    files = ((state or {}).get("unit_files") or {}).get(unit)
    since = _install_time(state, unit)
    if not isinstance(files, dict) or since is None:
        return None
    for rel, row in sorted(files.items()):
        path = Path(repo_dir) / unit / rel
        with contextlib.suppress(OSError):
            if path.stat().st_mtime > since + 1 and (why := file_differs(path, row)):
                return f"{rel} {why}"
    return None


def _mismatch(unit_src: Path, rel: str, row: list, size: int | None) -> UserError:
    got = "missing" if size is None else (f"{size:,} bytes" if size != row[0] else f"{size:,} bytes with another sha256")
    return UserError(str(unit_src / rel), f"is {got}, but pack recorded {row[0]:,} bytes (sha256 {str(row[1])[:12]}…): "
                     "the build output changed after it was packed (truncated or edited in place); nothing was "
                     "installed and the serving repository is unchanged.",
                     "rebuild the output (`invoke build --profile P --out OUT`), then promote it again.")


def copy_unit(unit_src: Path, dst: Path, files: dict[str, list], gpt_model_path: str) -> None:
    """Copy the unit's recorded files into ``dst`` (``shutil.copyfile``: never a hard link, so a later edit
    of the build output cannot reach the serving repository), verify each copy's size and sha256 against
    ``files`` (UserError naming the file otherwise), then point its config's gpt_model_path at its place (an LLM-API
    unit: its 1/model.yaml ``model``, and the CPU stand-in as its serving-side 1/model.py)."""
    for rel, row in sorted(files.items()):
        src, q = unit_src / rel, dst / rel
        if not src.is_file():
            raise _mismatch(unit_src, rel, row, None)
        q.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, q)
        if file_differs(q, row):
            raise _mismatch(unit_src, rel, row, q.stat().st_size)
    (dst / "1").mkdir(parents=True, exist_ok=True)
    cfg = dst / "config.pbtxt"
    if llmapi_unit.is_llm_api_unit(unit_src.name):  # gpt_model_path: the unit's served path (``served_path``)
        (dst / llmapi_unit.MODEL_YAML_FILE).write_text(llmapi_unit.installed_model_yaml(unit_src, files, gpt_model_path))
        # the serving side's 1/model.py (never in unit_files): this machine's Triton serves the unit with the CPU
        # stand-in; on NVIDIA's image the Deployment's init step copies the image's own model over it
        # (llmapi_unit.image_copy_command)
        llmapi_unit.install_stand_in(dst)
    else:
        set_params(cfg, {"gpt_model_path": gpt_model_path})
    pack.parse_model_config(cfg.read_text(), str(cfg))


def _installed_config(unit_src: Path, files: dict[str, list], gpt_model_path: str):
    """The unit's config as it is installed (gpt_model_path set), from the build's verified config.pbtxt."""
    src = unit_src / "config.pbtxt"
    row = files["config.pbtxt"]
    size = src.stat().st_size if src.is_file() else None
    if size != row[0] or hash_file(src) != row[1]:
        raise _mismatch(unit_src, "config.pbtxt", row, size)
    cfg = pack.parse_model_config(src.read_text(), str(src))
    cfg.parameters["gpt_model_path"].string_value = gpt_model_path
    return cfg


def unit_differs(dst: Path, unit_src: Path, files: dict[str, list], gpt_model_path: str) -> str | None:
    """Why the installed unit ``dst`` is not the build's unit ``unit_src`` (``files``: its pack record), or None:
    every recorded file with its size and sha256 (read in full), and the config as installed (parsed: the
    install rewrote gpt_model_path)."""
    llm_api = llmapi_unit.is_llm_api_unit(unit_src.name)
    rewritten = llmapi_unit.MODEL_YAML_FILE if llm_api else "config.pbtxt"
    for rel, row in sorted(files.items()):
        if rel == rewritten:
            continue
        why = file_differs(dst / rel, row)
        if why:
            return f"{rel} {why}"
    if llm_api:
        want_yaml = llmapi_unit.installed_model_yaml(unit_src, files, gpt_model_path)
        got = dst / llmapi_unit.MODEL_YAML_FILE
        return None if got.is_file() and got.read_text() == want_yaml else "its 1/model.yaml differs from the build's"
    want = _installed_config(unit_src, files, gpt_model_path)
    try:
        got = load_config(dst / "config.pbtxt")
    except (OSError, UserError):
        return "its config.pbtxt is missing or does not parse"
    if got.SerializeToString(deterministic=True) != want.SerializeToString(deterministic=True):
        return "its config.pbtxt differs from the build's"
    return None


def install_unit(repo_dir: Path, unit_src: Path, serve_root: str | None = None, *, protect: Iterable[str] = (),
                 record: dict | None = None, live: bool = True) -> str:
    """Copy a unit into the serving repository atomically (verified against its pack record, ``copy_unit``);
    point gpt_model_path at its new place. Returns the unit's name. ``record``: the releases state whose
    ``unit_files`` gets the installed unit's record (``installed_record``; ``verify_kept`` checks it before the
    unit becomes live again); the caller writes the state.

    A folder of that name already there is kept only when it is the build's unit (``unit_differs``); otherwise
    it is replaced (the copy is staged aside, then swapped in) -- unless its name is in ``protect`` (the unit
    that serves now) and ``live`` (a server is involved: --url), which is a UserError (exit 2): files are never
    replaced under the server. Without a server (files only; the CLI refuses that while a local server serves the
    repository) a damaged folder of a protected unit is repaired by the verified copy, and that is said
    (``note_recovered``; hostile s15c T113)."""
    repo_dir = Path(repo_dir)
    unit_src = resolve_unit_source(unit_src)
    name = unit_src.name
    files = unit_record(unit_src)
    dst = repo_dir / name
    root = serve_root or str(repo_dir.resolve().parent)
    gpt = served_path(root, repo_dir, name)
    why = None
    if dst.is_dir():
        why = unit_differs(dst, unit_src, files, gpt)
        if why is None:
            if record is not None:
                record.setdefault("unit_files", {})[name] = installed_record(dst, files)
            return name
        if name in set(protect) and live:
            raise UserError("--out", f"{dst} is not this build's unit of the same name ({why}), and it is the unit that "
                            "serves now, so it is not replaced under the server; nothing was changed.",
                            "make another release current first (`invoke rollback`), then promote this build again: "
                            "the folder is then replaced by a verified copy.")
    tmp = repo_dir / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        copy_unit(unit_src, tmp, files, gpt)
        crash_point("stage")
        if dst.is_dir():  # a stale or damaged folder of this name that nothing serves: swapped for the copy
            trash = repo_dir / f".{name}.old-{os.getpid()}"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(dst, trash)
            os.replace(tmp, dst)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if record is not None:
        record.setdefault("unit_files", {})[name] = installed_record(dst, files)
    if name in set(protect):  # the unit that serves now, its folder gone or damaged: put back (hostile s15 F3, s15c T113)
        note_recovered([f"the folder of {name} reinstalled from this build" if why is None else
                        f"the damaged folder of {name} ({why}) replaced by a verified copy of this build"])
    return name


def install_release_unit(repo_dir: Path, engine_unit: Path, serve_root: str | None, state: dict, server) -> str:
    """``install_unit`` as a release command makes it (promote, set_fallback, a rollout's begin): the units that serve
    now protected (``serving_now``) while a ``server`` is involved, the install recorded in ``state``."""
    from precision_pipeline.serving.release_state import serving_now

    return install_unit(repo_dir, engine_unit, serve_root, protect=serving_now(state), record=state,
                        live=server is not None)


def remove_dir(p: Path) -> None:
    trash = p.parent / f".{p.name}.old-{os.getpid()}"
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(p, trash)
    shutil.rmtree(trash, ignore_errors=True)
