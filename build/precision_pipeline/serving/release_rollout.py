"""Gradual rollout primitives on releases.json and route.json: begin (candidate loaded beside the stable release),
set a step's share, finish (the candidate becomes current), abort. The orchestration -- steps, checks,
metrics -- is serving/rollout.py."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, Iterable

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving.release_configs import point_bls, point_ensemble, set_canary
from precision_pipeline.serving.release_live import (live_unit, load_unit, loaded_models, routed_units, smoke_unit,
                                                     unload_quietly, verify_server)
from precision_pipeline.serving.release_recover import state_or_refuse
from precision_pipeline.serving.release_state import (HISTORY_MAX, after_commit, crash_point, lock, make_current, process_start, read_state,
                                                      timestamp, write_state)
from precision_pipeline.serving.release_switch import commit_switch, retain, switch
from precision_pipeline.serving.release_units import install_release_unit


ROLLOUT_STEPS = ("rollout_load", "rollout_begin", "rollout_route", "rollout_switch", "rollout_abort_route")
"""Crash points of a rollout: after the candidate is loaded and smoke-tested, after releases.json
records the rollout, after a step's route.json is written, after the 100 % switch (before its commit),
after an abort's route.json. At each, ``recover()`` leaves the stable release serving every request."""


def begin_rollout(repo_dir: Path, engine_unit: Path, *, server=None, profile: str = "", gate: dict | None = None,
                  steps: Iterable[int] = (), by: str = "rollout", smoke: bool = True, serve_root: str | None = None) -> dict:
    """Install and load the candidate unit beside the current (stable) one and smoke-test it; record
    ``rollout`` = {candidate, profile, gate, steps, step, percent: 0, started, by} in releases.json.
    No request is routed to it yet (``set_rollout_percent``). Returns the rollout record (+ timings).
    Raises UserError when a rollout is already in progress or the candidate is current."""
    repo_dir = Path(repo_dir)
    timings: dict[str, Any] = {}
    with lock(repo_dir):
        state = state_or_refuse(repo_dir, "no releases.json: this is not a serving repository.",
                                 "create it with `invoke promote --profile P` first (the first promote creates it).", server=server)
        if state.get("rollout"):
            raise UserError("rollout", f"a rollout of {state['rollout']['candidate']} is already in progress.",
                            "end it with `invoke rollout --abort` first.")
        unit = install_release_unit(repo_dir, engine_unit, serve_root, state, server)
        if unit == state["current"]:
            raise UserError("--profile", f"{unit} is already the current release.", "nothing to roll out.")
        if server is not None:
            try:  # a refusal, Ctrl-C or SIGTERM before the rollout is recorded: the candidate is unloaded (s8 #59)
                t = time.perf_counter()
                load_unit(server, unit, "--out", state["current"], "rebuild the output (`invoke build`), then roll it out again.")
                timings["load_ms"] = (time.perf_counter() - t) * 1e3
                if smoke:
                    timings["smoke"] = smoke_unit(server, unit, "--out", state["current"],
                                                   "rebuild the output (`invoke build`), then roll it out again.")
            except BaseException:
                if not (unit == state.get("fallback") and state.get("warm_fallback")):  # a warm fallback stays loaded
                    unload_quietly(server, unit)
                raise
        crash_point("rollout_load")
        state["rollout"] = {"candidate": unit, "stable": state["current"], "profile": profile, "gate": gate or {},
                            "steps": [int(x) for x in steps], "step": None, "percent": 0, "started": timestamp(), "by": by,
                            "pid": os.getpid(), "pid_start": process_start(os.getpid()), "checks": []}
        write_state(repo_dir, state)
        crash_point("rollout_begin")
    return {**state["rollout"], "timings": timings}


def set_rollout_percent(repo_dir: Path, percent: int, checks: dict | None = None) -> dict:
    """Route ``percent`` (1..99) of the BLS's requests to the candidate; releases.json first (the step
    and the previous step's check numbers ``checks``), then route.json."""
    repo_dir = Path(repo_dir)
    with lock(repo_dir):
        state = read_state(repo_dir) or {}
        ro = state.get("rollout")
        if not ro:
            raise UserError("rollout", "no rollout is in progress.", "start one with `invoke rollout --profile P`.")
        ro["step"], ro["percent"] = int(percent), int(percent)
        if checks:
            ro["checks"] = (ro.get("checks", []) + [checks])[-50:]
        write_state(repo_dir, state)
        set_canary(repo_dir, state["current"], ro["candidate"], percent)
        crash_point("rollout_route")
    return ro


