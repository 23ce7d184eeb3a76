"""Releases of a serving model repository: promote, rollback, fallback, retention, crash recovery.

Why models and not versions: the real tensorrtllm backend loads the engine named by the
``gpt_model_path`` parameter and ignores Triton's version directories, so each engine is its own
Triton model, an *engine unit* ``tensorrt_llm_<h12>`` (see build/precision_pipeline/serving/pack.py). The ``ensemble`` step and
the ``tensorrt_llm_bls`` parameter ``tensorrt_llm_model_name`` name the current unit; switching a
release rewrites those two configs and reloads them. Triton keeps the old ensemble serving until the
new one is loaded, so a switch drops no request.

State: ``releases.json`` next to the serving model repository (``<repo>/../releases.json``)::

    {"current": unit, "fallback": unit|null, "warm_fallback": bool, "keep_releases": N,
     "releases": [{"unit", "engine_hash", "profile", "gate", "time", "promoted_by", "engine_present",
                   "kind": "release"|"fallback"}, ...],      # oldest first
     "history": [{"action", "from", "to", "time", "by", "ms"}, ...]}

On disk stay: the current unit, the previous ``keep_releases`` releases and the fallback unit (the
prebuilt engine of the profile's ``deployment.fallback`` profile). Loaded stay: the current unit, and
the fallback when ``warm_fallback`` (rollback to it is then a config switch, no engine load).

Units are installed as verified copies (``install_unit``): a serving repository never shares an inode
with a build output, so a kept release (a rollback target) survives edits of the output it came from.

Atomicity: every file is written aside and renamed (units are staged as hidden ``.<unit>.tmp-*``
directories, configs through ``atomic_write_text``), and ``releases.json`` is written LAST: it is the
commit point. The first promote (``init_serving_repo``) stages the whole repository and renames it
into place with ``releases.json`` as a commit file of that swap (``core.store.atomic_dir``): a kill
before the swap's journal leaves no repository, a kill after it is completed by ``recover()``, so
no state is a repository without its ``releases.json`` (steps: ``INIT_STEPS``). A crash before it leaves the previous release recorded; ``recover()`` (run at the start
of promote/rollback/serve) re-points ensemble/BLS configs at the recorded release and removes staged
leftovers, so the repository always loads and serves the recorded release. Test hook: environment
``PRECISION_RELEASE_CRASH_AT=<step>`` makes the process exit (status 97) right after that step
(steps: ``STEPS``).

Live server (commands given ``--url``, i.e. a ``server``): before anything is changed,
``verify_server`` refuses a server that does not serve this repository (its loaded ensemble's
``serving_repository_id`` parameter, written at init, or its preprocessing's ``tokenizer_dir``, an
absolute path into the repository, must equal the files'). After ``recover()`` fixed the files,
``reconcile_server`` makes the live server agree with releases.json too: the current unit loaded,
the loaded ensemble's engine step on it (reloaded from the re-pointed config otherwise), and no
unit left loaded that nothing records or routes to. No unit that the live ensemble or route.json
still routes to is ever unloaded.

History: only ``MOVES`` change the current release; a ``rollout_abort`` (a candidate that was
never current) and a ``probe`` move nothing, so retention and rollback ignore them, and a candidate
whose rollout was aborted (``rejected``) is never a rollback target nor kept by retention.

Damaged ``releases.json`` (truncated, edited): every command refuses with the file and the fix
(exit 2) and writes nothing; each write keeps the state before it as ``releases.json.prev``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable

from precision_pipeline.serving import pack
from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import atomic_write_json, atomic_write_text, clean_stale, hash_file, locked, read_json

STATE_FILE = "releases.json"
PREV_SUFFIX = ".prev"
"""``releases.json.prev``: the state before the last write (a hard link to the replaced file)."""
IDENTITY_PARAM = "serving_repository_id"
"""Ensemble config parameter naming the serving repository (random, written at init): what a live
server reports for it (``GET /v2/models/ensemble/config``) tells whether it serves this repository."""
MOVES = ("init", "promote", "rollback", "rollout")
"""History actions that make a unit the current release (``to``; ``from`` was current before)."""
LOCK_FILE = ".releases.lock"
CRASH_ENV = "PRECISION_RELEASE_CRASH_AT"
CRASH_EXIT = 97
STEPS = ("stage", "install", "load", "smoke", "ensemble_config", "switch", "bls_config", "commit", "gc")
INIT_STEPS = ("init_stage", "init_journal", "init_swap", "init_commit")
"""Crash points of the first promote (``init_serving_repo``): after the staged repository is complete,
after the swap journal is written, between the renames, after releases.json is written. A crash at
``init_stage`` leaves no repository (the old state); at any later step ``recover()`` (or the next
promote/rollback/init) completes it (the new state)."""
ROUTE_FILE = "route.json"  # tensorrt_llm_bls/route.json: the unit the running BLS calls (read per request)
HISTORY_MAX = 200
SMOKE_PROMPT = "What is 2 + 2?"


def _crash_point(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        os._exit(CRASH_EXIT)


def state_path(repo_dir: Path) -> Path:
    return Path(repo_dir).resolve().parent / STATE_FILE


def read_state(repo_dir: Path) -> dict | None:
    """releases.json beside ``repo_dir`` (None when there is none). Raises UserError (exit 2) naming the
    file and the fix when it is not a releases record (truncated, edited); nothing is written then."""
    path = state_path(repo_dir)
    try:
        state = read_json(path)
    except ValueError as e:  # invalid JSON or UTF-8
        raise _damaged(path, f"cannot be parsed ({str(e)[:120]})") from None
    if state is None:
        return None
    if not isinstance(state, dict) or not isinstance(state.get("current"), str) \
            or not isinstance(state.get("history", []), list) or not isinstance(state.get("releases", []), list):
        raise _damaged(path, "is not a releases record (an object with current, releases and history)")
    return state


def _damaged(path: Path, why: str) -> UserError:
    prev = path.with_name(path.name + PREV_SUFFIX)
    try:
        ok = isinstance(read_json(prev), dict)
    except (ValueError, OSError):
        ok = False
    fix = (f"{prev} holds the state before the last change: check it (`cat {prev}`) and restore it with "
           f"`cp {prev} {path}` (a release that only the lost change recorded is then not kept), or restore "
           f"{path} from a backup." if ok else f"restore {path} from a backup.")
    return UserError(str(path), f"{why}: it is damaged (truncated or edited), so the current release is unknown; "
                     "this command changed nothing and does not overwrite it.", fix)


def _write_state(repo_dir: Path, state: dict) -> None:
    """Write releases.json atomically (the commit point), keeping the replaced file as releases.json.prev."""
    path = state_path(repo_dir)
    if path.is_file():
        tmp = path.with_name(f".{path.name}{PREV_SUFFIX}.{os.getpid()}.tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        try:
            os.link(path, tmp)
        except OSError:  # a file system without hard links
            shutil.copy2(path, tmp)
        os.replace(tmp, path.with_name(path.name + PREV_SUFFIX))
    atomic_write_json(path, state)


def _lock(repo_dir: Path):
    return locked(Path(repo_dir).resolve().parent / LOCK_FILE)


def _state_or_refuse(repo_dir: Path, reason: str, fix: str, *, recover: bool = True, server=None) -> dict:
    """Under the releases lock: refuse a ``server`` that does not serve ``repo_dir`` (``verify_server``),
    finish an interrupted change (``recover``; then ``reconcile_server`` on the live server), then
    ``releases.json``; UserError on its path with ``reason`` / ``fix`` when the repository has none."""
    verify_server(repo_dir, server)
    if recover:
        _recover_locked(repo_dir)
    state = read_state(repo_dir)
    if not state:
        raise UserError(str(state_path(repo_dir)), reason, fix)
    if recover:
        reconcile_server(repo_dir, server, state)
    return state


def serving_models(repo_dir: Path, state: dict) -> list[str]:
    """Models to load for ``state``: pre/post, current unit, warm fallback, then ensemble and BLS."""
    units = [state["current"]]
    fb = state.get("fallback")
    if fb and state.get("warm_fallback") and fb not in units and (Path(repo_dir) / fb).is_dir():
        units.append(fb)
    return ["preprocessing", "postprocessing", *units, "ensemble", "tensorrt_llm_bls"]


def _pid_alive(pid) -> bool:
    """Whether process ``pid`` runs on this machine (the rollout that recorded it is alive)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# --------------------------------------------------------------------------------------------
