"""``invoke serve``'s watchdog beside the releases heal (``release_recover.heal``): python-backend instances whose
stub process died or was stopped are reloaded (``revive_dead_instances``), and a read-only repository's disagreements
with releases.json are said (``say_disagreements``). Run every ``triton_server.HEAL_EVERY_S`` seconds by
``triton_server._run_until_stopped``."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from precision_pipeline.core.errors import LoadNotFinished, UserError
from precision_pipeline.core.store import process_state
from precision_pipeline.serving.server_procs import backend_stubs

if TYPE_CHECKING:
    from precision_pipeline.serving.triton_server import TritonServer

REVIVED_PARAM = "precision_pipeline_revived_at"
"""A config parameter (seconds since the epoch) the watchdog's reload of a model adds, so the load is a reload
(``revive_dead_instances``); neither the backends nor the release code read it."""


def reload_model(server, model: str) -> None:
    """Reload ``model`` on ``server`` with new instances: its own config (``model_config``) with ``REVIVED_PARAM`` set
    to the time as the load's ``config`` parameter (a load of unchanged files is a no-op in Triton 2.51; a model not
    loaded gets a plain load of its files). Triton starts
    the new instances before the old ones go, so the model keeps answering if it did. RuntimeError / ServerStopped of
    the load propagate."""
    cfg = server.model_config(model)
    if cfg is None:  # not loaded: a plain load reads its files
        server.load(model)
        return
    cfg.setdefault("parameters", {})[REVIVED_PARAM] = {"string_value": f"{time.time():.3f}"}
    server.load(model, json.dumps(cfg))


ENTRY_POINT_REQUEST_S = 60.0
"""How long ``entry_point_note``'s request through the BLS may wait for its answer (two tokens: ~1 s on the CPU
reference server). A server whose BLS load is pending answered nothing for minutes, and a rollback waited silently
until the user's 300 s timeout (hostile s17c H17)."""

ENTRY_POINT_RELOAD_S = 120.0
"""How long ``entry_point_note``'s reload of the BLS may take before the command gives up (``LoadNotFinished``)."""


def entry_point_note(server, repo: Path, done: str) -> str | None:
    """After a switch on ``server`` serving ``repo`` (``done``: e.g. "rolled back to X"): one short request through the BLS, the entry
    point clients call (the smoke test calls the unit directly, hostile s16 T170: a rollback said "current: X" while
    every BLS request failed on a dead stub), waiting at most ``ENTRY_POINT_REQUEST_S``. When it fails the BLS is
    reloaded once (``reload_model``, at most ``ENTRY_POINT_RELOAD_S``; not when its model.py is missing:
    ``entry_model_file_problem``) and asked again: returns a note saying so, None when it answered at once. Still
    failing: ``PipelineError`` (exit 1) saying the switch took effect, what fails and the fix."""
    from precision_pipeline.core.errors import PipelineError
    from precision_pipeline.serving.infer_request import text_request

    def ask() -> str | None:
        c = server.http_client(connection_timeout=ENTRY_POINT_REQUEST_S, network_timeout=ENTRY_POINT_REQUEST_S)
        try:
            c.infer("tensorrt_llm_bls", text_request("What is 2 + 2?", 2))
            return None
        except Exception as e:  # the server's error for the request (HTTP 500, ...), no answer in time
            return f"{type(e).__name__}: {str(e)[:300] or 'no answer in ' + format(ENTRY_POINT_REQUEST_S, '.0f') + ' s'}"
        finally:
            c.close()

    if (err := ask()) is None:
        return None
    head = f"{done}: releases.json and the server agree, but requests through tensorrt_llm_bls (the entry point) fail"
    if why := entry_model_file_problem(repo, "tensorrt_llm_bls"):
        raise PipelineError(f"{head} ({err}), and it cannot be reloaded: {why}. Fix: restore that file, then restart "
                            f"the server (`invoke serve --repo {repo}`).")
    limit, server.load_timeout_s = server.load_timeout_s, min(server.load_timeout_s, ENTRY_POINT_RELOAD_S)
    try:
        reload_model(server, "tensorrt_llm_bls")
    except LoadNotFinished as e:
        raise PipelineError(f"{head} ({err}), and it could not be reloaded: {e}. Fix: restart the server (`invoke "
                            f"serve --repo {repo}`).") from None
    except (RuntimeError, OSError):
        pass
    finally:
        server.load_timeout_s = limit
    if (again := ask()) is None:
        return f"tensorrt_llm_bls reloaded: a request through it failed after the switch ({err})"
    raise PipelineError(f"{head}, also after reloading it ({again}). Fix: restart the server (`invoke serve --repo "
                        f"{repo}`); its log says why the BLS fails.")


def entry_model_file_problem(repo: Path, model: str) -> str | None:
    """Why ``model`` (one of the repository's python entry models) cannot be loaded from ``repo``
    (``release_units.entry_model_problems``: a file it reads is gone, with where to restore it from); None when its
    files are there or the model is another. Such a load never ends in Triton 2.51 (its stub exits, the load stays
    pending and queues every later load of it: hostile s17c H16/H17), so nothing loads it without this check."""
    from precision_pipeline.serving.release_units import entry_model_problems

    return entry_model_problems(repo, (model,)).get(model)


def _stub_pids(stubs: dict[str, int], model: str) -> set[str]:
    return {str(pid) for n, pid in stubs.items() if n.rsplit("_", 2)[0] == model}


def _say_not_repaired(seen: dict[str, set[str]], model: str, text: str) -> None:
    said = seen.setdefault(f"!said:{model}", set())
    if text not in said:
        said.add(text)
        print(f"[serve] not repaired: {text}", flush=True)


