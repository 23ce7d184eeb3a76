"""The release record of a serving repository: ``releases.json``, its atomic writes, its lock, crash hooks.

See serving/release.py for the layout and the rules (commit point, ``releases.json.prev``, history ``MOVES``)."""

from __future__ import annotations

import contextlib
import contextvars
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, ValidationError

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import atomic_write_json, locked, read_json
from precision_pipeline.serving import llmapi_unit, pack


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


UNIT_NAME_PATTERN = r"(?:tensorrt_llm|llm_api)_[0-9a-f]{12}"
"""The name of a unit a release serves (the one pattern releases.json's unit fields must match): an engine unit
``tensorrt_llm_<h12>`` (serving/pack.py ``unit_name``: ``UNIT_PREFIX`` + 12 hex digits of its content key) or an
LLM-API unit ``llm_api_<h12>`` (serving/llmapi_unit.py, issue 28: the same 12 hex digits of its content key).
Never a fixed model (``preprocessing``, ``ensemble``, ...): pointed at one, the ensemble would call it twice."""
Unit = Annotated[str, StringConstraints(pattern=f"^{UNIT_NAME_PATTERN}$")]
ACTIONS = (*MOVES, "rollout_abort", "probe")
"""History actions: ``MOVES``, a rollout rolled back (``rollout_abort``) and a probe result (``probe``)."""


FileRow = Annotated[tuple[Annotated[int, Field(ge=0)], Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]],
                   BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)]
"""A row of ``unit_files``: [size in bytes, sha256 hex] (serving/release_units.py ``installed_record``)."""


class _Record(BaseModel):
    # strict types for every field the release code reads; fields it does not read (extras) are kept as written
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class ReleaseEntry(_Record):
    """One row of ``releases``: a release (``kind`` release) or the fallback's record. ``serving_route``: the serving
    route of its unit (``engine``: an engine unit; ``llm_api``: an LLM-API unit; absent in files written before issue 28:
    ``engine``); ``provenance``: what it was built from (``release_record``)."""

    unit: Unit
    kind: Literal["release", "fallback"] = "release"
    serving_route: Literal["engine", "llm_api"] = "engine"
    provenance: dict[str, Any] = {}
    profile: str = ""
    gate: dict[str, Any] = {}
    engine_hash: str = ""
    time: str = ""
    promoted_by: str = ""
    engine_present: bool = False


class RolloutEnded(_Record):
    """A history entry's ``rollout``: a finished rollout's steps, or an aborted one's step and failed check."""

    candidate: Optional[Unit] = None
    stable: Optional[Unit] = None
    percent: Optional[int] = None
    step: Optional[int] = None
    failed_check: Optional[str] = None
    steps: Optional[list[int]] = None


class HistoryEntry(_Record):
    """One row of ``history`` (``from``/``to``: the unit current before / after; both empty for a probe)."""

    action: Literal[ACTIONS]  # type: ignore[valid-type]
    from_: Optional[Unit] = Field(None, alias="from")
    to: Optional[Unit] = None
    unit: Optional[Unit] = None
    time: str = ""
    by: str = ""
    ms: float = 0.0
    rollout: Optional[RolloutEnded] = None


class RolloutInProgress(_Record):
    """``rollout``: the rollout in progress (serving/release_rollout.py ``begin_rollout``)."""

    candidate: Unit
    stable: Unit
    percent: int = Field(0, ge=0, le=100)
    step: Optional[int] = None
    steps: list[int] = []
    pid: Optional[int] = None
    pid_start: Optional[int] = None
    checks: list[dict[str, Any]] = []
    profile: str = ""
    gate: dict[str, Any] = {}
    started: str = ""
    by: str = ""


class ReleasesFile(_Record):
    """releases.json (the layout: serving/release.py). ``read_state`` validates every read against it."""

    version: int = 1
    current: Unit
    fallback: Optional[Unit] = None
    warm_fallback: bool = False
    keep_releases: int = Field(2, ge=0, le=100)
    repository_id: Optional[str] = None
    repository_folder: Optional[str] = None
    releases: list[ReleaseEntry] = []
    history: list[HistoryEntry] = []
    rollout: Optional[RolloutInProgress] = None
    unit_files: dict[Unit, dict[str, FileRow]] = {}