# Config rewriting


_CFG_CACHE: dict[str, tuple[tuple, Any]] = {}


def _stat_key(path: Path) -> tuple:
    st = os.stat(path)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def load_config(path: Path):
    """Parsed config.pbtxt (a fresh copy), cached by (mtime, size, inode): protobuf's text parser is
    pure Python and a rollback should not spend its budget re-parsing unchanged files."""
    path = Path(path)
    key = _stat_key(path)
    hit = _CFG_CACHE.get(str(path))
    if hit is None or hit[0] != key:
        hit = (key, pack.parse_model_config(path.read_text(), str(path)))
        _CFG_CACHE[str(path)] = hit
    cfg = type(hit[1])()
    cfg.CopyFrom(hit[1])
    return cfg


def _rewrite_config(path: Path, mutate) -> bool:
    """Parse a config.pbtxt, apply ``mutate(cfg)``, write it back atomically if it changed."""
    from google.protobuf import text_format

    path = Path(path)
    cfg = load_config(path)
    before = cfg.SerializeToString()
    mutate(cfg)
    if cfg.SerializeToString() == before:
        return False
    atomic_write_text(path, "# Rewritten by build/precision_pipeline/serving/release.py (protobuf text format).\n" + text_format.MessageToString(cfg))
    _CFG_CACHE[str(path)] = (_stat_key(path), cfg)
    return True


def current_of_configs(repo_dir: Path) -> tuple[str | None, str | None]:
    """(unit named by the ensemble, unit named by the BLS; "param|route.json:X" when the two disagree)."""
    repo_dir = Path(repo_dir)
    ens = bls = None
    p = repo_dir / "ensemble" / "config.pbtxt"
    if p.is_file():
        cfg = load_config(p)
        ens = next((s.model_name for s in cfg.ensemble_scheduling.step if pack.is_unit(s.model_name)), None)
    p = repo_dir / "tensorrt_llm_bls" / "config.pbtxt"
    if p.is_file():
        bls = pack.config_params(load_config(p)).get("tensorrt_llm_model_name")
        route = (read_json(repo_dir / "tensorrt_llm_bls" / ROUTE_FILE, {}) or {}).get("tensorrt_llm_model_name")
        if route and route != bls:
            bls = f"{bls}|route.json:{route}"
    return ens, bls


def _max_batch(repo_dir: Path, model: str) -> int | None:
    p = Path(repo_dir) / model / "config.pbtxt"
    if not p.is_file():
        return None
    return load_config(p).max_batch_size


def point_ensemble(repo_dir: Path, unit: str) -> bool:
    """Point the ensemble's engine step at ``unit``. Triton refuses an ensemble whose max_batch_size
    exceeds a step's, so it becomes min(unit, preprocessing, postprocessing)."""
    sizes = [m for m in (_max_batch(repo_dir, unit), _max_batch(repo_dir, "preprocessing"),
                         _max_batch(repo_dir, "postprocessing")) if m]

    def mut(cfg):
        for s in cfg.ensemble_scheduling.step:
            if pack.is_unit(s.model_name):
                s.model_name = unit
        if sizes:
            cfg.max_batch_size = min(sizes)
    return _rewrite_config(Path(repo_dir) / "ensemble" / "config.pbtxt", mut)


def point_bls(repo_dir: Path, unit: str) -> bool:
    """Point the BLS at ``unit``: its config parameter (what a fresh load reads) and route.json (what
    the running BLS reads on each request, so no reload is needed)."""
    def mut(cfg):
        cfg.parameters["tensorrt_llm_model_name"].string_value = unit
    changed = _rewrite_config(Path(repo_dir) / "tensorrt_llm_bls" / "config.pbtxt", mut)
    route = Path(repo_dir) / "tensorrt_llm_bls" / ROUTE_FILE
    if (read_json(route, {}) or {}) != {"tensorrt_llm_model_name": unit}:  # also ends a canary
        atomic_write_json(route, {"tensorrt_llm_model_name": unit})
        changed = True
    return changed


def set_canary(repo_dir: Path, stable: str, candidate: str, percent: int) -> None:
    """route.json: ``percent`` (0..100) of the BLS's requests to ``candidate``, the rest to ``stable``
    (the running BLS reads it on its next request; see tensorrt_llm_bls/1/model.py)."""
    if not 0 <= int(percent) <= 100:
        raise ValueError(f"percent {percent} outside 0..100")
    atomic_write_json(Path(repo_dir) / "tensorrt_llm_bls" / ROUTE_FILE,
                      {"tensorrt_llm_model_name": stable,
                       "canary": {"tensorrt_llm_model_name": candidate, "percent": int(percent)}})


def _set_params(path: Path, values: dict[str, str]) -> None:
    def mut(cfg):
        for k, v in values.items():
            cfg.parameters[k].string_value = v
    _rewrite_config(path, mut)


# --------------------------------------------------------------------------------------------
# Units


def resolve_unit_source(engine_unit: Path) -> Path:
    """A unit directory, or a packed repository holding exactly one unit."""
    p = Path(engine_unit)
    if pack.is_unit(p.name) and (p / "config.pbtxt").is_file():
        return p
    units = [q for q in p.iterdir() if pack.is_unit(q.name)] if p.is_dir() else []
    if len(units) != 1:
        raise UserError("engine_unit", f"{p} is neither an engine unit (tensorrt_llm_<h12>/) nor a packed repository with one unit.",
                        "pass <build output>/model_repository or its tensorrt_llm_<h12> directory.")
    return units[0]


def _unit_record(unit_src: Path) -> dict[str, list]:
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


def _mismatch(unit_src: Path, rel: str, row: list, size: int | None) -> UserError:
    got = "missing" if size is None else (f"{size:,} bytes" if size != row[0] else f"{size:,} bytes with another sha256")
    return UserError(str(unit_src / rel), f"is {got}, but pack recorded {row[0]:,} bytes (sha256 {str(row[1])[:12]}…): "
                     "the build output changed after it was packed (truncated or edited in place); nothing was "
                     "installed and the serving repository is unchanged.",
                     "rebuild the output (`invoke build --profile P --out OUT`), then promote it again.")


