"""Crash recovery of a serving repository (``recover``: the files, then a live server, agree with releases.json)
and its first promote (``init_serving_repo``: the whole repository staged and swapped in with releases.json)."""

from __future__ import annotations

import contextlib
import errno
import os
import time
from pathlib import Path
from typing import Any

from precision_pipeline.core.errors import ServerStopped, UserError
from precision_pipeline.core.outputs import serving_path_problem
from precision_pipeline.core.store import clean_stale, read_json
from precision_pipeline.serving import pack
from precision_pipeline.serving.release_configs import current_of_configs, load_config, point_bls, point_ensemble, set_canary, set_params
from precision_pipeline.serving.release_live import (reconcile_server, refuse_copied_repository, stopped_before_switch,
                                                      verify_server)
from precision_pipeline.serving.release_state import (HISTORY_MAX, IDENTITY_PARAM, LOCK_FILE, REPO_FOLDER_FIELD, ROUTE_FILE,
                                                      STATE_FILE, crash_point, lock, note_recovered,
                                                      rollout_alive, read_state, release_record, require_state, state_path,
                                                      timestamp, write_state)
from precision_pipeline.serving.release_units import (copy_unit, edited_since_install, installed_record, resolve_unit_source, served_path, unit_damage,
                                                      unit_record)


def state_or_refuse(repo_dir: Path, reason: str, fix: str, *, recover: bool = True, server=None,
                    leaving_current: bool = False) -> dict:
    """Under the releases lock: refuse a ``server`` that does not serve ``repo_dir`` (``verify_server``),
    finish an interrupted change (``recover``; then ``reconcile_server`` on the live server), then
    ``releases.json``; UserError on its path with ``reason`` / ``fix`` when the repository has none.
    ``leaving_current``: the caller makes another unit current (rollback, promote), so a current release whose folder
    is missing is no refusal here (hostile s15 F3: every way out was refused as the printed fix) and the live server
    is not asked to load it."""
    if server is None and Path(repo_dir).is_dir():  # with a server: verify_server refuses a copy too (s17b F9)
        read_state(repo_dir)  # a copy beside its original: the record's own, more exact refusal first
        refuse_copied_repository(repo_dir, "a release recorded here would name units and a tokenizer this repository "
                                 "does not serve from (`invoke serve` refuses it); nothing was changed.")
    try:
        verify_server(repo_dir, server)
    except ServerStopped as e:  # hostile s16b T44/T47: a one-line "stopped answering", not what holds
        with contextlib.suppress(UserError):
            raise stopped_before_switch(e, (read_state(repo_dir) or {}).get("current") or "the current release") from None
        raise
    usable = True
    if recover:
        fixed, usable = recover_locked(repo_dir, leaving_current=leaving_current, server=server)
        note_recovered(fixed)
    state = require_state(repo_dir, reason, fix)
    if recover and usable:
        note_recovered(reconcile_server(repo_dir, server, state))
    return state


def init_serving_repo(repo_dir: Path, packed_repo: Path, *, serve_root: str | None = None, profile: str = "",
                      gate: dict | None = None, by: str = "init", fallback_repo: Path | None = None,
                      warm_fallback: bool = False, keep_releases: int = 2) -> dict:
    """Create a serving repository from a packed one (its unit becomes the current release). ``fallback_repo``: a
    packed repository of the fallback profile whose unit is kept on disk (and loaded when ``warm_fallback``)."""
    repo_dir, packed_repo = _servable(Path(repo_dir)), Path(packed_repo)
    unit_src = resolve_unit_source(packed_repo)
    with lock(repo_dir):
        note_recovered(recover_first_promote(repo_dir))  # a refusal below says so (hostile s16 H7: "nothing was changed")
        if repo_dir.exists():
            state = read_state(repo_dir)
            if state and state.get("current") == unit_src.name and [h.get("action") for h in state.get("history", [])] == ["init"]:
                return state  # an interrupted init of this same unit, now completed by the recovery above
            if state is None:
                raise UserError("repo_dir", f"{repo_dir} exists but has no {STATE_FILE} beside it, so it is not a serving "
                                "repository this pipeline can use.",
                                "pass a new directory as --repo (e.g. artifacts/serving/model_repository); never delete a "
                                "folder you did not create with `invoke promote`.")
            raise UserError("repo_dir", f"{repo_dir} already exists.", "promote into it instead (run the same promote "
                            "again: with the repository there it is a promote into it), or choose a new directory.")
        return _init_locked(repo_dir, packed_repo, unit_src, serve_root=serve_root, profile=profile, gate=gate, by=by,
                            fallback_repo=fallback_repo, warm_fallback=warm_fallback, keep_releases=keep_releases)