def _field_of(err: dict) -> str:
    out = ""
    for part in err.get("loc", ()):
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(the whole file)"


def check_state(path: Path, state: Any) -> dict:
    """``state`` (releases.json as parsed) if it is a releases record (``ReleasesFile``); else the UserError of a
    damaged file (``_damaged``) naming the first wrong field, what it holds and what it must hold."""
    if not isinstance(state, dict):
        raise _damaged(path, "is not a releases record (an object with current, releases and history)")
    try:
        ReleasesFile.model_validate(state)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        err = errs[0]
        more = f" (and {len(errs) - 1} more problem(s))" if len(errs) > 1 else ""
        got = repr(err.get("input"))[:80]
        hint = (" -- a unit name is tensorrt_llm_ or llm_api_ and 12 hex digits"
                if (err.get("ctx") or {}).get("pattern") == f"^{UNIT_NAME_PATTERN}$" else "")
        raise _damaged(path, f"field {_field_of(err)}: {err.get('msg')} (got {got}){hint}{more}") from None
    return state


def crash_point(step: str) -> None:
    if os.environ.get(CRASH_ENV) == step:
        os._exit(CRASH_EXIT)


def state_path(repo_dir: Path) -> Path:
    return Path(repo_dir).resolve().parent / STATE_FILE


