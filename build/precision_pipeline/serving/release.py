"""Releases of a serving model repository: promote, rollback, fallback, retention, crash recovery.

Units of both serving routes (issue 28): engine units and LLM-API units (``llm_api_<h12>``, serving/llmapi_unit.py)
are releases alike; while an LLM-API unit is current the ensemble (token tensors only) is unloaded and the BLS serves
(``release_state.ensemble_serves``).

Why models and not versions: the real tensorrtllm backend loads the engine named by the
``gpt_model_path`` parameter and ignores Triton's version directories, so each engine is its own
Triton model, an *engine unit* ``tensorrt_llm_<h12>`` (see build/precision_pipeline/serving/pack.py). The ``ensemble`` step and
the ``tensorrt_llm_bls`` parameter ``tensorrt_llm_model_name`` name the current unit; switching a
release rewrites those two configs and reloads them. Triton keeps the old ensemble serving until the
new one is loaded, so a switch drops no request.

State: ``releases.json`` next to the serving model repository (``<repo>/../releases.json``)::

    {"current": unit, "fallback": unit|null, "warm_fallback": bool, "keep_releases": N,
     "releases": [{"unit", "engine_hash", "profile", "gate", "time", "promoted_by", "engine_present",
                   "kind": "release"|"fallback", "serving_route": "engine"|"llm_api", "provenance": {...}}, ...],
                                                         # oldest first; provenance: release_state.release_record
     "history": [{"action", "from", "to", "time", "by", "ms"}, ...],
     "unit_files": {unit: {path: [size, sha256]}}}   # each unit as installed; rollback verifies its target

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

History: only ``MOVES`` change the current release; a ``rollout_abort`` and a ``probe`` move nothing.
A candidate rolled back by a failed check (a verdict) is never a rollback target nor kept by retention,
an earlier release too, until a later move makes it current; a rollout ended without a verdict (a hand
abort, an interrupt, a crash) changes nothing about a unit that was a release, and its candidate, if it never
was one, never counts (``release_state.rejected_units``: the one rule).

Damaged ``releases.json`` (truncated, edited, a field of the wrong type or a unit field that is no unit name:
``release_state.ReleasesFile``, the one typed record every read goes through): every command refuses with the
file, the field and the fix (exit 2) and writes nothing; each write keeps the state before it as ``releases.json.prev``.

Modules: ``release_state`` (releases.json, its atomic writes and lock, crash hooks, history queries, probe
records), ``release_configs`` (ensemble/BLS/route.json rewrites), ``release_units`` (verified unit installs),
``release_live`` (smoke test, ``verify_server``, ``reconcile_server``), ``release_recover`` (``recover``,
the first promote ``init_serving_repo``), ``release_switch`` (the switch, retention), ``release_rollout``
(gradual rollout primitives); this module: promote, rollback, fallback and the listing.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterable

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import read_json
from precision_pipeline.serving import llmapi_unit, pack, release_live
from precision_pipeline.serving.release_configs import current_of_configs
from precision_pipeline.serving.release_live import load_unit, loaded_models, smoke_unit, unload_quietly
from precision_pipeline.serving.release_recover import init_serving_repo, state_or_refuse
from precision_pipeline.serving.release_state import (HISTORY_MAX, after_commit, stalled_rollout, check_probe_unit, crash_point, current_order, lock, make_current,
                                                      ROUTE_FILE, ensemble_serves, read_state, rejected_units, release_record,
                                                      state_path,
                                                      timestamp, write_state)
from precision_pipeline.serving.release_switch import commit_switch, retain, switch
from precision_pipeline.serving.release_units import (edited_since_install, entry_model_problems, install_release_unit, is_any_unit, resolve_unit_source, unit_damage,
                                                      verify_kept)

# re-exported for tasks.py and nightly.py until they import from the new homes (issue 24)
__all__: Iterable[str] = ["promote", "rollback", "set_fallback", "list_releases", "init_serving_repo", "read_state",
                          "check_probe_unit", "resolve_unit_source"]


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
    with lock(repo_dir):
        state = state_or_refuse(repo_dir, "no releases.json: this is not a serving repository.",
                                 "create it with `invoke promote --profile P --repo DIR` (the first promote creates it).",
                                 server=server, leaving_current=True)
        previous = state["current"]
        if state.get("rollout"):  # before the install: a refused promote installs nothing
            raise UserError("promote", f"a rollout of {state['rollout']['candidate']} is in progress.",
                            "let it finish, or end it with `invoke rollout --abort`.")
        before = json.dumps((state.get("unit_files") or {}).get(previous), sort_keys=True)
        unit = install_release_unit(repo_dir, engine_unit, serve_root, state, server)
        crash_point("install")
        _refuse_already_current(repo_dir, state, unit, previous, before)  # (a reinstalled folder is said: UserError.done)
        try:  # a refusal, Ctrl-C or SIGTERM before the switch: the candidate is unloaded (hostile s8 #59)
            if server is not None:
                t = time.perf_counter()
                load_unit(server, unit, "--out", previous, "rebuild the output (`invoke build`), then promote it again.")
                timings["load_ms"] = (time.perf_counter() - t) * 1e3
            crash_point("load")
            if server is not None and smoke:
                timings["smoke"] = smoke_unit(server, unit, "--out", previous,
                                               "rebuild the output (`invoke build`), then promote it again.", expect=expect)
        except BaseException:
            _unload_candidate(server, unit, state)
            raise
        crash_point("smoke")
        try:
            switch(repo_dir, server, unit, timings, previous)
            timings["switched_ms"] = (time.perf_counter() - t0) * 1e3
        except BaseException:
            _unload_candidate(server, unit, state)
            raise
        make_current(repo_dir, state, unit, profile, gate, promoted_by)
        timings["total_ms"] = (time.perf_counter() - t0) * 1e3
        state["history"] = (state["history"] + [{"action": "promote", "from": previous, "to": unit, "time": timestamp(),
                                                 "by": promoted_by, "ms": round(timings["total_ms"], 1)}])[-HISTORY_MAX:]
        with after_commit(repo_dir, unit, f"promoted {unit}", server):
            commit_switch(repo_dir, state, server, unit, previous)  # commit point
            crash_point("commit")
            timings["removed"] = retain(repo_dir, state, server, warm_previous, previous)
            write_state(repo_dir, state)
            crash_point("gc")
    return {**timings, "unit": unit}


def _refuse_already_current(repo_dir: Path, state: dict, unit: str, previous: str, before: str) -> None:
    """A promote of the current release's own build (``unit`` is ``previous``): UserError (exit 2, nothing to promote);
    nothing otherwise. When the install found
    the folder holding the build's unit but recorded it anew (``before``: its ``unit_files`` row before, as JSON; an
    edit that changes nothing parsed, e.g. a comment in config.pbtxt), the new record is written and said: the damage
    ``releases`` and the watchdog reported is cleared, the fix they printed worked (hostile s17 F13)."""
    if unit != previous:
        return
    if json.dumps((state.get("unit_files") or {}).get(unit), sort_keys=True) != before:
        write_state(repo_dir, state)
        raise UserError("engine_unit", f"{unit} is already the current release; its folder was compared with this build "
                        "file by file (config.pbtxt as parsed) and holds its unit, so its install record now describes "
                        "the folder as it is (the damage reported before is cleared).", "nothing to promote.")
    raise UserError("engine_unit", f"{unit} is already the current release.", "nothing to promote.")


def _unload_candidate(server, unit: str, state: dict) -> None:
    """Unload a refused candidate ``unit`` from ``server`` -- unless it is the warm fallback (it stays loaded)."""
    if server is not None and not (unit == state.get("fallback") and state.get("warm_fallback")):
        unload_quietly(server, unit)


def set_fallback(repo_dir: Path, engine_unit: Path, *, server=None, warm: bool = False, serve_root: str | None = None,
                 by: str = "manual") -> dict:
    """Install the fallback profile's prebuilt unit (kept on disk; loaded and smoke-tested when ``warm``)."""
    repo_dir = Path(repo_dir)
    timings: dict[str, Any] = {}
    with lock(repo_dir):
        state = state_or_refuse(repo_dir, "no releases.json.", "init the serving repository first.", server=server)
        unit = install_release_unit(repo_dir, engine_unit, serve_root, state, server)
        if server is not None and warm:
            t = time.perf_counter()
            server.load(unit)
            timings["load_ms"] = (time.perf_counter() - t) * 1e3
            timings["smoke"] = release_live.smoke_test(server, unit)
        state["fallback"], state["warm_fallback"] = unit, bool(warm)
        state["releases"] = [r for r in state["releases"] if r.get("kind") != "fallback"]
        state["releases"].append(release_record(repo_dir / unit, unit, "", None, by, "fallback", state["unit_files"].get(unit)))
        write_state(repo_dir, state)
    timings["unit"] = unit
    return timings