def _servable(repo_dir: Path) -> Path:
    """``repo_dir`` when Triton can serve a repository there; else UserError on ``--repo`` (exit 2): the rule build
    applies to ``--out`` (core/outputs.py ``serving_path_problem``; hostile s8 #117: `serve` never brought one up)."""
    why = serving_path_problem(str(repo_dir.resolve()))
    if why:
        raise UserError("--repo", why + "; nothing was created.", "pass a --repo path of ASCII letters, digits and "
                        "/ . _ - + @ : , = ~ (e.g. artifacts/serving/model_repository).")
    return repo_dir


def recover_first_promote(repo_dir: Path) -> list[str]:
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
    with atomic_dir(repo_dir, commit_files=commit, crash=lambda step: crash_point(f"init_{step}")) as tmp:
        for m in pack.FIXED_MODELS:  # copies: the serving repository shares no inode with a build output
            pack.copy_tree(_fixed_model_source(packed_repo, fallback_repo, m), tmp / m)
        tok = pack.serving_path(root, repo_dir.name, "preprocessing", "tokenizer")
        for m in ("preprocessing", "postprocessing"):
            set_params(tmp / m / "config.pbtxt", {"tokenizer_dir": tok})
        # install under the final name's parent: paths are computed for repo_dir, files staged in tmp
        unit = _install_into(tmp, repo_dir.name, unit_src, root)
        fb = None
        if fallback_repo is not None:
            fb = _install_into(tmp, repo_dir.name, resolve_unit_source(fallback_repo), root)
        point_ensemble(tmp, unit)
        point_bls(tmp, unit)
        repo_id = os.urandom(8).hex()
        set_params(tmp / "ensemble" / "config.pbtxt", {IDENTITY_PARAM: repo_id})
        pack.check_repository(tmp)
        state = {"version": 1, "current": unit, "fallback": fb, "warm_fallback": bool(warm_fallback and fb),
                 "keep_releases": int(keep_releases), "repository_id": repo_id, REPO_FOLDER_FIELD: repo_dir.resolve().name,
                 "unit_files": {u: installed_record(tmp / u, unit_record(src)) for u, src in
                                ((unit, unit_src), (fb, resolve_unit_source(fallback_repo) if fb else None)) if u}}
        state["releases"] = [release_record(tmp / unit, unit, profile, gate, by, "release", state["unit_files"][unit])]
        if fb:
            state["releases"].append(release_record(tmp / fb, fb, "", None, by, "fallback", state["unit_files"][fb]))
        state["history"] = [{"action": "init", "from": None, "to": unit, "time": timestamp(), "by": by, "ms": 0.0}]
        commit[state_path(repo_dir)] = state
        crash_point("init_stage")
    return state


def _fixed_model_source(packed_repo: Path, fallback_repo: Path | None, model: str) -> Path:
    """Where the first promote copies fixed model ``model`` from: the packed repository, or -- for the ensemble of an
    llm_api build, whose repository has none (serving/llmapi_unit.py ``REPO_MODELS``) -- the engine-route fallback
    build's, so a later engine release (or ``rollback --fallback``) has an ensemble to serve it. UserError (exit 2)
    when neither has it."""
    for repo in (packed_repo, fallback_repo):
        if repo is not None and (Path(repo) / model / "config.pbtxt").is_file():
            return Path(repo) / model
    raise UserError("--profile", f"{packed_repo} has no {model} model and no engine-route fallback build gives one: a "
                    "serving repository needs an ensemble for its engine releases (an llm_api build packs none).",
                    "build the profile's deployment.fallback (an engine-route profile, e.g. `invoke build --profile "
                    "bf16-h100`) and promote again, or create the repository from an engine-route build first and "
                    "promote (or roll out) the llm_api build into it.")


def _install_into(tmp_repo: Path, repo_name: str, unit_src: Path, root: str) -> str:
    name = unit_src.name
    if (tmp_repo / name).is_dir():
        return name
    copy_unit(unit_src, tmp_repo / name, unit_record(unit_src), served_path(root, Path(repo_name), name))
    return name


def recover(repo_dir: Path, server=None) -> list[str]:
    """Make the repository agree with releases.json (after a crash). Returns what was fixed.

    With a running ``server`` (verified to serve ``repo_dir`` first: ``verify_server``) the live server
    is made to agree too (``reconcile_server``)."""
    repo_dir = Path(repo_dir)
    if not repo_dir.is_dir() and not repo_dir.resolve().parent.is_dir():
        return []
    with lock(repo_dir):
        verify_server(repo_dir, server)
        fixed, usable = recover_locked(repo_dir, server=server)
        state = read_state(repo_dir)
        if usable and state and state.get("current"):
            fixed += reconcile_server(repo_dir, server, state)
        return note_recovered(fixed)