def read_state(repo_dir: Path) -> dict | None:
    """releases.json beside ``repo_dir`` (None when there is none), validated (``ReleasesFile``: every field the
    release code reads has its type, every unit field a unit name). Raises UserError (exit 2) naming the file,
    the field and the fix when it is not a releases record (truncated, edited); nothing is written then."""
    path = state_path(repo_dir)
    try:
        state = read_json(path)
    except ValueError as e:  # invalid JSON or UTF-8
        raise _damaged(path, f"cannot be parsed ({str(e)[:120]})") from None
    except OSError as e:  # a folder, unreadable (hostile s8 #128: IsADirectoryError, exit 1)
        raise _damaged(path, f"cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    if state is None:
        prev = path.with_name(path.name + PREV_SUFFIX)
        if prev.is_file() and (Path(repo_dir) / "ensemble").is_dir():  # hostile s18 F2: deleted; three fixes, none worked
            fix = _damaged(path, "").problems[0].fix
            raise UserError(str(path), f"is missing beside the serving repository {repo_dir}, while {prev} is there "
                            "(it was deleted or moved), so the current release is unknown; this command changed nothing.",
                            fix)
        return None
    return _check_owner(Path(repo_dir), path, check_state(path, state))


def _check_owner(repo_dir: Path, path: Path, state: dict) -> dict:
    """``state`` when releases.json is ``repo_dir``'s own record; else UserError on ``--repo`` (exit 2, nothing
    written; ``_not_owner``'s reason and fix). The one home of "is this ``repo_dir``'s record" (every read goes
    through ``read_state``). releases.json lies beside the repository folder, so another folder in the same parent
    finds it too: a second ``--repo`` beside a served one (hostile s11 F1: a FileNotFoundError traceback) or a copy
    (``cp -a repo repo.bak``, F3: commands on the copy rewrote the original's record and configs). Two facts decide:

    - ``REPO_FOLDER_FIELD`` (the repository's folder name, written with every record since hostile s11): another
      name refuses ``repo_dir``. A record without it (written before) is adopted by its next write
      (``write_state``), unless another folder beside it carries the same id (a copy: which one owns the record
      would be a guess).
    - ``repository_id`` (written at init into the ensemble's ``IDENTITY_PARAM``): ``repo_dir``'s ensemble must carry
      it. Not checked while a swap of ``repo_dir`` is unfinished (its journal ``.<name>.swap.json`` beside it:
      recovery rolls it forward), nor for a ``repo_dir`` without its ensemble config (the commands name the
      missing file)."""
    repo_dir = Path(repo_dir).resolve()
    rid, folder = state.get("repository_id"), state.get(REPO_FOLDER_FIELD)
    have = _identity(repo_dir)
    if folder is not None and folder != repo_dir.name:
        raise _not_owner(repo_dir, path, rid, have, folder)
    if not rid or (repo_dir.parent / f".{repo_dir.name}.swap.json").exists():
        return state
    if repo_dir.exists() and have is None:
        return state  # a damaged repository: the commands' own checks name the missing or unreadable config
    if have != rid:
        raise _not_owner(repo_dir, path, rid, have, None)
    if folder is None:  # a record from before REPO_FOLDER_FIELD: a copy beside it makes its owner a guess
        twins = sorted(p.name for p in repo_dir.parent.iterdir() if p.name != repo_dir.name and _identity(p) == rid)
        if twins:
            raise _not_owner(repo_dir, path, rid, have, None, twins)
    return state


REPO_FOLDER_FIELD = "repository_folder"
"""releases.json's field naming the folder (beside it) of the repository it records: ``write_state`` writes it."""


def _identity(repo_dir: Path) -> str | None:
    """The ``IDENTITY_PARAM`` of ``repo_dir``'s ensemble config (read with pack's config parser); None when the
    folder or its config is missing, unreadable or carries none."""
    ens = Path(repo_dir) / "ensemble" / "config.pbtxt"
    try:
        return pack.config_params(pack.parse_model_config(ens.read_text(), str(ens))).get(IDENTITY_PARAM) \
            if ens.is_file() else None
    except (OSError, UnicodeDecodeError, UserError):
        return None


def _not_owner(repo_dir: Path, path: Path, rid, have, folder: str | None, twins: list[str] | None = None) -> UserError:
    """``_check_owner``'s refusal: ``path`` is not ``repo_dir``'s record (it records ``folder``, another id, or its
    owner is ambiguous between ``repo_dir`` and ``twins``), with the fix of each case."""
    owner = repo_dir.parent / (folder or "")
    own = ("one folder holds one serving repository and its releases.json, named in its "
           f"{REPO_FOLDER_FIELD}; nothing was changed.")
    new = (f"give a new repository a folder of its own (e.g. "
           f"{repo_dir.parent / (repo_dir.name + '-repo') / repo_dir.name}); a copy (`cp -a`) is a backup, not a "
           "repository: put it back in place of the original to restore it.")
    if twins:
        return UserError("--repo", f"{path} (written before records named their folder) records the serving repository "
                         f"{rid}, and {', '.join(twins)} beside {repo_dir.name} carries the same id (a copy): which "
                         "folder this record belongs to would be a guess; nothing was changed.",
                         f'add "{REPO_FOLDER_FIELD}": "<the original\'s folder name>" to {path}, or move the copy out '
                         "of this folder.")
    what = ("does not exist" if not repo_dir.exists() else f"is a copy of it (the same id {rid})" if have == rid
            else f"is another repository (its id {have or 'none'}, the record's {rid})")
    if folder is None:
        return UserError("--repo", f"{path} beside {repo_dir} records the serving repository {rid}, and {repo_dir} "
                         f"{what}: {own}", f"{new} Or pass the --repo that this releases.json belongs to.")
    if owner.is_dir() or not repo_dir.exists() or have != rid:
        return UserError("--repo", f"{path} is the record of {owner}, and {repo_dir} {what}: {own}",
                         f"pass --repo {owner}; {new}")
    return UserError("--repo", f"{path} is the record of {owner}, which does not exist, and {repo_dir} carries its id "
                     f"{rid} (renamed or moved?): {own}",
                     f"rename it back (`mv {repo_dir} {owner}`): its configs name that folder (the engine paths, "
                     "tokenizer_dir), so a serving repository keeps its folder name; for a new name, promote into a "
                     "new folder.")


def _not_a_file(path: Path) -> str | None:
    """What stands at ``path`` when it is no regular file (``folder``, ``FIFO``, ...; a link is followed), else None."""
    import stat as stat_mod

    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat_mod.S_ISREG(mode):
        return None
    return next((w for t, w in ((stat_mod.S_ISDIR, "a folder"), (stat_mod.S_ISFIFO, "a FIFO (named pipe)"),
                                (stat_mod.S_ISSOCK, "a socket")) if t(mode)), "a device")


def _damaged(path: Path, why: str) -> UserError:
    prev = path.with_name(path.name + PREV_SUFFIX)
    try:
        ok = isinstance(read_json(prev), dict)
    except (ValueError, OSError):
        ok = False
    if what := _not_a_file(path):  # hostile s17 F2: `cp prev path` hung on a FIFO and copied into a folder
        remove = f"`rmdir {path}` (or move it away)" if what == "a folder" else f"`rm {path}`"
        fix = (f"remove it ({remove}), then restore the state before the last change: `cp {prev} {path}`." if ok else
               f"remove it ({remove}), then restore {path} from a backup.")
        return UserError(str(path), f"is {what}, not a file, so the current release is unknown; this command changed "
                         "nothing.", fix)
    fix = (f"{prev} holds the state before the last change: check it (`cat {prev}`) and restore it with "
           f"`cp {prev} {path}` (a release that only the lost change recorded is then not kept), or restore "
           f"{path} from a backup." if ok else f"restore {path} from a backup.")
    return UserError(str(path), f"{why}: it is damaged (truncated or edited), so the current release is unknown; "
                     "this command changed nothing and does not overwrite it.", fix)


def write_state(repo_dir: Path, state: dict) -> None:
    """Write releases.json atomically (the commit point), keeping the replaced file as releases.json.prev. Names
    ``repo_dir``'s folder in ``REPO_FOLDER_FIELD`` (a record from before the field adopts it here)."""
    path = state_path(repo_dir)
    state[REPO_FOLDER_FIELD] = Path(repo_dir).resolve().name
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


@contextlib.contextmanager
def after_commit(repo_dir: Path, unit: str, done: str, server=None):
    """Around a change's commit point (``write_state``) and what follows it (retention, the second write): a signal
    there (KeyboardInterrupt: Ctrl-C, or SIGTERM/SIGHUP under ``terminate_as_interrupt``) once releases.json names
    ``unit`` current raises ``InterruptedAfterCommit`` (exit 130) saying ``done`` (e.g. "rolled back to X") took
    effect; before the commit it stays the plain interrupt (nothing took effect: recovery puts the configs back)."""
    from precision_pipeline.core.errors import InterruptedAfterCommit

    try:
        yield
    except KeyboardInterrupt:
        try:
            committed = (read_json(state_path(repo_dir)) or {}).get("current") == unit
        except (OSError, ValueError):
            committed = False
        if not committed:
            raise
        live = " and the server serves it" if server is not None else ""
        raise InterruptedAfterCommit(
            f"{done}, interrupted after the switch: releases.json records {unit} as the current release{live}. "
            "Releases no longer kept may still be on disk; the next promote or rollback removes them.") from None


_RECOVERED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("recovered", default=None)


@contextlib.contextmanager
def lock(repo_dir: Path, timeout_s: float | None = 600):
    """Hold the releases lock of ``repo_dir`` (``LOCK_FILE`` beside it: ``core.store.locked``). What a recovery did
    while it was held (``note_recovered``) is attached to a ``UserError`` raised inside it (``UserError.done``), so a
    refusal after a recovery does not say "nothing was changed" (hostile s15 F1: a promote of the current release
    re-pointed the live BLS, then said it changed nothing); a command that goes on prints them on stderr when it
    releases the lock (``[release] recovered first: ...``)."""
    notes: list[str] = []
    token = _RECOVERED.set(notes)
    try:
        with locked(Path(repo_dir).resolve().parent / LOCK_FILE, timeout_s, what=_command_line(),
                    on_wait=lambda m: print(m, file=sys.stderr, flush=True)):  # never a silent wait (hostile s15c T106)
            yield
    except UserError as e:
        if notes:
            e.done = (*e.done, *notes)
        raise
    else:  # a command that went on after its recovery says what that recovery did (hostile s17b F1: silent)
        for n in notes:
            print(f"[release] recovered first: {n}", file=sys.stderr, flush=True)
    finally:
        _RECOVERED.reset(token)


def _command_line() -> str:
    """This process's command line, short (``invoke rollback --repo R ...``): what the releases lock's sidecar names."""
    argv = [Path(sys.argv[0]).name if sys.argv else "?", *sys.argv[1:]]
    text = " ".join(argv)
    return text if len(text) <= 120 else text[:117] + "..."


def note_recovered(fixed: list[str]) -> list[str]:
    """Record ``fixed`` (what a recovery did) on the releases lock held now (``lock``); returns ``fixed``."""
    notes = _RECOVERED.get()
    if notes is not None:
        notes.extend(f for f in fixed if f not in notes)
    return fixed


def require_state(repo_dir: Path, reason: str, fix: str) -> dict:
    """releases.json beside ``repo_dir``; UserError on its path with ``reason`` / ``fix`` when there is none."""
    state = read_state(repo_dir)
    if not state:
        raise UserError(str(state_path(repo_dir)), reason, fix)
    return state


def serving_models(repo_dir: Path, state: dict) -> list[str]:
    """Models to load for ``state``: pre/post, current unit, warm fallback, then ensemble and BLS."""
    units = [state["current"]]
    fb = state.get("fallback")
    if fb and state.get("warm_fallback") and fb not in units and (Path(repo_dir) / fb).is_dir():
        units.append(fb)
    ensemble = ["ensemble"] if ensemble_serves(state["current"]) else []
    return ["preprocessing", "postprocessing", *units, *ensemble, "tensorrt_llm_bls"]


def serving_route_of(unit: str) -> str:
    """The serving route of a release's unit: ``llm_api`` for an LLM-API unit (``llm_api_<h12>``), else ``engine``."""
    return llmapi_unit.ROUTE if llmapi_unit.is_llm_api_unit(str(unit)) else "engine"


def ensemble_serves(unit: str) -> bool:
    """Whether the ensemble can serve ``unit`` as the current release: only an engine unit. The ensemble chains token
    tensors (preprocessing -> unit -> postprocessing); an LLM-API unit takes text (``text_input``,
    serving/llmapi_contract.py fact 7), so while an LLM-API unit is current the ensemble is not loaded and the BLS
    (``tensorrt_llm_bls``, which calls either kind) is the repository's entry point."""
    return pack.is_unit(str(unit))


def stalled_rollout(state: dict | None, repo_dir: Path) -> str | None:
    """Why the rollout in progress in ``state`` judges nothing although its canary keeps a share of the traffic: its
    process (``rollout.pid``) is gone (killed, crashed: ``recover`` ends such a rollout; until then the files may
    already route to the candidate) or stopped (``T``: SIGSTOP, Ctrl-Z) or a zombie; None otherwise (no rollout, or its
    process runs). Said by ``invoke releases`` and serve's watchdog
    (hostile s17 F8: a stopped rollout kept 50 % on the candidate with no checks, and nothing said so)."""
    from precision_pipeline.core.store import process_state

    ro = (state or {}).get("rollout") or {}
    pid = ro.get("pid")
    if ro and not rollout_alive(ro):  # hostile s17b F4: a crashed rollout's configs may already name the candidate
        return (f"the rollout of {ro.get('candidate')} did not finish: its process (pid {pid}) is gone (killed or "
                "crashed), so the files may route requests to the unjudged candidate; the next release command or "
                f"serve's watchdog ends it (everything back on {ro.get('stable')}), or now: `invoke rollout --abort "
                f"--repo {repo_dir}` (add --url when a server serves it)")
    if not ro or not (st := process_state(pid)).startswith(("T", "t", "Z")):
        return None
    return (f"the rollout of {ro.get('candidate')} is at {ro.get('percent', 0)} % but its process (pid {pid}) is "
            f"{st}: no check runs while the canary keeps that share of the traffic; resume it (kill -CONT {pid}) or "
            f"end it: `invoke rollout --abort --repo {repo_dir}` (add --url when a server serves it)")


def process_start(pid) -> int | None:
    """When process ``pid`` started (``/proc/<pid>/stat`` field 22, starttime in clock ticks since boot), or None when
    it cannot be read: with the pid it names one process, a pid reused by another process afterwards is not it."""
    try:
        return int((Path("/proc") / str(int(pid)) / "stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError, TypeError):
        return None


def rollout_alive(ro: dict) -> bool:
    """Whether the rollout process recorded in ``ro`` (``pid`` and, since hostile s17 PID1, ``pid_start``) still runs:
    its pid alive and, when its start was recorded, the same process (not another one that got the pid since)."""
    pid = ro.get("pid")
    if not pid_alive(pid):
        return False
    return ro.get("pid_start") is None or process_start(pid) in (None, ro["pid_start"])


def pid_alive(pid) -> bool:
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


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def serving_now(state: dict) -> set[str]:
    """Units whose files a server may be reading now: the current release, a rollout's candidate and a warm
    fallback (``install_unit`` never replaces them)."""
    ro = state.get("rollout") or {}
    fb = state.get("fallback") if state.get("warm_fallback") else None
    return {u for u in (state.get("current"), ro.get("candidate"), fb) if u}


def current_order(state: dict) -> list[str]:
    """Units that were the current release, the most recently current first (history ``MOVES``)."""
    order: list[str] = []
    for h in reversed(state.get("history", [])):
        if h.get("action") in MOVES:
            for u in (h.get("to"), h.get("from")):
                if u and u not in order:
                    order.append(u)
    return order


NOT_A_VERDICT = ("manual abort", "interrupted", "error", "server", "counters_reset")
"""``failed_check`` values of a ``rollout_abort`` that judge nothing about a unit that was already a release:
``invoke rollout --abort`` (a hand abort), a signal or a rollout process that died (``interrupted``:
serving/rollout.py, ``recover``), an unexpected exception of the rollout process (``error``) and the server stopping
or freezing during a step (``server``: it may be the candidate's doing, so a candidate that never was a release stays
rejected, but a release that served before keeps its place: hostile s17 RT4, retention deleted it) and a step whose
counters went backwards (``counters_reset``, serving/rollout.py: a model unloaded mid-step). Every other value
is a failed check (``errors``, ``traffic``, ``latency``, ``probe:*``: serving/rollout.py ``_evaluate`` and its
automatic rollback), a verdict on the unit."""


def rejected_units(state: dict) -> dict[str, str]:
    """{unit: why} of units that are no release to roll back to or to keep (the one rule, hostile s8 #61/#62/#72):
    a candidate whose rollout a failed check rolled back (a verdict, ``NOT_A_VERDICT`` aside) and that was not made
    current after it -- an earlier release too -- and a candidate whose rollout ended without a verdict (a hand
    abort, an interrupt, a crash) that was never a release. A release (a unit that a ``MOVES`` entry made current)
    whose later rollout only ended without a verdict stays a release."""
    out: dict[str, str] = {}
    was_release: set[str] = set()
    for h in state.get("history", []):
        if h.get("action") in MOVES:
            out.pop(h.get("to"), None)
            was_release.update(u for u in (h.get("to"), h.get("from")) if u)
        elif h.get("action") == "rollout_abort" and h.get("from"):
            ro = h.get("rollout") or {}
            why = ro.get("failed_check") or "aborted"
            if why not in NOT_A_VERDICT or h["from"] not in was_release:
                out[h["from"]] = f"{why} at {ro.get('percent', '?')} %"
    return out


def release_record(unit_dir: Path, unit: str, profile: str, gate: dict | None, by: str, kind: str,
                   files: dict | None = None) -> dict:
    """One ``releases`` row of the installed unit ``unit_dir``: ``serving_route`` (``serving_route_of``) and
    ``provenance``: an engine unit's ``engine_hash`` (its content key, serving/pack.py); an LLM-API unit's
    ``checkpoint_key`` (sha256 over its ``checkpoint/`` files' [size, sha256] rows in ``files``, the unit's
    ``unit_files`` record), ``config_key`` (sha256 of its 1/model.yaml without the install-dependent ``model`` path)
    and ``runtime`` (the TensorRT-LLM line model.yaml was checked for, ``cpu_reference.json``)."""
    if serving_route_of(unit) == llmapi_unit.ROUTE:
        ref = read_json(unit_dir / pack.CPU_REFERENCE_FILE, {}) or {}
        prov = llm_api_provenance(unit_dir, files or {}, ref)
        ehash, present, route = prov["checkpoint_key"], True, llmapi_unit.ROUTE
    else:
        ref = read_json(unit_dir / "engine" / pack.CPU_REFERENCE_FILE, {}) or {}
        ehash, route = ref.get("engine_hash", unit[len(pack.UNIT_PREFIX):]), "engine"
        present, prov = bool(ref.get("engine_present", False)), {"engine_hash": ehash}
    return {"unit": unit, "engine_hash": ehash, "profile": profile or ref.get("profile", ""), "gate": gate or {},
            "time": timestamp(), "promoted_by": by, "engine_present": present, "kind": kind, "serving_route": route,
            "provenance": prov}


def llm_api_provenance(unit_dir: Path, files: dict, ref: dict) -> dict[str, str]:
    """``release_record``'s provenance of an LLM-API unit (``checkpoint_key``, ``config_key``, ``runtime``)."""
    import yaml

    from precision_pipeline.core.store import hash_obj

    ckpt = {k: list(v) for k, v in sorted(files.items()) if k.startswith(llmapi_unit.CHECKPOINT_DIR + "/")}
    try:
        yml = yaml.safe_load((Path(unit_dir) / llmapi_unit.MODEL_YAML_FILE).read_text()) or {}
    except (OSError, yaml.YAMLError):
        yml = {}
    yml = {k: v for k, v in yml.items() if k != "model"} if isinstance(yml, dict) else {}
    return {"checkpoint_key": hash_obj(ckpt) if ckpt else "", "config_key": hash_obj(yml) if yml else "",
            "runtime": f"tensorrt_llm {ref.get('trtllm_version', '?')}"}


def make_current(repo_dir: Path, state: dict, unit: str, profile: str, gate: dict | None, by: str) -> None:
    """``state``'s current release becomes ``unit`` with a fresh release record (a fallback record of it stays)."""
    state["current"] = unit
    state["releases"] = [r for r in state["releases"] if r["unit"] != unit or r.get("kind") == "fallback"]
    state["releases"].append(release_record(Path(repo_dir) / unit, unit, profile, gate, by, "release",
                                            (state.get("unit_files") or {}).get(unit)))


def rollout_state(repo_dir: Path) -> dict | None:
    """releases.json's ``rollout`` (the rollout in progress) or None."""
    return (read_state(repo_dir) or {}).get("rollout")


PROBE_HISTORY_MAX = 50
"""Probe records kept in ``history`` (the oldest probe records go first; never a release record)."""


def check_probe_unit(unit: str) -> None:
    """UserError (``--unit``, exit 2) unless ``unit`` is a release's unit (``UNIT_NAME_PATTERN``: an engine unit or an
    LLM-API unit): the probe judges one unit, and the release history records units only (never ``ensemble``)."""
    if not re.fullmatch(UNIT_NAME_PATTERN, str(unit)):
        raise UserError("--unit", f"{str(unit)[:80]!r} is not a unit (tensorrt_llm_<h12> or llm_api_<h12>); the probe "
                        "judges one unit.", "pass --unit tensorrt_llm_<h12> or llm_api_<h12> (`invoke releases` lists "
                        "them), or leave it out for the current release.")


def probe_record(unit: str, summary: dict, *, profile: str = "", by: str = "invoke probe") -> dict:
    """The history record of one probe run (``record_probe``)."""
    return {"action": "probe", "from": None, "to": None, "unit": unit, "profile": profile, "time": timestamp(),
            "by": by, "ms": round(float(summary.get("ms", 0.0)), 1), "probe": summary}


def record_probe(repo_dir: Path, unit: str, summary: dict, *, profile: str = "", by: str = "invoke probe") -> dict:
    """Append one accuracy-probe result (serving/probe.py ``ProbeResult.summary()``) to releases.json's
    history as ``{"action": "probe", "from": None, "to": None, "unit", "profile", "time", "by", "ms",
    "probe": summary}`` (``from``/``to`` stay empty: a probe moves no traffic, so rollback and retention
    ignore it). At most ``PROBE_HISTORY_MAX`` probe records stay. Atomic write under the releases lock.
    Raises UserError when ``repo_dir`` has no releases.json or ``unit`` is not a unit (``check_probe_unit``; e.g.
    ``ensemble``). Returns the record."""
    repo_dir = Path(repo_dir)
    check_probe_unit(unit)
    with lock(repo_dir):
        state = require_state(repo_dir, "no releases.json: this is not a serving repository.",
                              "create it with `invoke promote --profile P` first.")
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
        write_state(repo_dir, state)
    return rec