def _copy_unit(unit_src: Path, dst: Path, files: dict[str, list], gpt_model_path: str) -> None:
    """Copy the unit's recorded files into ``dst`` (``shutil.copyfile``: never a hard link, so a later edit
    of the build output cannot reach the serving repository), verify each copy's size and sha256 against
    ``files`` (UserError naming the file otherwise), then point its config's gpt_model_path at its place."""
    for rel, row in sorted(files.items()):
        src, q = unit_src / rel, dst / rel
        if not src.is_file():
            raise _mismatch(unit_src, rel, row, None)
        q.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, q)
        size = q.stat().st_size
        if size != row[0] or hash_file(q) != row[1]:
            raise _mismatch(unit_src, rel, row, size)
    (dst / "1").mkdir(parents=True, exist_ok=True)
    cfg = dst / "config.pbtxt"
    _set_params(cfg, {"gpt_model_path": gpt_model_path})
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
    for rel, row in sorted(files.items()):
        if rel == "config.pbtxt":
            continue
        q = dst / rel
        if not q.is_file():
            return f"{rel} is missing"
        size = q.stat().st_size
        if size != row[0]:
            return f"{rel} is {size:,} bytes, the build's is {row[0]:,}"
        if hash_file(q) != row[1]:
            return f"{rel} has another sha256 than the build's"
    want = _installed_config(unit_src, files, gpt_model_path)
    try:
        got = load_config(dst / "config.pbtxt")
    except (OSError, UserError):
        return "its config.pbtxt is missing or does not parse"
    if got.SerializeToString(deterministic=True) != want.SerializeToString(deterministic=True):
        return "its config.pbtxt differs from the build's"
    return None


def serving_now(state: dict) -> set[str]:
    """Units whose files a server may be reading now: the current release, a rollout's candidate and a warm
    fallback (``install_unit`` never replaces them)."""
    ro = state.get("rollout") or {}
    fb = state.get("fallback") if state.get("warm_fallback") else None
    return {u for u in (state.get("current"), ro.get("candidate"), fb) if u}


def install_unit(repo_dir: Path, unit_src: Path, serve_root: str | None = None, *, protect: Iterable[str] = ()) -> str:
    """Copy a unit into the serving repository atomically (verified against its pack record, ``_copy_unit``);
    point gpt_model_path at its new place. Returns the unit's name.

    A folder of that name already there is kept only when it is the build's unit (``unit_differs``); otherwise
    it is replaced (the copy is staged aside, then swapped in) -- unless its name is in ``protect`` (the unit
    that serves now), which is a UserError (exit 2): files are never replaced under the server."""
    repo_dir = Path(repo_dir)
    unit_src = resolve_unit_source(unit_src)
    name = unit_src.name
    files = _unit_record(unit_src)
    dst = repo_dir / name
    root = serve_root or str(repo_dir.resolve().parent)
    gpt = pack.serving_path(root, repo_dir.name, name, "engine")
    if dst.is_dir():
        why = unit_differs(dst, unit_src, files, gpt)
        if why is None:
            return name
        if name in set(protect):
            raise UserError("--out", f"{dst} is not this build's unit of the same name ({why}), and it is the unit that "
                            "serves now, so it is not replaced under the server; nothing was changed.",
                            "make another release current first (`invoke rollback`), then promote this build again: "
                            "the folder is then replaced by a verified copy.")
    tmp = repo_dir / f".{name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _copy_unit(unit_src, tmp, files, gpt)
        _crash_point("stage")
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
    return name


def _remove_dir(p: Path) -> None:
    trash = p.parent / f".{p.name}.old-{os.getpid()}"
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(p, trash)
    shutil.rmtree(trash, ignore_errors=True)


def init_serving_repo(repo_dir: Path, packed_repo: Path, *, serve_root: str | None = None, profile: str = "",
                      gate: dict | None = None, by: str = "init", fallback_repo: Path | None = None,
                      warm_fallback: bool = False, keep_releases: int = 2) -> dict:
    """Create a serving repository from a packed one (its unit becomes the current release).

    ``fallback_repo``: a packed repository of the fallback profile whose unit is kept on disk
    (and loaded when ``warm_fallback``).
    """
    repo_dir, packed_repo = Path(repo_dir), Path(packed_repo)
    unit_src = resolve_unit_source(packed_repo)
    with _lock(repo_dir):
        _recover_first_promote(repo_dir)
        if repo_dir.exists():
            state = read_state(repo_dir)
            if state and state.get("current") == unit_src.name and [h.get("action") for h in state.get("history", [])] == ["init"]:
                return state  # an interrupted init of this same unit, now completed by the recovery above
            if state is None:
                raise UserError("repo_dir", f"{repo_dir} exists but has no {STATE_FILE} beside it, so it is not a serving "
                                "repository this pipeline can use.",
                                "pass a new directory as --repo (e.g. artifacts/serving/model_repository); never delete a "
                                "folder you did not create with `invoke promote`.")
            raise UserError("repo_dir", f"{repo_dir} already exists.", "promote into it instead, or choose a new directory.")
        return _init_locked(repo_dir, packed_repo, unit_src, serve_root=serve_root, profile=profile, gate=gate, by=by,
                            fallback_repo=fallback_repo, warm_fallback=warm_fallback, keep_releases=keep_releases)


def _recover_first_promote(repo_dir: Path) -> list[str]:
    """Finish an init (first promote) that a kill interrupted after its staged copy was complete."""
    from precision_pipeline.core.store import recover_swaps

    parent, name = Path(repo_dir).resolve().parent, Path(repo_dir).name
    done = recover_swaps(parent, names=(name,))
    clean_stale(parent, names=(name,))  # an init killed before its journal: its incomplete copy
    return [f"first promote into {repo_dir} completed (interrupted before releases.json)"] if done else []


def _init_locked(repo_dir: Path, packed_repo: Path, unit_src: Path, *, serve_root, profile, gate, by, fallback_repo,
                 warm_fallback, keep_releases) -> dict:
    from precision_pipeline.core.store import atomic_dir

    root = serve_root or str(repo_dir.resolve().parent)
    commit: dict[Path, Any] = {}
    # releases.json is a commit file of the repository's swap: written with it, or rolled forward with it
    with atomic_dir(repo_dir, commit_files=commit, crash=lambda step: _crash_point(f"init_{step}")) as tmp:
        for m in pack.FIXED_MODELS:  # copies: the serving repository shares no inode with a build output
            pack.copy_tree(packed_repo / m, tmp / m)
        tok = pack.serving_path(root, repo_dir.name, "preprocessing", "tokenizer")
        for m in ("preprocessing", "postprocessing"):
            _set_params(tmp / m / "config.pbtxt", {"tokenizer_dir": tok})
        # install under the final name's parent: paths are computed for repo_dir, files staged in tmp
        unit = _install_into(tmp, repo_dir.name, unit_src, root)
        fb = None
        if fallback_repo is not None:
            fb = _install_into(tmp, repo_dir.name, resolve_unit_source(fallback_repo), root)
        point_ensemble(tmp, unit)
        point_bls(tmp, unit)
        repo_id = os.urandom(8).hex()
        _set_params(tmp / "ensemble" / "config.pbtxt", {IDENTITY_PARAM: repo_id})
        pack.check_repository(tmp)
        state = {"version": 1, "current": unit, "fallback": fb, "warm_fallback": bool(warm_fallback and fb),
                 "keep_releases": int(keep_releases), "repository_id": repo_id, "releases": [], "history": []}
        state["releases"].append(_release_record(tmp / unit, unit, profile, gate, by, "release"))
        if fb:
            state["releases"].append(_release_record(tmp / fb, fb, "", None, by, "fallback"))
        state["history"].append({"action": "init", "from": None, "to": unit, "time": _now(), "by": by, "ms": 0.0})
        commit[state_path(repo_dir)] = state
        _crash_point("init_stage")
    return state


def _install_into(tmp_repo: Path, repo_name: str, unit_src: Path, root: str) -> str:
    name = unit_src.name
    if (tmp_repo / name).is_dir():
        return name
    _copy_unit(unit_src, tmp_repo / name, _unit_record(unit_src), pack.serving_path(root, repo_name, name, "engine"))
    return name