def _rollback_target(repo_dir: Path, state: dict, to: str | None, fallback: bool) -> str:
    """The unit ``rollback`` switches to: the fallback, the kept release ``to`` names (a unit name or a prefix
    of its 12 hex digits), or the previous release; UserError (exit 2) when there is none to take."""
    cur = state["current"]
    if fallback and to:
        raise UserError("--to", f"and --fallback name two targets ({to!r} and the fallback); taking one would be a guess.",
                        "pass one of them.")
    units = [p.name for p in repo_dir.iterdir() if is_any_unit(p.name)]
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
        to = to.strip().rstrip("/")  # a folder's name as the shell completes it (hostile s17c E32)
        to = to.lower() if all(c in "0123456789abcdefABCDEF" for c in to) else to  # hex digits in capitals (E34)
        named = to.startswith((pack.UNIT_PREFIX, llmapi_unit.PREFIX))  # a unit name (or a prefix of one): either kind
        cands = [u for u in units if (u.startswith(to) if named else u.rsplit("_", 1)[1].startswith(to[:12]))]
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
        kept = {r.get("unit") for r in state.get("releases", [])}  # retention's deletions are no longer listed
        gone = [u for u in current_order(state) if u != cur and u in kept and u not in units and u not in rejected]
        order = current_order(state)
        if gone and (not prev or order.index(gone[0]) < order.index(prev[0])):
            # hostile s12 F-M: the record names it, its folder is gone; s16b T163: never skip it for an older one
            older = (f", or roll back past it to the release before it: `invoke rollback --repo {repo_dir} --to {prev[0]}`"
                     if prev else "")
            raise UserError("rollback", f"the previous release {gone[0]} is missing from {repo_dir} (deleted or moved); "
                            "nothing was switched.", "restore its folder there, or promote its build again (`invoke "
                            f"promote --profile P --out <its build>`){older}.")
        if not prev:
            fix = ("roll back to the fallback (--fallback)." if state.get("fallback") not in (None, cur) else
                   "this repository has no fallback either: promote a build (`invoke promote --profile P`), or roll "
                   "back to a kept unit by name (`invoke rollback --to UNIT`; `invoke releases` lists them).")
            raise UserError("rollback", "there is no previous release on disk (a unit rolled back by a failed check, "
                            "or a candidate that was never current, never counts).", fix)
        target = prev[0]
    return target