def finish_rollout(repo_dir: Path, *, server=None, checks: dict | None = None, warm_previous: bool = False) -> dict:
    """The 100 % step: the candidate becomes the current release (ensemble and BLS re-pointed, the
    ensemble reloaded, releases.json committed with history action ``rollout``), as ``promote`` does
    after its smoke test. Returns timings in ms."""
    repo_dir = Path(repo_dir)
    t0 = time.perf_counter()
    timings: dict[str, Any] = {}
    with lock(repo_dir):
        state = read_state(repo_dir) or {}
        ro = state.get("rollout")
        if not ro:
            raise UserError("rollout", "no rollout is in progress.", "start one with `invoke rollout --profile P`.")
        previous, unit = state["current"], ro["candidate"]
        switch(repo_dir, server, unit, timings, previous)
        crash_point("rollout_switch")
        timings["switched_ms"] = (time.perf_counter() - t0) * 1e3
        ro.pop("checks", None)
        state.pop("rollout")
        make_current(repo_dir, state, unit, ro.get("profile", ""), ro.get("gate"), ro.get("by", "rollout"))
        state["history"] = (state["history"] + [{"action": "rollout", "from": previous, "to": unit, "time": timestamp(),
                                                 "by": ro.get("by", "rollout"), "ms": round(timings["switched_ms"], 1),
                                                 "rollout": {"steps": ro.get("steps"), "started": ro.get("started"),
                                                             "checks": checks or {}}}])[-HISTORY_MAX:]
        with after_commit(repo_dir, unit, f"rolled out {unit} (100 %)", server):
            commit_switch(repo_dir, state, server, unit, previous)  # commit point
            timings["removed"] = retain(repo_dir, state, server, warm_previous, previous)
            write_state(repo_dir, state)
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
    with lock(repo_dir):
        if verify:
            verify_server(repo_dir, server)
        state = read_state(repo_dir) or {}
        ro = state.get("rollout")
        if not ro:  # a crashed promote or rollback is still put back first: the live server serves the record (hostile s15 F1)
            if state.get("current"):
                state_or_refuse(repo_dir, "no releases.json.", "init the serving repository first.", server=server)
            raise UserError("--abort", "no rollout is in progress.", "`invoke releases` shows the current release.")
        cur, unit = state["current"], ro["candidate"]
        point_bls(repo_dir, cur)
        route_ms = (time.perf_counter() - t0) * 1e3
        crash_point("rollout_abort_route")
        point_ensemble(repo_dir, cur)
        extra: dict[str, Any] = {}
        try:
            if server is not None and live_unit(server) not in (None, cur):
                if loaded_models(server).get(cur) != "READY":
                    server.load(cur)
                server.load("ensemble")
                extra["ensemble_reloaded"] = True
            drain = dict(drained(unit) or {}) if drained is not None else {}
        except (OSError, RuntimeError, ValueError) as e:  # the server died or refused: the files are right; say what was not done
            drain, extra["server_error"] = {}, f"{type(e).__name__}: {str(e)[:300]}"
        if server is not None and "server_error" not in extra:
            routed = routed_units(repo_dir, server)
            if unit in routed:
                extra["candidate_kept"] = "the live ensemble or route.json still routes to it"
            elif loaded_models(server).get(unit) == "READY" and unit != state.get("fallback"):
                with contextlib.suppress(Exception):
                    server.unload(unit)
        rec = {"candidate": unit, "stable": cur, "step": ro.get("step"), "percent": ro.get("percent"),
               "steps": ro.get("steps"), "started": ro.get("started"), "failed_check": failed_check,
               "numbers": numbers or {}, "route_ms": round(route_ms, 2), **drain, **extra,
               "checks": ro.get("checks", [])}
        state.pop("rollout")
        state["history"] = (state["history"] + [{"action": "rollout_abort", "from": unit, "to": cur, "time": timestamp(),
                                                 "by": by, "ms": round((time.perf_counter() - t0) * 1e3, 1),
                                                 "rollout": rec}])[-HISTORY_MAX:]
        write_state(repo_dir, state)
    return rec