def _release_record(unit_dir: Path, unit: str, profile: str, gate: dict | None, by: str, kind: str) -> dict:
    ref = read_json(unit_dir / "engine" / pack.CPU_REFERENCE_FILE, {}) or {}
    return {"unit": unit, "engine_hash": ref.get("engine_hash", unit[len(pack.UNIT_PREFIX):]),
            "profile": profile or ref.get("profile", ""), "gate": gate or {}, "time": _now(), "promoted_by": by,
            "engine_present": bool(ref.get("engine_present", False)), "kind": kind}


# --------------------------------------------------------------------------------------------
# Recovery


def recover(repo_dir: Path, server=None) -> list[str]:
    """Make the repository agree with releases.json (after a crash). Returns what was fixed.

    With a running ``server`` (verified to serve ``repo_dir`` first: ``verify_server``) the live server
    is made to agree too (``reconcile_server``)."""
    repo_dir = Path(repo_dir)
    if not repo_dir.is_dir() and not repo_dir.resolve().parent.is_dir():
        return []
    with _lock(repo_dir):
        verify_server(repo_dir, server)
        fixed = _recover_locked(repo_dir)
        state = read_state(repo_dir)
        if state and state.get("current"):
            fixed += reconcile_server(repo_dir, server, state)
        return fixed


def _recover_locked(repo_dir: Path) -> list[str]:
    fixed = _recover_first_promote(repo_dir)
    if not repo_dir.is_dir():
        return fixed
    stale = [p.name for p in repo_dir.iterdir() if p.name.startswith(".") and (".tmp-" in p.name or ".old-" in p.name)]
    if stale:
        clean_stale(repo_dir)
        fixed.append(f"removed staged leftovers: {', '.join(sorted(stale))}")
    for m in ("ensemble", "tensorrt_llm_bls"):
        for p in (repo_dir / m).glob(".*.tmp") if (repo_dir / m).is_dir() else []:  # config.pbtxt, route.json
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    # writes of releases.json (and its .prev, the lock's sidecar) killed mid-way: every writer holds the lock we hold
    parent = repo_dir.resolve().parent
    left = [*parent.glob(f".{STATE_FILE}.*.tmp"), *parent.glob(f".{LOCK_FILE}.json.*.tmp")]
    for p in left:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
    if left:
        fixed.append(f"removed {len(left)} leftover temporary file(s) of {STATE_FILE}")
    state = read_state(repo_dir)
    if not state or not state.get("current"):
        return fixed
    cur = state["current"]
    if state.get("rollout") and not _pid_alive(state["rollout"].get("pid")):
        # a rollout whose process died (crash, kill -9): the stable release serves every request again
        ro = state.pop("rollout")
        state["history"] = (state.get("history", []) + [{
            "action": "rollout_abort", "from": ro.get("candidate"), "to": cur, "time": _now(), "by": "recover",
            "ms": 0.0, "rollout": {**ro, "failed_check": "interrupted", "numbers": {}}}])[-HISTORY_MAX:]
        _write_state(repo_dir, state)
        fixed.append(f"interrupted rollout of {ro.get('candidate')} ended; {cur} serves all traffic")
    if not (repo_dir / cur / "config.pbtxt").is_file():
        raise UserError(str(state_path(repo_dir)), f"the current release {cur} is missing from {repo_dir}.",
                        "restore the unit directory or roll back to one that exists.")
    if point_ensemble(repo_dir, cur):
        fixed.append(f"ensemble re-pointed at {cur}")
    if point_bls(repo_dir, cur):
        fixed.append(f"tensorrt_llm_bls re-pointed at {cur}")
    return fixed


# --------------------------------------------------------------------------------------------
# Smoke test (direct, before the ensemble routes traffic to a unit)


def _load_unit(server, unit: str, field: str, serving: str, fix: str) -> None:
    """``server.load(unit)``; a unit the server refuses to load (a damaged or outdated unit: the backend's
    own message) is a UserError on ``field`` (exit 2) saying that ``serving`` still serves, not a traceback."""
    try:
        server.load(unit)
    except RuntimeError as e:
        with contextlib.suppress(Exception):
            server.unload(unit)
        raise UserError(field, f"the server does not load {unit}, so nothing was switched ({serving} still serves): "
                        f"{str(e)[:400]}", fix) from None


def _smoke_unit(server, unit: str, field: str, serving: str, fix: str, *, expect: str | None = None) -> dict:
    """``smoke_test``; a unit that loaded but fails its smoke request (a wrong or empty answer, or the server's
    error for it) is a UserError on ``field`` (exit 2) naming the unit, the server's message and that ``serving``
    still serves -- a refusal of that unit, not an internal error. The caller unloads it."""
    from tritonclient.utils import InferenceServerException

    try:
        return smoke_test(server, unit, expect=expect)
    except (RuntimeError, InferenceServerException) as e:
        raise UserError(field, f"{unit} loads but fails its smoke request, so nothing was switched ({serving} still "
                        f"serves): {str(e)[:400]}", fix) from None


def smoke_test(server, unit: str, *, prompt: str = SMOKE_PROMPT, max_tokens: int = 8, expect: str | None = None) -> dict:
    """Infer ``unit`` directly: preprocessing -> unit -> postprocessing, called one by one.

    Fails (RuntimeError) on an error, a wrong tensor shape/dtype, an empty or over-long output, or a
    text different from ``expect`` when given.
    """
    import numpy as np
    import tritonclient.http as hc

    t0 = time.perf_counter()
    c = server.http_client()
    try:
        q = hc.InferInput("QUERY", [1, 1], "BYTES")
        q.set_data_from_numpy(np.array([[prompt.encode()]], dtype=object))
        n = hc.InferInput("REQUEST_OUTPUT_LEN", [1, 1], "INT32")
        n.set_data_from_numpy(np.array([[max_tokens]], np.int32))
        pre = c.infer("preprocessing", [q, n])
        ids, lens = pre.as_numpy("INPUT_ID"), pre.as_numpy("REQUEST_INPUT_LEN")
        ins = []
        for name, arr in (("input_ids", ids), ("input_lengths", lens), ("request_output_len", np.array([[max_tokens]], np.int32)),
                          ("end_id", pre.as_numpy("OUT_END_ID")), ("pad_id", pre.as_numpy("OUT_PAD_ID"))):
            t = hc.InferInput(name, list(arr.shape), "INT32")
            t.set_data_from_numpy(arr.astype(np.int32))
            ins.append(t)
        out = c.infer(unit, ins, outputs=[hc.InferRequestedOutput("output_ids"), hc.InferRequestedOutput("sequence_length")])
        oids, slen = out.as_numpy("output_ids"), out.as_numpy("sequence_length")
        if oids is None or oids.dtype != np.int32 or oids.ndim != 3 or slen is None or slen.dtype != np.int32:
            raise RuntimeError(f"smoke test of {unit}: unexpected outputs {None if oids is None else (oids.dtype, oids.shape)}")
        k = int(slen.reshape(-1)[0])
        if not 0 < k <= max_tokens:
            raise RuntimeError(f"smoke test of {unit}: sequence_length {k} outside 1..{max_tokens}")
        tb = hc.InferInput("TOKENS_BATCH", list(oids.shape), "INT32")
        tb.set_data_from_numpy(oids)
        sl = hc.InferInput("SEQUENCE_LENGTH", list(slen.shape), "INT32")
        sl.set_data_from_numpy(slen)
        text = c.infer("postprocessing", [tb, sl]).as_numpy("OUTPUT").reshape(-1)[0].decode()
    finally:
        c.close()
    if not text.strip():
        raise RuntimeError(f"smoke test of {unit}: empty text")
    if expect is not None and text != expect:
        raise RuntimeError(f"smoke test of {unit}: got {text!r}, expected {expect!r}")
    return {"text": text, "tokens": k, "ms": (time.perf_counter() - t0) * 1e3}