def heal(repo_dir: Path, server) -> list[str]:
    """One pass of ``invoke serve``'s watchdog: when no release command holds the repository's lock (``lock`` with
    no wait), make the files and the live ``server`` agree with releases.json (``recover_locked``, then
    ``reconcile_server``). A command killed between two steps of a switch (the live ensemble on one unit, the BLS and
    the record on another: hostile s15b F14, s15c T72) is repaired within seconds, not at the next release command.
    Returns what was done; [] when nothing disagreed, the lock is held (a change in progress), the repository cannot
    be written (read-only: ``lock`` refuses) or the server does not answer (serve reports its death itself).
    A refusal (the recorded current release missing, damaged or not loading: hostile s16 H3, a hand edit of
    releases.json onto a truncated kept unit) leaves the files and the server on what serves, and is printed once
    as ``[serve] not repaired: ...`` with its fix (again only when it changes)."""
    repo_dir = Path(repo_dir)
    held = False
    try:
        with lock(repo_dir, timeout_s=0):
            held = True  # a refusal before this is the lock's (held by a command, or read-only): silent
            fixed, usable = recover_locked(repo_dir, server=server)
            state = read_state(repo_dir)
            if usable and state and state.get("current"):
                fixed += reconcile_server(repo_dir, server, state)
            _HEAL_SAID.pop(str(repo_dir), None)
            return fixed
    except (UserError, RuntimeError) as e:  # RuntimeError: a load the server refused or never finished (s16 H10)
        said = (f"{e.problems[0].field}: {e.problems[0].reason} Fix: {e.problems[0].fix}" if isinstance(e, UserError)
                else f"{e} (tried again every few seconds)")
        if not held:
            return []
        if _HEAL_SAID.get(str(repo_dir)) != said:
            print(f"[serve] not repaired: {said}", flush=True)
        _HEAL_SAID[str(repo_dir)] = said
        return []
    except (OSError, ValueError):
        return []


_HEAL_SAID: dict[str, str] = {}
"""The last refusal ``heal`` printed per repository (a refusal is said once, not every ``HEAL_EVERY_S``)."""


def current_problem(repo_dir: Path, state: dict, server=None, done: list[str] | None = None) -> str | None:
    """Why the current release recorded in ``state`` cannot serve from ``repo_dir``, or None: its folder is missing,
    a file differs from its install record by size (``release_units.unit_damage``: stat only), or -- with a live
    ``server`` on which it is not loaded -- its load fails (the server's error). The load is made here, before a
    recovery points any file at the unit, so a unit that does not load never takes a request (hostile s16 H3: the BLS
    was re-pointed first, then every request failed). A load that worked is appended to ``done`` (hostile s17 F4: the
    watchdog reloaded a unit unloaded by hand without a word). ``ServerStopped`` propagates."""
    cur = state["current"]
    if not (Path(repo_dir) / cur / "config.pbtxt").is_file():
        return f"is missing from {repo_dir} (its folder deleted or moved)"
    if why := unit_damage(repo_dir, cur, state):
        return f"is damaged on disk ({cur}/{why} at its install)"
    if cur not in current_of_configs(repo_dir) and (why := edited_since_install(repo_dir, cur, state)):
        # about to be pointed at (releases.json edited by hand onto a kept unit whose config was edited, same size:
        # hostile s17c F1/H12 went live); a unit the configs already call serves as it is, unread every pass
        return f"is damaged on disk ({cur}/{why} at its install)"
    if server is not None and (was := server.loaded_models().get(cur)) != "READY":  # not answering: ServerStopped
        try:
            server.load(cur)
        except RuntimeError as e:
            return f"does not load on the server at {server.http_url} ({str(e)[:300]})"
        if done is not None:
            done.append(f"the current release {cur} loaded again on the server (its state was {was or 'not loaded'})")
    return None