def revive_dead_instances(srv: "TritonServer", seen: dict[str, set[str]]) -> list[str]:
    """Reload every READY model of ``srv`` (started here: ``srv.proc``) one of whose python-backend instances has lost
    its stub process (killed, OOM) or whose stub is stopped (SIGSTOP, state T: hostile s16b F2): Triton 2.51 keeps
    such a model READY and answers every request to it with HTTP 500 "Stub process ... is not healthy" (hostile s16
    H4), and a readiness probe still says 200. ``seen`` ({model:
    instance names}) is this watchdog's memory of the instances it saw alive; a model not READY is forgotten. The
    reload passes the model's own config, with ``REVIVED_PARAM`` set to the time, as the load's ``config`` parameter:
    a load of a loaded model whose files (or override config) did not change is a no-op in Triton 2.51 (measured: the
    dead stub stayed), one with another config reloads it.
    Returns what was reloaded; [] when nothing died. ``ServerStopped`` / RuntimeError of the load propagate."""
    if srv.proc is None:
        return []
    stubs = {n: pid for n, pid in backend_stubs(srv.proc.pid).items()  # a stopped stub fails every request too
             if not process_state(pid).startswith(("T", "t", "Z"))}   # (hostile s16b F2: kill -STOP)
    done = []
    for model, state in srv.loaded_models().items():
        live = {n for n in stubs if n.rsplit("_", 2)[0] == model}
        gone = seen.get(model, set()) - live
        pending = seen.get(f"!pending:{model}")  # stub pids when its reload did not finish (LoadNotFinished)
        if pending is not None and (state != "READY" or _stub_pids(stubs, model) - pending):
            seen.pop(f"!pending:{model}")  # that load ended after all (new instances, or the model left READY)
            pending = None
        if state != "READY":
            seen.pop(model, None)
        elif gone and pending is None:
            try:
                if why := entry_model_file_problem(Path(srv.model_repository), model):
                    raise RuntimeError(why)
                reload_model(srv, model)  # a failed reload keeps ``seen``: tried again next time (hostile s16 F8)
            except LoadNotFinished as e:  # another load would queue behind this one: not tried again (s17c H17)
                seen[f"!pending:{model}"] = _stub_pids(stubs, model)
                _say_not_repaired(seen, model, (
                    f"{model}'s instance {', '.join(sorted(gone))} died and it could not be reloaded: {str(e)[:200]}; "
                    f"another reload would wait behind it, so none is tried; every request to {model} fails "
                    f"meanwhile. Fix: restart the server (stop `invoke serve` with Ctrl-C, then run it again: it "
                    "starts with releases.json's current unit)"))
                continue
            except RuntimeError as e:  # hostile s17c H16: only "loading ... 50 s" lines, never why, while it failed
                _say_not_repaired(seen, model, f"{model}'s instance {', '.join(sorted(gone))} died and it cannot be "
                                               f"reloaded ({str(e)[:300]}); every request to it fails meanwhile "
                                               "(tried again every few seconds)")
                continue
            seen.pop(f"!said:{model}", None)
            seen.pop(model, None)  # learnt again from the reloaded instances
            done.append(f"{model} reloaded: the process of its instance {', '.join(sorted(gone))} had died or was "
                        "stopped, so every request to it failed")
        elif not gone:
            seen[model] = seen.get(model, set()) | live
    return done


def say_disagreements(repo: Path, said: set[str]) -> list[str]:
    """The watchdog of a read-only repository (it cannot repair: nothing is written): what disagrees with releases.json
    (``release.list_releases``'s ``problems``: a release command through a writable path killed mid-switch, hostile
    s16 H8) printed once each as ``[serve] not repaired (read-only here): ...``, with its repair. Returns []."""
    from precision_pipeline.serving import release

    with contextlib.suppress(UserError, OSError, ValueError):
        for p in release.list_releases(repo)["problems"]:
            if p not in said:
                said.add(p)
                print(f"[serve] not repaired (this repository is read-only here): {p}", flush=True)
    return []


def say_stalled_rollout(repo: Path, said: set[str]) -> None:
    """Print ``release_state.stalled_rollout`` of ``repo`` once (again only when it changes) as ``[serve] warning:
    ...``: a stopped rollout process leaves its canary's share on an unjudged candidate (hostile s17 F8)."""
    from precision_pipeline.serving import release_state

    with contextlib.suppress(UserError, OSError, ValueError):
        why = release_state.stalled_rollout(release_state.read_state(repo), repo)
        if why and why not in said:
            said.add(why)
            print(f"[serve] warning: {why}", flush=True)


def server_stopped(pid: int, said: set[str]) -> bool:
    """Whether the tritonserver ``pid`` is stopped (``T``: SIGSTOP, Ctrl-Z of its group): every request waits until it
    is resumed, and nothing here can answer for it. Said once as ``[serve] warning: ...`` with the fix, and its
    resumption once again (hostile s17 F11: 75 s of client timeouts and not a line in serve's log)."""
    from precision_pipeline.core.store import process_state

    key = f"stopped:{pid}"
    if process_state(pid).startswith(("T", "t")):
        if key not in said:
            said.add(key)
            print(f"[serve] warning: tritonserver (pid {pid}) is stopped (SIGSTOP or Ctrl-Z): every request waits until "
                  f"it is resumed: kill -CONT {pid}", flush=True)
        return True
    if key in said:
        said.discard(key)
        print(f"[serve] tritonserver (pid {pid}) runs again", flush=True)
    return False