# --------------------------------------------------------------------------------------------
# Promote / rollback


def _loaded(server) -> dict[str, str]:
    if server is None:
        return {}
    try:
        return server.loaded_models()
    except Exception:
        return {}


def _live_unit(server) -> str | None:
    """The engine unit the ensemble loaded on ``server`` calls (its config's unit step); None when no
    ensemble is loaded there."""
    cfg = server.model_config("ensemble")
    if not cfg:
        return None
    steps = (cfg.get("ensemble_scheduling") or {}).get("step") or []
    return next((st.get("model_name") for st in steps if pack.is_unit(st.get("model_name", ""))), None)


def _routed(repo_dir: Path, server) -> set[str]:
    """Units requests can reach now: the live ensemble's unit and every unit route.json names (the BLS
    reads it per request)."""
    route = read_json(Path(repo_dir) / "tensorrt_llm_bls" / ROUTE_FILE, {}) or {}
    units = {route.get("tensorrt_llm_model_name"), (route.get("canary") or {}).get("tensorrt_llm_model_name")}
    if server is not None:
        with contextlib.suppress(Exception):
            units.add(_live_unit(server))
    return {u for u in units if u}


def _inside_dir(p: Path, folder: Path) -> bool:
    try:
        p.resolve().relative_to(Path(folder).resolve())
        return True
    except (ValueError, OSError, RuntimeError):
        return False


def verify_server(repo_dir: Path, server) -> None:
    """Refuse (UserError on ``--url``, exit 2) a ``server`` that does not serve ``repo_dir``, before
    anything is changed: the parameters that identify the repository must be the same in the files
    and in the configs the server loaded: the ensemble's ``IDENTITY_PARAM`` (repositories created
    since it exists) and the preprocessing's ``tokenizer_dir`` (an absolute path into the repository).
    At least one of the two models must be loaded there. A repository whose ``tokenizer_dir`` points
    outside it (a copy or a move: its files still name the original) is refused (UserError on ``--repo``).
    Nothing to check without a server."""
    if server is None:
        return
    repo_dir = Path(repo_dir)
    where = f"the server at {server.http_url}"
    fix = (f"pass the --url of the server that serves {repo_dir} (`invoke serve --repo {repo_dir}` starts one), "
           "or the --repo that this server serves.")
    checked = 0
    for model, key in (("ensemble", IDENTITY_PARAM), ("preprocessing", "tokenizer_dir")):
        p = repo_dir / model / "config.pbtxt"
        want = pack.config_params(load_config(p)).get(key) if p.is_file() else None
        if not want:
            continue
        if key == "tokenizer_dir" and not _inside_dir(Path(want), repo_dir):
            # a copied (or moved) repository: its files still name the original, so both identities
            # would match the original's server, and edits here would switch and unload models there
            raise UserError("--repo", f"{repo_dir} is a copy or a move of another serving repository: its preprocessing's "
                            f"tokenizer_dir is {want!r}, outside it; the server at --url would load the original's "
                            "configs, not these.", "run the command on the repository the server serves (the one "
                            "tokenizer_dir points into), or create a new one here with `invoke promote --repo`.")
        try:
            live = server.model_config(model)
        except OSError as e:
            raise UserError("--url", f"{where} does not answer ({e}).", "start it with `invoke serve`, or pass its HOST:PORT.") from None
        if live is None:
            continue
        got = ((live.get("parameters") or {}).get(key) or {}).get("string_value")
        if got != want:
            raise UserError("--url", f"{where} does not serve {repo_dir}: its {model} has {key} {got!r}, the repository's "
                            f"is {want!r}; changing releases there would switch or unload another repository's models.", fix)
        checked += 1
    if not checked:
        raise UserError("--url", f"{where} has neither the ensemble nor the preprocessing model of {repo_dir} loaded, so "
                        "it cannot be told that it serves this repository.",
                        f"restart it on this repository (`invoke serve --repo {repo_dir}`), or pass the right --url.")


def reconcile_server(repo_dir: Path, server, state: dict) -> list[str]:
    """Make the live ``server`` serve what ``state`` records (after ``recover`` made the files agree):
    the current unit loaded, the loaded ensemble's unit step on it (the ensemble reloaded from its
    re-pointed config otherwise: a crash after a switch's reload but before its commit), and loaded
    units that are no release (a crashed promote's uncommitted unit, a rejected candidate), no
    in-progress rollout's candidate and not routed to (``_routed``) unloaded (a warm previous
    release stays). Returns what was done; [] without a server. Raises RuntimeError when the
    reloaded ensemble still calls another unit."""
    if server is None:
        return []
    fixed: list[str] = []
    cur = state["current"]
    live = _live_unit(server)
    if live is not None and live != cur:
        if _loaded(server).get(cur) != "READY":
            server.load(cur)
            fixed.append(f"{cur} loaded")
        server.load("ensemble")
        now = _live_unit(server)
        if now != cur:
            raise RuntimeError(f"the live ensemble calls {now} after reloading it, releases.json says {cur}")
        fixed.append(f"live ensemble moved from {live} back to {cur}")
    rejected = rejected_units(state)
    releases = set(current_order(state)) | {r.get("unit") for r in state.get("releases", [])}
    keep = {cur} | _routed(repo_dir, server) | {u for u in releases if u not in rejected}
    if state.get("rollout"):
        keep.add(state["rollout"].get("candidate"))
    for name, st in _loaded(server).items():
        if pack.is_unit(name) and st == "READY" and name not in keep:
            with contextlib.suppress(Exception):
                server.unload(name)
                fixed.append(f"{name} unloaded (no release; nothing routes to it)")
    return fixed


def _switch(repo_dir: Path, server, unit: str, timings: dict, previous: str) -> None:
    """Point ensemble and BLS at ``unit`` and reload them; on a failure put both back as they were."""
    try:
        _switch_to(repo_dir, server, unit, timings)
    except BaseException:
        point_ensemble(repo_dir, previous)
        point_bls(repo_dir, previous)
        if server is not None:
            with contextlib.suppress(Exception):
                server.load("ensemble")
        raise


def _switch_to(repo_dir: Path, server, unit: str, timings: dict) -> None:
    point_ensemble(repo_dir, unit)
    _crash_point("ensemble_config")
    if server is not None:
        t = time.perf_counter()
        server.load("ensemble")
        timings["ensemble_load_ms"] = (time.perf_counter() - t) * 1e3
    _crash_point("switch")
    point_bls(repo_dir, unit)  # the running BLS follows route.json from its next request
    _crash_point("bls_config")


def current_order(state: dict) -> list[str]:
    """Units that were the current release, the most recently current first (history ``MOVES``)."""
    order: list[str] = []
    for h in reversed(state.get("history", [])):
        if h.get("action") in MOVES:
            for u in (h.get("to"), h.get("from")):
                if u and u not in order:
                    order.append(u)
    return order


def rejected_units(state: dict) -> dict[str, str]:
    """{unit: failed check} of candidates whose last rollout was aborted (automatically: a failed check,
    or by hand) and that were not made current after it: never a rollback target."""
    out: dict[str, str] = {}
    for h in state.get("history", []):
        if h.get("action") in MOVES:
            out.pop(h.get("to"), None)
        elif h.get("action") == "rollout_abort" and h.get("from"):
            ro = h.get("rollout") or {}
            out[h["from"]] = f"{ro.get('failed_check') or 'aborted'} at {ro.get('percent', '?')} %"
    return out


