"""The switch of a release (ensemble and BLS re-pointed, the ensemble reloaded -- or unloaded when an LLM-API unit
becomes current; put back on a failure) and retention (what stays loaded, what stays on disk: ``keep_releases``, the
fallback, never a rejected candidate; engine and LLM-API units alike)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

from precision_pipeline.serving.release_configs import point_bls, point_ensemble
from precision_pipeline.serving.release_live import loaded_models
from precision_pipeline.serving.release_state import (crash_point, current_order, ensemble_serves, rejected_units, state_path,
                                                      write_state)
from precision_pipeline.serving.release_units import is_any_unit, remove_dir


def switch(repo_dir: Path, server, unit: str, timings: dict, previous: str) -> None:
    """Point ensemble and BLS at ``unit`` and reload them; on a failure put both back as they were."""
    try:
        _switch_to(repo_dir, server, unit, timings)
    except BaseException:
        point_ensemble(repo_dir, previous)
        point_bls(repo_dir, previous)
        if server is not None:
            with contextlib.suppress(Exception):
                ensemble_follow(server, previous)
        raise


def commit_switch(repo_dir: Path, state: dict, server, unit: str, previous: str) -> None:
    """The commit point of a switch to ``unit`` (``write_state`` of ``state``, which names it current). When
    releases.json cannot be written (a full disk, a file-size limit: OSError), the switch is undone -- ensemble and BLS
    back on ``previous`` and reloaded (``switch``) -- and ``NotCommitted`` (exit 2) says what holds: the live server
    and the files on ``previous``, as releases.json still records (hostile s16b F4: they stayed on ``unit`` and the
    message said the repository was intact)."""
    from precision_pipeline.core.errors import NotCommitted

    try:
        write_state(repo_dir, state)
    except OSError as e:
        why = f"{e.strerror or e}: {e.filename or state_path(repo_dir)}"
        try:
            switch(repo_dir, server, previous, {}, unit)
            back = f"the switch was undone: {previous} serves again, as releases.json still records"
        except BaseException as undo:  # noqa: BLE001  (said; the recovery of the next command repairs it)
            back = (f"undoing the switch failed too ({type(undo).__name__}: {str(undo)[:200]}): the files or the server may "
                    f"still be on {unit}, while releases.json records {previous}; the next release command (or `invoke "
                    "serve`'s watchdog) puts them back once files can be written")
        raise NotCommitted(f"releases.json could not be written ({why}), so the switch to {unit} was not committed; "
                            f"{back}. Fix: {_write_fix(e)}, then run the command again.") from None


def _write_fix(e: OSError) -> str:
    """The fix for a releases.json write that failed with ``e`` (by errno; hostile s17b F10: EPERM said "free space")."""
    import errno

    if e.errno in (errno.EPERM, errno.EACCES, errno.EROFS):
        return ("make releases.json and its folder writable for this user (`ls -l`, `lsattr`: chmod, chattr -i, a "
                "read-only mount)")
    if e.errno == errno.EFBIG:
        return "raise the file-size limit (`ulimit -f`)"
    return "free space on that file system (or raise the file-size limit)"


def ensemble_follow(server, unit: str) -> None:
    """The live ensemble follows the current release ``unit`` (its config already points at it): reloaded for an
    engine unit; unloaded for an LLM-API unit, which it cannot call (``ensemble_serves``): an ensemble request then
    fails as "not ready" instead of being answered by an earlier release."""
    if ensemble_serves(unit):
        server.load("ensemble")
    elif loaded_models(server).get("ensemble") == "READY":
        server.unload("ensemble")


def _switch_to(repo_dir: Path, server, unit: str, timings: dict) -> None:
    engine = ensemble_serves(unit)
    point_ensemble(repo_dir, unit)
    crash_point("ensemble_config")
    if server is not None and engine:
        t = time.perf_counter()
        server.load("ensemble")
        timings["ensemble_load_ms"] = (time.perf_counter() - t) * 1e3
    crash_point("switch")
    point_bls(repo_dir, unit)  # the running BLS follows route.json from its next request
    crash_point("bls_config")
    if server is not None and not engine:  # after the BLS moved: the ensemble served the previous release until now
        t = time.perf_counter()
        ensemble_follow(server, unit)
        timings["ensemble_unload_ms"] = (time.perf_counter() - t) * 1e3


def retain(repo_dir: Path, state: dict, server, warm_previous: bool, previous: str | None) -> list[str]:
    """Unload units that need not stay loaded; delete units beyond keep_releases (fallback kept) and their records in
    ``state`` (a kept unit's records stay while its folder is gone).
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
    loaded = loaded_models(server)
    for name, st in loaded.items():
        if is_any_unit(name) and st == "READY" and name not in warm:
            with contextlib.suppress(Exception):
                server.unload(name)
    for p in sorted(Path(repo_dir).iterdir()):
        if is_any_unit(p.name) and p.name not in keep_disk:
            if server is not None and loaded.get(p.name) == "READY":
                with contextlib.suppress(Exception):
                    server.unload(p.name)
            remove_dir(p)
            removed.append(p.name)
    # the records of removed units go; a kept unit whose folder is gone now (moved aside by hand) keeps its release
    # row and install record: put back, it is verified against them (hostile s18b W01/W02: both were deleted, and the
    # folder put back with a byte flipped became current, "not verified")
    state["releases"] = [r for r in state["releases"] if (Path(repo_dir) / r["unit"]).is_dir() or r["unit"] in keep_disk]
    if "unit_files" in state:
        state["unit_files"] = {u: r for u, r in state["unit_files"].items()
                               if (Path(repo_dir) / u).is_dir() or u in keep_disk}
    return removed