def _current_before_lock(repo_dir: Path) -> str | None:
    """The current release as releases.json names it before a command waits for the lock (None when it cannot be
    read now: the locked read refuses with the reason)."""
    try:
        return (read_state(repo_dir) or {}).get("current")
    except (UserError, OSError, ValueError):
        return None


def rollback(repo_dir: Path, to: str | None = None, *, fallback: bool = False, server=None, by: str = "manual",
             smoke: bool = True) -> dict:
    """Switch back to an earlier release (``to``: unit name or a prefix of its 12 hex digits; default: the
    previous release) or to the fallback. A loaded (warm) target costs the smoke test and the config switch;
    a cold one is loaded first. A target that fails its smoke test is unloaded (a warm fallback stays loaded)
    and nothing is switched (UserError, exit 2). Returns timings in ms (``warm``: whether it was loaded). A target that
    is already current switches nothing (``already_current``: True): the recovery every release command starts with
    has put the configs, route.json and the live server back on it, which is what releases' fix for a split asks."""
    repo_dir = Path(repo_dir)
    if not repo_dir.is_dir():
        raise UserError("--repo", f"{repo_dir} {'is a file, not a folder' if repo_dir.exists() else 'does not exist'}, "
                        "so there is nothing to roll back.",
                        "pass the serving repository that `invoke promote` created (default "
                        "artifacts/serving/model_repository).")
    t0 = time.perf_counter()
    timings: dict[str, Any] = {}
    seen = _current_before_lock(repo_dir) if to is None and not fallback else None
    with lock(repo_dir):
        state = state_or_refuse(repo_dir, "no releases.json.", "init the serving repository first.", server=server,
                                leaving_current=True)
        cur = state["current"]
        if seen and seen != cur:  # hostile s18b F8: a second plain rollback undid the first one it had waited for
            raise UserError("rollback", f"the current release changed from {seen} to {cur} while this command waited "
                            "for the lock (another command switched it); a plain rollback now would undo that, so "
                            "nothing was switched.", f"`invoke releases --repo {repo_dir}` shows what serves; to roll "
                            "back still, run it again, or name the target with --to UNIT.")
        if state.get("rollout"):
            raise UserError("rollback", f"a rollout of {state['rollout']['candidate']} is in progress.",
                            "end it with `invoke rollout --abort` (all traffic back to the stable release).")
        target = _rollback_target(repo_dir, state, to, fallback)
        if not (repo_dir / target).is_dir():
            if fallback:  # hostile s17 F14: it did not say it was the fallback, nor how to get it back
                raise UserError("--fallback", f"the fallback {target} is missing from {repo_dir} (deleted or moved); "
                                "nothing was switched.", "restore its folder there, or roll back to a kept release "
                                f"(`invoke rollback --repo {repo_dir}`; `invoke releases` lists them). A fallback is "
                                "installed by a repository's first promote only.")
            raise UserError("rollback", f"{target} is not on disk.", "pick a kept release.")
        field, fix = "--fallback" if fallback else "--to", "roll back to another kept release (--to), or promote a fresh build."
        t = time.perf_counter()
        timings["verified"] = verify_kept(repo_dir, target, state, field if (fallback or to) else "rollback", cur)
        timings["verify_ms"] = (time.perf_counter() - t) * 1e3
        if target == cur:  # nothing to switch; the recovery above put the files and the server back on it (s17 F1)
            return {**timings, "unit": cur, "already_current": True, "total_ms": (time.perf_counter() - t0) * 1e3}
        loaded = loaded_models(server)
        timings["warm"] = loaded.get(target) == "READY"
        if server is not None and not timings["warm"]:
            t = time.perf_counter()
            load_unit(server, target, field, cur, fix, loaded)
            timings["load_ms"] = (time.perf_counter() - t) * 1e3
        if server is not None and smoke:  # a warm target too: being loaded proves nothing (hostile s7 #54)
            try:
                timings["smoke"] = smoke_unit(server, target, field, cur, fix)
            except Exception:
                _unload_candidate(server, target, state)
                raise
        switch(repo_dir, server, target, timings, cur)
        timings["switched_ms"] = (time.perf_counter() - t0) * 1e3
        state["current"] = target
        timings["total_ms"] = (time.perf_counter() - t0) * 1e3
        state["history"] = (state["history"] + [{"action": "rollback", "from": cur, "to": target, "time": timestamp(),
                                                 "by": by, "ms": round(timings["total_ms"], 1)}])[-HISTORY_MAX:]
        with after_commit(repo_dir, target, f"rolled back to {target}", server):
            commit_switch(repo_dir, state, server, target, cur)  # commit point
            timings["removed"] = retain(repo_dir, state, server, False, None)
            write_state(repo_dir, state)
    timings["unit"] = target
    return timings