def _retain(repo_dir: Path, state: dict, server, warm_previous: bool, previous: str | None) -> list[str]:
    """Unload units that need not stay loaded; delete units beyond keep_releases (fallback kept).
    The releases counted are those that were current (``current_order``), rejected ones excluded: an
    aborted rollout's candidate is never kept in place of a real release."""
    keep_n = int(state.get("keep_releases", 2))
    cur, fb = state["current"], state.get("fallback")
    keep_disk = {cur} | ({fb} if fb else set())
    rejected = rejected_units(state)
    prev = [u for u in current_order(state) if u != cur and u != fb and u not in rejected]
    keep_disk |= set(prev[:keep_n])
    warm = {cur} | ({fb} if fb and state.get("warm_fallback") else set()) | ({previous} if warm_previous and previous else set())
    removed = []
    loaded = _loaded(server)
    for name, st in loaded.items():
        if pack.is_unit(name) and st == "READY" and name not in warm:
            with contextlib.suppress(Exception):
                server.unload(name)
    for p in sorted(Path(repo_dir).iterdir()):
        if pack.is_unit(p.name) and p.name not in keep_disk:
            if server is not None and loaded.get(p.name) == "READY":
                with contextlib.suppress(Exception):
                    server.unload(p.name)
            _remove_dir(p)
            removed.append(p.name)
    state["releases"] = [r for r in state["releases"] if (Path(repo_dir) / r["unit"]).is_dir()]
    return removed


def promote(repo_dir: Path, engine_unit: Path, *, server=None, profile: str = "", gate: dict | None = None,
            promoted_by: str = "manual", smoke: bool = True, expect: str | None = None, serve_root: str | None = None,
            warm_previous: bool = False) -> dict:
    """Make ``engine_unit`` (a unit dir or a packed repository) the current release of ``repo_dir``.

    Steps: install the unit aside and rename it in; load it beside the current one (``server``);
    smoke-test it directly; point ensemble and BLS at it (atomic rewrites) and reload them; commit
    releases.json; unload/delete what retention no longer needs. Returns timings in ms.
    The build itself (skew of a built engine against the serving image and GPU included) is judged before,
    once, by ``serving/acceptance.py`` ``check_promotable``; install verifies the unit's files (``install_unit``).
    """
    repo_dir = Path(repo_dir)
    t0 = time.perf_counter()
    timings: dict[str, Any] = {}
    with _lock(repo_dir):
        state = _state_or_refuse(repo_dir, "no releases.json: this is not a serving repository.",
                                 "create it with `invoke promote --profile P --repo DIR` (the first promote creates it).",
                                 server=server)
        previous = state["current"]
        unit = install_unit(repo_dir, engine_unit, serve_root, protect=serving_now(state))
        _crash_point("install")
        if state.get("rollout"):
            raise UserError("promote", f"a rollout of {state['rollout']['candidate']} is in progress.",
                            "let it finish, or end it with `invoke rollout --abort`.")
        if unit == previous:
            raise UserError("engine_unit", f"{unit} is already the current release.", "nothing to promote.")
        if server is not None:
            t = time.perf_counter()
            _load_unit(server, unit, "--out", previous, "rebuild the output (`invoke build`), then promote it again.")
            timings["load_ms"] = (time.perf_counter() - t) * 1e3
        _crash_point("load")
        if server is not None and smoke:
            try:
                timings["smoke"] = _smoke_unit(server, unit, "--out", previous,
                                               "rebuild the output (`invoke build`), then promote it again.", expect=expect)
            except Exception:
                if unit not in (state.get("fallback"),) or not state.get("warm_fallback"):
                    with contextlib.suppress(Exception):
                        server.unload(unit)
                raise
        _crash_point("smoke")
        try:
            _switch(repo_dir, server, unit, timings, previous)
            timings["switched_ms"] = (time.perf_counter() - t0) * 1e3
        except BaseException:
            if server is not None and not (unit == state.get("fallback") and state.get("warm_fallback")):
                with contextlib.suppress(Exception):
                    server.unload(unit)
            raise
        state["current"] = unit
        state["releases"] = [r for r in state["releases"] if r["unit"] != unit or r["kind"] == "fallback"]
        state["releases"].append(_release_record(repo_dir / unit, unit, profile, gate, promoted_by, "release"))
        timings["total_ms"] = (time.perf_counter() - t0) * 1e3
        state["history"] = (state["history"] + [{"action": "promote", "from": previous, "to": unit, "time": _now(),
                                                 "by": promoted_by, "ms": round(timings["total_ms"], 1)}])[-HISTORY_MAX:]
        _write_state(repo_dir, state)  # commit point
        _crash_point("commit")
        timings["removed"] = _retain(repo_dir, state, server, warm_previous, previous)
        _write_state(repo_dir, state)
        _crash_point("gc")
    timings["unit"] = unit
    return timings


def set_fallback(repo_dir: Path, engine_unit: Path, *, server=None, warm: bool = False, serve_root: str | None = None,
                 by: str = "manual") -> dict:
    """Install the fallback profile's prebuilt unit (kept on disk; loaded and smoke-tested when ``warm``)."""
    repo_dir = Path(repo_dir)
    timings: dict[str, Any] = {}
    with _lock(repo_dir):
        state = _state_or_refuse(repo_dir, "no releases.json.", "init the serving repository first.", server=server)
        unit = install_unit(repo_dir, engine_unit, serve_root, protect=serving_now(state))
        if server is not None and warm:
            t = time.perf_counter()
            server.load(unit)
            timings["load_ms"] = (time.perf_counter() - t) * 1e3
            timings["smoke"] = smoke_test(server, unit)
        state["fallback"], state["warm_fallback"] = unit, bool(warm)
        state["releases"] = [r for r in state["releases"] if r["kind"] != "fallback"]
        state["releases"].append(_release_record(repo_dir / unit, unit, "", None, by, "fallback"))
        _write_state(repo_dir, state)
    timings["unit"] = unit
    return timings


