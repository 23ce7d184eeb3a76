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

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import process_state
from precision_pipeline.serving.server_procs import backend_stubs

if TYPE_CHECKING:
    from precision_pipeline.serving.triton_server import TritonServer

REVIVED_PARAM = "precision_pipeline_revived_at"
"""A config parameter (seconds since the epoch) the watchdog's reload of a model adds, so the load is a reload
(``revive_dead_instances``); neither the backends nor the release code read it."""


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
        if state != "READY":
            seen.pop(model, None)
        elif gone:
            seen.pop(model, None)  # learnt again from the reloaded instances
            cfg = srv.model_config(model) or {}
            cfg.setdefault("parameters", {})[REVIVED_PARAM] = {"string_value": f"{time.time():.3f}"}
            srv.load(model, json.dumps(cfg))
            done.append(f"{model} reloaded: the process of its instance {', '.join(sorted(gone))} had died or was "
                        "stopped, so every request to it failed")
        else:
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