def _readable_route(repo_dir: Path, fixed: list[str]) -> None:
    """route.json made rewritable when it cannot be read (the caller rewrites it from releases.json): a hand edit
    (hostile s8 #109) or a FIFO (s16 H13, which read_json refuses) is removed, a folder (s17 F1) moved beside
    releases.json, never deleted; what was done appended to ``fixed``."""
    route = repo_dir / "tensorrt_llm_bls" / ROUTE_FILE
    try:
        read_json(route, {})
    except (ValueError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in (errno.EINVAL, errno.EISDIR):
            raise
        if route.is_dir() and not route.is_symlink():
            aside = repo_dir.parent / f"{ROUTE_FILE}.folder-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
            route.rename(aside)
            fixed.append(f"{route} was a folder: moved to {aside} and route.json rewritten from {STATE_FILE}")
        else:
            route.unlink()
            fixed.append(f"{route} was unreadable{'' if isinstance(e, ValueError) else ' (not a regular file)'}: "
                         f"rewritten from {STATE_FILE}")


def _identity_back(repo_dir: Path, state: dict, fixed: list[str]) -> None:
    """The ensemble's ``IDENTITY_PARAM`` put back from releases.json's ``repository_id`` when its config lacks it (a
    copy of a packed repository's config restored by hand: hostile s17b F6); appended to ``fixed``."""
    ens = repo_dir / "ensemble" / "config.pbtxt"
    if state.get("repository_id") and ens.is_file() and IDENTITY_PARAM not in pack.config_params(load_config(ens)):
        set_params(ens, {IDENTITY_PARAM: state["repository_id"]})
        fixed.append(f"the ensemble's {IDENTITY_PARAM} put back from {STATE_FILE}")


def recover_locked(repo_dir: Path, leaving_current: bool = False, server=None) -> tuple[list[str], bool]:
    """Under the lock: make the files agree with releases.json (leftovers removed, a dead rollout ended, the ensemble
    and the BLS re-pointed at the current release). Returns (what was done, whether the current release can serve).
    A current release that cannot serve (``current_problem``: missing, damaged, not loading on ``server``) is a
    UserError on releases.json naming the repairs, nothing re-pointed -- unless ``leaving_current`` (the caller makes
    another unit current): then it is said and (…, False) returned."""
    fixed = recover_first_promote(repo_dir)
    if not repo_dir.is_dir():
        return fixed, True
    read_state(repo_dir)  # another folder's record (a copy beside the repository) is refused before anything is cleaned
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
        return fixed, True
    cur = state["current"]
    for m in ("ensemble", "tensorrt_llm_bls"):  # hostile s8 #108: a deleted config was a FileNotFoundError (exit 1)
        if not (repo_dir / m / "config.pbtxt").is_file():
            raise UserError(str(repo_dir / m / "config.pbtxt"), "is missing (deleted or moved): the serving repository "
                            "cannot serve, and this command changed nothing.", f"restore {repo_dir / m} from a backup, or "
                            "create a new serving repository (`invoke promote --profile P --repo NEW_DIR`).")
    if state.get("rollout") and not rollout_alive(state["rollout"]):  # dead, or its pid reused (s17 PID1)
        # a rollout whose process died (crash, kill -9): the stable release serves every request again
        ro = state.pop("rollout")
        state["history"] = (state.get("history", []) + [{
            "action": "rollout_abort", "from": ro.get("candidate"), "to": cur, "time": timestamp(), "by": "recover",
            "ms": 0.0, "rollout": {**ro, "failed_check": "interrupted", "numbers": {}}}])[-HISTORY_MAX:]
        write_state(repo_dir, state)
        fixed.append(f"interrupted rollout of {ro.get('candidate')} ended; {cur} serves all traffic")
    if why := current_problem(repo_dir, state, server, fixed):
        if not leaving_current:
            serves = current_of_configs(repo_dir)[1] if (repo_dir / "tensorrt_llm_bls").is_dir() else None
            raise UserError(str(state_path(repo_dir)), f"the current release {cur} {why}, so nothing was re-pointed at it"
                            + (f" (the BLS still sends requests to {serves})." if serves and serves != cur else "."),
                            f"restore the folder, promote its build again (a verified copy replaces it), or make another "
                            f"release current: `invoke rollback --repo {repo_dir}` (the previous one), `--to UNIT` or "
                            "`--fallback` (add --url when a server serves it).")
        fixed.append(f"the current release {cur} {why}")
        return fixed, False  # the caller's switch points the configs and route.json at the unit it makes current
    _readable_route(repo_dir, fixed)
    route = repo_dir / "tensorrt_llm_bls" / ROUTE_FILE
    if point_ensemble(repo_dir, cur):
        fixed.append(f"ensemble re-pointed at {cur}")
    _identity_back(repo_dir, state, fixed)
    ro = state.get("rollout")
    if ro and ro.get("percent") and server is not None and server.loaded_models().get(ro["candidate"]) != "READY":
        # hostile s17 F21: an abort killed after unloading the candidate; its canary put back sent requests to nothing
        if point_bls(repo_dir, cur):
            fixed.append(f"the rollout's canary to {ro['candidate']} not put back: the server has not loaded it; "
                         f"every request to {cur}")
    elif ro and ro.get("percent"):  # a live rollout's step: its canary stays (hostile s8 #76: a refused command ended it)
        want = {"tensorrt_llm_model_name": cur, "canary": {"tensorrt_llm_model_name": ro["candidate"],
                                                            "percent": int(ro["percent"])}}
        if (read_json(route, {}) or {}) != want:
            set_canary(repo_dir, cur, ro["candidate"], int(ro["percent"]))
            fixed.append(f"the rollout's canary ({ro['percent']} % to {ro['candidate']}) put back in route.json")
    elif point_bls(repo_dir, cur):
        fixed.append(f"tensorrt_llm_bls re-pointed at {cur}")
    return fixed, True