def rollback(repo_dir: Path, to: str | None = None, *, fallback: bool = False, server=None, by: str = "manual",
             smoke: bool = True) -> dict:
    """Switch back to an earlier release (``to``: unit name or a prefix of its 12 hex digits; default: the
    previous release) or to the fallback. A loaded (warm) target costs only the config switch;
    a cold one is loaded and smoke-tested first. Returns timings in ms (``warm``: whether it was loaded)."""
    repo_dir = Path(repo_dir)
    if not repo_dir.is_dir():
        raise UserError("--repo", f"{repo_dir} does not exist, so there is nothing to roll back.",
                        "pass the serving repository that `invoke promote` created (default "
                        "artifacts/serving/model_repository).")
    t0 = time.perf_counter()
    timings: dict[str, Any] = {}
    with _lock(repo_dir):
        state = _state_or_refuse(repo_dir, "no releases.json.", "init the serving repository first.", server=server)
        cur = state["current"]
        if state.get("rollout"):
            raise UserError("rollback", f"a rollout of {state['rollout']['candidate']} is in progress.",
                            "end it with `invoke rollout --abort` (all traffic back to the stable release).")
        units = [p.name for p in repo_dir.iterdir() if pack.is_unit(p.name)]
        rejected = rejected_units(state)
        releases = set(current_order(state)) | {r.get("unit") for r in state.get("releases", [])}
        if fallback:
            target = state.get("fallback")
            if not target:
                raise UserError("--fallback", "this repository has no fallback release.",
                                f"roll back to a kept release instead: `invoke rollback --repo {repo_dir}` (the previous "
                                f"one) or `--to UNIT` (`invoke releases --repo {repo_dir}` lists them). A repository gets "
                                "its fallback at its first promote, from the profile's deployment.fallback build "
                                "(`invoke build --profile <that profile>` first).")
        elif to:
            t = to if to.startswith(pack.UNIT_PREFIX) else pack.UNIT_PREFIX + to[:12]
            cands = [u for u in units if u.startswith(t)] if len(t) < len(pack.UNIT_PREFIX) + 12 else [t]
            if len(cands) != 1 or cands[0] not in units:
                raise UserError("--to", f"no single release on disk matches {to!r}.", f"on disk: {', '.join(sorted(units))}.")
            target = cands[0]
            if target in rejected or target not in releases:
                why = (f"its rollout was rolled back ({rejected[target]})" if target in rejected
                       else "it was never a release (a candidate left on disk)")
                raise UserError("--to", f"{target} is not a release to roll back to: {why}.",
                                "roll back to a kept release (`invoke releases`), or roll the candidate out again "
                                "(`invoke rollout`), which checks it.")
        else:
            prev = [u for u in current_order(state) if u != cur and u in units and u not in rejected]
            if not prev:
                raise UserError("rollback", "there is no previous release on disk (an aborted rollout's candidate "
                                "never counts).", "roll back to the fallback (--fallback).")
            target = prev[0]
        if target == cur:
            raise UserError("rollback", f"{target} is already current.", "choose another release.")
        if not (repo_dir / target).is_dir():
            raise UserError("rollback", f"{target} is not on disk.", "pick a kept release.")
        loaded = _loaded(server)
        timings["warm"] = loaded.get(target) == "READY"
        if server is not None and not timings["warm"]:
            t = time.perf_counter()
            _load_unit(server, target, "--fallback" if fallback else "--to", cur,
                       "roll back to another kept release (--to), or promote a fresh build.")
            timings["load_ms"] = (time.perf_counter() - t) * 1e3
            if smoke:
                timings["smoke"] = _smoke_unit(server, target, "--fallback" if fallback else "--to", cur,
                                               "roll back to another kept release (--to), or promote a fresh build.")
        _switch(repo_dir, server, target, timings, cur)
        timings["switched_ms"] = (time.perf_counter() - t0) * 1e3
        state["current"] = target
        timings["total_ms"] = (time.perf_counter() - t0) * 1e3
        state["history"] = (state["history"] + [{"action": "rollback", "from": cur, "to": target, "time": _now(),
                                                 "by": by, "ms": round(timings["total_ms"], 1)}])[-HISTORY_MAX:]
        _write_state(repo_dir, state)  # commit point
        timings["removed"] = _retain(repo_dir, state, server, False, None)
        _write_state(repo_dir, state)
    timings["unit"] = target
    return timings


# --------------------------------------------------------------------------------------------
# Gradual rollout primitives (the orchestration -- steps, checks, metrics -- is serving/rollout.py)

ROLLOUT_STEPS = ("rollout_load", "rollout_begin", "rollout_route", "rollout_switch", "rollout_abort_route")
"""Crash points of a rollout: after the candidate is loaded and smoke-tested, after releases.json
records the rollout, after a step's route.json is written, after the 100 % switch (before its commit),
after an abort's route.json. At each, ``recover()`` leaves the stable release serving every request."""


def rollout_state(repo_dir: Path) -> dict | None:
    """releases.json's ``rollout`` (the rollout in progress) or None."""
    return (read_state(repo_dir) or {}).get("rollout")


def begin_rollout(repo_dir: Path, engine_unit: Path, *, server=None, profile: str = "", gate: dict | None = None,
                  steps: Iterable[int] = (), by: str = "rollout", smoke: bool = True,
                  serve_root: str | None = None) -> dict:
    """Install and load the candidate unit beside the current (stable) one and smoke-test it; record
    ``rollout`` = {candidate, profile, gate, steps, step, percent: 0, started, by} in releases.json.
    No request is routed to it yet (``set_rollout_percent``). Returns the rollout record (+ timings).
    Raises UserError when a rollout is already in progress or the candidate is current."""
    repo_dir = Path(repo_dir)
    timings: dict[str, Any] = {}
    with _lock(repo_dir):
        state = _state_or_refuse(repo_dir, "no releases.json: this is not a serving repository.",
                                 "create it with `invoke promote --profile P` first (the first promote creates it).", server=server)
        if state.get("rollout"):
            raise UserError("rollout", f"a rollout of {state['rollout']['candidate']} is already in progress.",
                            "end it with `invoke rollout --abort` first.")
        unit = install_unit(repo_dir, engine_unit, serve_root, protect=serving_now(state))
        if unit == state["current"]:
            raise UserError("--profile", f"{unit} is already the current release.", "nothing to roll out.")
        if server is not None:
            t = time.perf_counter()
            _load_unit(server, unit, "--out", state["current"], "rebuild the output (`invoke build`), then roll it out again.")
            timings["load_ms"] = (time.perf_counter() - t) * 1e3
            if smoke:
                try:
                    timings["smoke"] = _smoke_unit(server, unit, "--out", state["current"],
                                                   "rebuild the output (`invoke build`), then roll it out again.")
                except Exception:
                    with contextlib.suppress(Exception):
                        server.unload(unit)
                    raise
        _crash_point("rollout_load")
        state["rollout"] = {"candidate": unit, "stable": state["current"], "profile": profile, "gate": gate or {},
                            "steps": [int(x) for x in steps], "step": None, "percent": 0, "started": _now(), "by": by,
                            "pid": os.getpid(), "checks": []}
        _write_state(repo_dir, state)
        _crash_point("rollout_begin")
    return {**state["rollout"], "timings": timings}


def set_rollout_percent(repo_dir: Path, percent: int, checks: dict | None = None) -> dict:
    """Route ``percent`` (1..99) of the BLS's requests to the candidate; releases.json first (the step
    and the previous step's check numbers ``checks``), then route.json."""
    repo_dir = Path(repo_dir)
    with _lock(repo_dir):
        state = read_state(repo_dir) or {}
        ro = state.get("rollout")
        if not ro:
            raise UserError("rollout", "no rollout is in progress.", "start one with `invoke rollout --profile P`.")
        ro["step"], ro["percent"] = int(percent), int(percent)
        if checks:
            ro["checks"] = (ro.get("checks", []) + [checks])[-50:]
        _write_state(repo_dir, state)
        set_canary(repo_dir, state["current"], ro["candidate"], percent)
        _crash_point("rollout_route")
    return ro


def finish_rollout(repo_dir: Path, *, server=None, checks: dict | None = None, warm_previous: bool = False) -> dict:
    """The 100 % step: the candidate becomes the current release (ensemble and BLS re-pointed, the
    ensemble reloaded, releases.json committed with history action ``rollout``), as ``promote`` does
    after its smoke test. Returns timings in ms."""
    repo_dir = Path(repo_dir)
    t0 = time.perf_counter()
    timings: dict[str, Any] = {}
    with _lock(repo_dir):
        state = read_state(repo_dir) or {}
        ro = state.get("rollout")
        if not ro:
            raise UserError("rollout", "no rollout is in progress.", "start one with `invoke rollout --profile P`.")
        previous, unit = state["current"], ro["candidate"]
        _switch(repo_dir, server, unit, timings, previous)
        _crash_point("rollout_switch")
        timings["switched_ms"] = (time.perf_counter() - t0) * 1e3
        ro.pop("checks", None)
        state.pop("rollout")
        state["current"] = unit
        state["releases"] = [r for r in state["releases"] if r["unit"] != unit or r["kind"] == "fallback"]
        state["releases"].append(_release_record(repo_dir / unit, unit, ro.get("profile", ""), ro.get("gate"),
                                                 ro.get("by", "rollout"), "release"))
        state["history"] = (state["history"] + [{"action": "rollout", "from": previous, "to": unit, "time": _now(),
                                                 "by": ro.get("by", "rollout"), "ms": round(timings["switched_ms"], 1),
                                                 "rollout": {"steps": ro.get("steps"), "started": ro.get("started"),
                                                             "checks": checks or {}}}])[-HISTORY_MAX:]
        _write_state(repo_dir, state)  # commit point
        timings["removed"] = _retain(repo_dir, state, server, warm_previous, previous)
        _write_state(repo_dir, state)
    timings["unit"] = unit
    return timings