def list_releases(repo_dir: Path) -> dict:
    """releases.json plus what is on disk (for `invoke releases`). UserError (``--repo``, exit 2) when
    ``repo_dir`` does not exist or is no serving repository (no releases.json beside it: ``/``, a build
    output's model_repository)."""
    repo_dir = Path(repo_dir)
    fix = "pass the serving repository that `invoke promote` created (default artifacts/serving/model_repository)."
    if not repo_dir.is_dir():
        raise UserError("--repo", f"{repo_dir} {'is a file, not a folder' if repo_dir.exists() else 'does not exist'}.", fix)
    state = read_state(repo_dir)
    if state is None:
        raise UserError("--repo", f"{repo_dir} is not a serving repository: there is no {state_path(repo_dir)} "
                        "beside it.", fix)
    on_disk = sorted(p.name for p in repo_dir.iterdir() if is_any_unit(p.name))
    configs = current_of_configs(repo_dir)
    return {"state": state, "on_disk": on_disk, "configs": configs,
            "problems": _disagreements(repo_dir, state, on_disk, configs)}


def _disagreements(repo_dir: Path, state: dict, on_disk: list[str], configs: tuple) -> list[str]:
    """What ``list_releases`` shows disagreeing with releases.json (hostile s15 T8, T120, s15b F14: `invoke releases`
    said nothing of a split after a kill between the ensemble and the BLS switch, a hand-edited route.json, or a
    deleted current unit), each with the command that repairs it; [] when the files agree. While a rollout is in
    progress the BLS's route is the rollout's, not compared. The live server is not asked (no --url here)."""
    cur, out = state.get("current"), []
    if not cur:
        return out
    try:  # hostile s17b F9: a copy listed nothing while serve and the commands refuse it
        release_live.refuse_copied_repository(repo_dir, "")
    except UserError as e:
        out.append(f"{e.problems[0].reason.rstrip('; ')}: every release command and `invoke serve` refuse it; "
                   f"{e.problems[0].fix}")
    fix = f"`invoke rollback --repo {repo_dir} --to {cur}` (add --url when a server serves it) puts everything back on it"
    if cur not in on_disk:
        out.append(f"the current release {cur} is missing from {repo_dir}: promote its build again (that reinstalls it), "
                   "or roll back to another release")
    for unit in [cur] + sorted({r.get("unit") for r in state.get("releases", []) if r.get("unit") not in (cur, None)}):
        if unit in on_disk and (why := unit_damage(repo_dir, unit, state) or edited_since_install(repo_dir, unit, state)):
            # sizes, and the files written after the install hashed (hostile s15c T111, s16 T32, s17b F7)
            out.append(f"{'the current release' if unit == cur else 'the kept release'} {unit} is damaged on disk "
                       f"({unit}/{why} at its install): "
                       + ("roll back to another release (the server keeps serving what it loaded until then), then "
                          "promote its build again: a verified copy replaces the folder (without a server, that promote "
                          "alone replaces it)" if unit == cur else
                          "promote its build again (a verified copy replaces it); a rollback to it is refused until then"))
    unrecorded = [u for u in [cur] + sorted({r.get("unit") for r in state.get("releases", [])} - {cur, None})
                  if u in on_disk and u not in (state.get("unit_files") or {})]
    for unit in unrecorded:  # hostile s17b F11: a row deleted by hand made every check of the unit pass unread
        out.append(f"{unit} has no install record in releases.json (unit_files; deleted by hand, or installed before "
                   "the record existed): its files cannot be verified before it serves; promote its build again to "
                   "record it (a verified copy)")
    fb = state.get("fallback")
    if fb and fb != cur and fb not in on_disk:  # hostile s17 F14: listed nothing
        out.append(f"the fallback {fb} is missing from {repo_dir} (deleted or moved): `rollback --fallback` is refused "
                   "until its folder is restored there")
    if out and out[0].startswith(f"the current release {cur} "):  # never "put everything back on" a broken unit (s16b T9)
        fix = "repair the current release first (above); a rollback to another release also re-points everything"
    gone = [m for m in ("ensemble", "tensorrt_llm_bls") if not (repo_dir / m / "config.pbtxt").is_file()]
    for m in gone:  # hostile s17b F6: "calls None (an interrupted change)", and the rollback it named was refused
        out.append(f"{repo_dir / m / 'config.pbtxt'} is missing (deleted or moved): every release command refuses until "
                   f"it is restored: from a backup, or copy {m}/config.pbtxt from a build's packed repository "
                   f"(`<build out>/model_repository/{m}/config.pbtxt`), then `invoke rollback --repo {repo_dir} --to "
                   f"{cur}` re-points it")
    for m, why in entry_model_problems(repo_dir).items():  # hostile s17c F7: listed nothing, rollback exited 0
        if m not in gone:
            out.append(f"{why}: the server cannot load {m} from this repository (a restarted server, or serve's "
                       "watchdog after its instance died); every request through it fails then")
    if state.get("rollout"):
        return out + [w for w in [stalled_rollout(state, repo_dir)] if w]
    if gone:
        return out
    if ensemble_serves(cur) and configs[0] != cur:
        out.append(f"the ensemble's config calls {configs[0]}, releases.json records {cur} (an interrupted change): {fix}")
    try:
        route = read_json(repo_dir / "tensorrt_llm_bls" / ROUTE_FILE, {}) or {}
    except (ValueError, OSError):  # hand-edited, or not a regular file (a FIFO: hostile s16 H13)
        route = {"unreadable": True}
    if configs[1] != cur or route != {"tensorrt_llm_model_name": cur}:
        out.append(f"the BLS config or route.json ({json.dumps(route, sort_keys=True)[:120]}) does not send every request "
                   f"to {cur}, which releases.json records (an interrupted change or a hand edit): {fix}")
    return out