def abort_rollout(repo_dir: Path, *, server=None, failed_check: str = "manual abort", numbers: dict | None = None,
                  by: str = "manual", drained=None, verify: bool = True) -> dict:
    """Roll the rollout back: route.json sends every request to the stable release (first), the
    ensemble's config is pointed back at it and, when the live ensemble calls the candidate (a crash
    after the 100 % switch, before its commit), reloaded; then ``drained(candidate) -> dict`` (if
    given) waits for the candidate's last request and returns measurements, then the candidate is
    unloaded -- unless the live ensemble or route.json still routes to it (``candidate_kept``: why) --
    and releases.json records the abort (history action ``rollout_abort`` with the step,
    ``failed_check`` and its ``numbers``). A server that stopped answering (it died) only loses the
    live steps (``server_error``). ``verify``: check first that ``server`` serves ``repo_dir``
    (``verify_server``; the rollout's own automatic abort already did). Returns that record."""
    repo_dir = Path(repo_dir)
    t0 = time.perf_counter()
    with _lock(repo_dir):
        if verify:
            verify_server(repo_dir, server)
        state = read_state(repo_dir) or {}
        ro = state.get("rollout")
        if not ro:
            raise UserError("--abort", "no rollout is in progress.", "`invoke releases` shows the current release.")
        cur, unit = state["current"], ro["candidate"]
        point_bls(repo_dir, cur)
        route_ms = (time.perf_counter() - t0) * 1e3
        _crash_point("rollout_abort_route")
        point_ensemble(repo_dir, cur)
        extra: dict[str, Any] = {}
        try:
            if server is not None and _live_unit(server) not in (None, cur):
                if _loaded(server).get(cur) != "READY":
                    server.load(cur)
                server.load("ensemble")
                extra["ensemble_reloaded"] = True
            drain = dict(drained(unit) or {}) if drained is not None else {}
        except (OSError, RuntimeError, ValueError) as e:  # the server died or refused: the files are right; say what was not done
            drain, extra["server_error"] = {}, f"{type(e).__name__}: {str(e)[:300]}"
        if server is not None and "server_error" not in extra:
            routed = _routed(repo_dir, server)
            if unit in routed:
                extra["candidate_kept"] = "the live ensemble or route.json still routes to it"
            elif _loaded(server).get(unit) == "READY" and unit != state.get("fallback"):
                with contextlib.suppress(Exception):
                    server.unload(unit)
        rec = {"candidate": unit, "stable": cur, "step": ro.get("step"), "percent": ro.get("percent"),
               "steps": ro.get("steps"), "started": ro.get("started"), "failed_check": failed_check,
               "numbers": numbers or {}, "route_ms": round(route_ms, 2), **drain, **extra,
               "checks": ro.get("checks", [])}
        state.pop("rollout")
        state["history"] = (state["history"] + [{"action": "rollout_abort", "from": unit, "to": cur, "time": _now(),
                                                 "by": by, "ms": round((time.perf_counter() - t0) * 1e3, 1),
                                                 "rollout": rec}])[-HISTORY_MAX:]
        _write_state(repo_dir, state)
    return rec


PROBE_HISTORY_MAX = 50
"""Probe records kept in ``history`` (the oldest probe records go first; never a release record)."""


def check_probe_unit(unit: str) -> None:
    """UserError (``--unit``, exit 2) unless ``unit`` is an engine unit (``tensorrt_llm_<h12>``): the probe
    judges one engine, and the release history records engine units only (never ``ensemble``)."""
    if not pack.is_unit(str(unit)):
        raise UserError("--unit", f"{str(unit)[:80]!r} is not an engine unit (tensorrt_llm_<h12>); the probe judges one "
                        "engine.", "pass --unit tensorrt_llm_<h12> (`invoke releases` lists them), or leave it out for "
                        "the current release.")


def probe_record(unit: str, summary: dict, *, profile: str = "", by: str = "invoke probe") -> dict:
    """The history record of one probe run (``record_probe``)."""
    return {"action": "probe", "from": None, "to": None, "unit": unit, "profile": profile, "time": _now(),
            "by": by, "ms": round(float(summary.get("ms", 0.0)), 1), "probe": summary}


def record_probe(repo_dir: Path, unit: str, summary: dict, *, profile: str = "", by: str = "invoke probe") -> dict:
    """Append one accuracy-probe result (serving/probe.py ``ProbeResult.summary()``) to releases.json's
    history as ``{"action": "probe", "from": None, "to": None, "unit", "profile", "time", "by", "ms",
    "probe": summary}`` (``from``/``to`` stay empty: a probe moves no traffic, so rollback and retention
    ignore it). At most ``PROBE_HISTORY_MAX`` probe records stay. Atomic write under the releases lock.
    Raises UserError when ``repo_dir`` has no releases.json or ``unit`` is not an engine unit (e.g.
    ``ensemble``). Returns the record."""
    repo_dir = Path(repo_dir)
    check_probe_unit(unit)
    with _lock(repo_dir):
        state = _state_or_refuse(repo_dir, "no releases.json: this is not a serving repository.",
                                 "create it with `invoke promote --profile P` first.", recover=False)
        rec = probe_record(unit, summary, profile=profile, by=by)
        hist = state.get("history", []) + [rec]
        n_probe = sum(1 for h in hist if h.get("action") == "probe")
        drop = max(0, n_probe - PROBE_HISTORY_MAX)
        kept = []
        for h in hist:
            if drop and h.get("action") == "probe":
                drop -= 1
                continue
            kept.append(h)
        state["history"] = kept[-HISTORY_MAX:]
        _write_state(repo_dir, state)
    return rec


def list_releases(repo_dir: Path) -> dict:
    """releases.json plus what is on disk (for `invoke releases`). UserError (``--repo``, exit 2) when
    ``repo_dir`` does not exist or is no serving repository (no releases.json beside it: ``/``, a build
    output's model_repository)."""
    repo_dir = Path(repo_dir)
    fix = "pass the serving repository that `invoke promote` created (default artifacts/serving/model_repository)."
    if not repo_dir.is_dir():
        raise UserError("--repo", f"{repo_dir} does not exist.", fix)
    state = read_state(repo_dir)
    if state is None:
        raise UserError("--repo", f"{repo_dir} is not a serving repository: there is no {state_path(repo_dir)} "
                        "beside it.", fix)
    on_disk = sorted(p.name for p in repo_dir.iterdir() if pack.is_unit(p.name))
    return {"state": state, "on_disk": on_disk, "configs": current_of_configs(repo_dir)}


__all__: Iterable[str] = ["promote", "rollback", "set_fallback", "init_serving_repo", "recover", "smoke_test",
                          "read_state", "serving_models", "list_releases", "STEPS", "INIT_STEPS", "CRASH_ENV",
                          "set_canary", "begin_rollout", "set_rollout_percent", "finish_rollout", "abort_rollout",
                          "rollout_state", "ROLLOUT_STEPS", "record_probe", "verify_server", "reconcile_server",
                          "current_order", "rejected_units", "MOVES", "IDENTITY_PARAM"]
