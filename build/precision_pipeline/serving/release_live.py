"""A live server and a serving repository: load and smoke-test a unit directly (before the ensemble routes to it),
refuse a server that serves another repository (``verify_server``), make the live server agree with
releases.json (``reconcile_server``). See serving/release.py."""

from __future__ import annotations

import contextlib
import http.client
import time
from pathlib import Path

from precision_pipeline.core.errors import ServerStopped, UserError
from precision_pipeline.core.store import read_json
from precision_pipeline.serving import llmapi_unit, pack
from precision_pipeline.serving.release_configs import load_config
from precision_pipeline.serving.release_state import IDENTITY_PARAM, ROUTE_FILE, current_order, ensemble_serves, rejected_units
from precision_pipeline.serving.release_units import is_any_unit


SMOKE_PROMPT = "What is 2 + 2?"


def _check_smoke_text(unit: str, text: str, expect) -> None:
    """The smoke test's verdict on a unit's answer (either unit kind): RuntimeError for empty text, or text other
    than ``expect`` when one is given."""
    if not text.strip():
        raise RuntimeError(f"smoke test of {unit}: empty text")
    if expect is not None and text != expect:
        raise RuntimeError(f"smoke test of {unit}: got {text!r}, expected {expect!r}")


def load_unit(server, unit: str, field: str, serving: str, fix: str, states: dict | None = None) -> None:
    """``server.load(unit)``; a unit the server refuses to load (a damaged or outdated unit: the backend's
    own message) is a UserError on ``field`` (exit 2) saying that ``serving`` still serves, not a traceback. A unit
    the server already lists as LOADING in ``states`` (its repository index, when the caller read it) is refused at once (UserError on ``--url``): the command holds the releases
    lock, so that is an earlier load that never finished (a python stub stopped or unable to start), and a load now
    would queue behind it for up to 900 s (hostile s18b F1)."""
    if (states or {}).get(unit) == "LOADING":
        raise UserError("--url", f"the server at {server.http_url} still lists {unit} as LOADING from an earlier load "
                        "that never finished (its python stub stopped, or unable to start: the server's log says which), "
                        f"and a load now would wait behind it; nothing was switched ({serving} still serves).",
                        "resume or kill the stopped stub (`ps -o pid,stat,args -C triton_python_backend_stub`), or "
                        "restart the server (`invoke serve --repo REPO`); then run this again.")
    try:
        server.load(unit)
    except RuntimeError as e:
        unload_quietly(server, unit)
        raise UserError(field, f"the server does not load {unit}, so nothing was switched ({serving} still serves): "
                        f"{str(e)[:400]}", fix) from None
    except ServerStopped as e:
        raise stopped_before_switch(e, serving) from None


def stopped_before_switch(e: ServerStopped, serving: str) -> ServerStopped:
    """``e`` (the server at --url stopped answering before the switch) with what holds: nothing was switched,
    releases.json still names ``serving``, which a restarted server serves (hostile s12 F-N, F-L)."""
    return ServerStopped(f"{e} Nothing was switched: releases.json still names {serving}, and a restarted server "
                         "serves it (`invoke serve --repo REPO`); run the command again once it answers.")


def unload_quietly(server, unit: str) -> None:
    """``server.unload(unit)``, whatever the server answers (a clean-up after a refusal)."""
    with contextlib.suppress(Exception):
        server.unload(unit)


class EntryModelFailed(RuntimeError):
    """The smoke test's request to the repository's own ``preprocessing`` or ``postprocessing`` failed (``model``):
    the entry model is broken (its instance died, its files are gone), not the unit tested (hostile s18b F2: "fails its
    smoke request ... rebuild the output" for a good unit)."""

    def __init__(self, model: str, err: Exception):
        super().__init__(f"{model}: {str(err)[:300]}")
        self.model = model


def smoke_unit(server, unit: str, field: str, serving: str, fix: str, *, expect: str | None = None) -> dict:
    """``smoke_test``; a unit that loaded but fails its smoke request (a wrong or empty answer, or the server's
    error for it) is a UserError on ``field`` (exit 2) naming the unit, the server's message and that ``serving``
    still serves -- a refusal of that unit, not an internal error. The caller unloads it."""
    from tritonclient.utils import InferenceServerException

    try:
        return smoke_test(server, unit, expect=expect)
    except (OSError, http.client.HTTPException) as e:  # refused, reset, a timeout, a connection closed mid-answer
        # (geventhttpclient's HTTPConnectionClosed: hostile s17b F8, a traceback): the server is gone, not the unit
        raise stopped_before_switch(e if isinstance(e, ServerStopped) else server.stopped(f"smoke-testing {unit}", e),
                                    serving) from None
    except (RuntimeError, InferenceServerException) as e:
        states = loaded_models(server)
        gone = [m for m in ("preprocessing", "postprocessing") if states.get(m) not in (None, "READY")]
        if gone:  # hostile s17b F12: a server stopping unloads its models: "rebuild the output" blamed the build
            raise stopped_before_switch(server.stopped(f"smoke-testing {unit}: it unloaded {', '.join(gone)} meanwhile "
                                                       "(stopping?)", e), serving) from None
        if isinstance(e, EntryModelFailed):
            raise UserError("--url", f"the server's {e.model} fails ({str(e)[len(e.model) + 2:]}), so {unit} could not "
                            f"be smoke-tested and nothing was switched ({serving} still serves); the entry model is "
                            f"broken, not {unit}.", "serve's watchdog reloads a model whose instance died (its log says "
                            "so, or why not); files of it that are gone are listed by `invoke releases --repo REPO` with "
                            "where to copy them from; else restart the server. Then run this again.") from None
        raise UserError(field, f"{unit} loads but fails its smoke request, so nothing was switched ({serving} still "
                        f"serves): {str(e)[:400]}", fix) from None


def _entry_infer(client, model: str, inputs: list):
    """``client.infer(model, inputs)`` for an entry model; the server's error for it is ``EntryModelFailed``."""
    from tritonclient.utils import InferenceServerException

    try:
        return client.infer(model, inputs)
    except InferenceServerException as e:
        raise EntryModelFailed(model, e) from None


def smoke_test(server, unit: str, *, prompt: str = SMOKE_PROMPT, max_tokens: int = 8, expect: str | None = None) -> dict:
    """Infer ``unit`` directly: preprocessing -> unit -> postprocessing, called one by one.

    Fails (RuntimeError) on an error, a wrong tensor shape/dtype, an empty or over-long output, or a
    text different from ``expect`` when given. An LLM-API unit gets text instead (``smoke_llm_api``).
    """
    import numpy as np
    import tritonclient.http as hc

    if llmapi_unit.is_llm_api_unit(unit):
        return smoke_llm_api(server, unit, max_tokens=max_tokens, expect=expect)
    t0 = time.perf_counter()
    c = server.http_client()
    try:
        q = hc.InferInput("QUERY", [1, 1], "BYTES")
        q.set_data_from_numpy(np.array([[prompt.encode()]], dtype=object))
        n = hc.InferInput("REQUEST_OUTPUT_LEN", [1, 1], "INT32")
        n.set_data_from_numpy(np.array([[max_tokens]], np.int32))
        pre = _entry_infer(c, "preprocessing", [q, n])
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
        text = _entry_infer(c, "postprocessing", [tb, sl]).as_numpy("OUTPUT").reshape(-1)[0].decode()
    finally:
        c.close()
    _check_smoke_text(unit, text, expect)
    return {"text": text, "tokens": k, "ms": (time.perf_counter() - t0) * 1e3}


def llm_api_inputs(text: str, max_tokens: int, client_module=None) -> list:
    """The inputs of one greedy request to an LLM-API unit (serving/llmapi_contract.py fact 7): ``text_input`` [1]
    (the prompt, as given: that model applies no chat template), ``sampling_param_max_tokens``, ``sampling_param_top_k``
    1 (greedy: the one token of highest probability) and ``sampling_param_exclude_input_from_output`` true (the
    generated text only; the model's default would repeat the prompt)."""
    import numpy as np

    if client_module is None:
        import tritonclient.http as client_module
    out = []
    for name, dt, arr in (("text_input", "BYTES", np.array([text.encode()], dtype=object)),
                          ("sampling_param_max_tokens", "INT32", np.array([max_tokens], np.int32)),
                          ("sampling_param_top_k", "INT32", np.array([1], np.int32)),
                          ("sampling_param_exclude_input_from_output", "BOOL", np.array([True]))):
        x = client_module.InferInput(name, list(arr.shape), dt)
        x.set_data_from_numpy(arr)
        out.append(x)
    return out


def llm_api_text(client, unit: str, text: str, max_tokens: int) -> str:
    """The generated text of one greedy request to LLM-API unit ``unit`` (``llm_api_inputs``); RuntimeError when its
    ``text_output`` is not one BYTES element (the model's contract: ``[1]`` STRING)."""
    import numpy as np

    out = client.infer(unit, llm_api_inputs(text, max_tokens)).as_numpy("text_output")
    if out is None or out.dtype != np.object_ or out.size != 1:
        raise RuntimeError(f"{unit}: text_output {None if out is None else (out.dtype, out.shape)}, expected one string")
    v = out.reshape(-1)[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


LLM_API_SMOKE_PROMPT = "The capital of France is"
"""An LLM-API unit's smoke prompt: a completion prompt, since that model applies no chat template (``SMOKE_PROMPT``
sent raw, without the template preprocessing applies for engine units, can be answered with whitespace only)."""


def smoke_llm_api(server, unit: str, *, prompt: str = LLM_API_SMOKE_PROMPT, max_tokens: int = 8,
                  expect: str | None = None) -> dict:
    """``smoke_test`` of an LLM-API unit: one greedy text request (``llm_api_text``) straight to it. Fails
    (RuntimeError) on an error, an output that is not one string, an empty text, or a text other than ``expect``."""
    t0 = time.perf_counter()
    c = server.http_client()
    try:
        text = llm_api_text(c, unit, prompt, max_tokens)
    finally:
        c.close()
    _check_smoke_text(unit, text, expect)
    return {"text": text, "ms": (time.perf_counter() - t0) * 1e3}


# --------------------------------------------------------------------------------------------
# Promote / rollback


def loaded_models(server) -> dict[str, str]:
    if server is None:
        return {}
    try:
        return server.loaded_models()
    except Exception:
        return {}


def live_unit(server) -> str | None:
    """The engine unit the ensemble loaded on ``server`` calls (its config's unit step); None when no
    ensemble is loaded there."""
    cfg = server.model_config("ensemble")
    if not cfg:
        return None
    steps = (cfg.get("ensemble_scheduling") or {}).get("step") or []
    return next((st.get("model_name") for st in steps if pack.is_unit(st.get("model_name", ""))), None)


def routed_units(repo_dir: Path, server) -> set[str]:
    """Units requests can reach now: the live ensemble's unit and every unit route.json names (the BLS
    reads it per request)."""
    route = read_json(Path(repo_dir) / "tensorrt_llm_bls" / ROUTE_FILE, {}) or {}
    units = {route.get("tensorrt_llm_model_name"), (route.get("canary") or {}).get("tensorrt_llm_model_name")}
    if server is not None:
        with contextlib.suppress(Exception):
            units.add(live_unit(server))
    return {u for u in units if u}


def _inside_dir(p: Path, folder: Path) -> bool:
    """Whether ``p`` is in ``folder``: by path, or by directory identity (device, inode) of one of its parents, so
    the same repository through a bind mount is inside itself (hostile s15 F14's read-only mount)."""
    try:
        p.resolve().relative_to(Path(folder).resolve())
        return True
    except (ValueError, OSError, RuntimeError):
        pass
    from precision_pipeline.serving.server_procs import same_directory

    return any(same_directory(str(d), str(folder)) for d in Path(p).resolve().parents)


def refuse_copied_repository(repo_dir: Path, consequence: str) -> None:
    """UserError on ``--repo`` when ``repo_dir`` is a copy or a move of another serving repository: its preprocessing's
    ``tokenizer_dir`` (an absolute path into the repository pack wrote) points outside it, so its files still name the
    original (and its units' ``gpt_model_path`` the original's units). ``consequence``: what would go wrong here.
    The one rule for ``verify_server`` and ``serve`` (hostile s15c T21: a server of a copy served the original's unit
    files, unseen by the original's commands)."""
    p = Path(repo_dir) / "preprocessing" / "config.pbtxt"
    want = pack.config_params(load_config(p)).get("tokenizer_dir") if p.is_file() else None
    if want and not _inside_dir(Path(want), repo_dir):
        raise UserError("--repo", f"{repo_dir} is a copy or a move of another serving repository: its preprocessing's "
                        f"tokenizer_dir is {want!r}, outside it; {consequence}", "run the command on the repository "
                        f"tokenizer_dir points into; for a new repository at this path, first move this copy away "
                        f"({repo_dir} and the releases.json beside it, {Path(repo_dir).parent / 'releases.json'}), then "
                        f"`invoke promote --profile P --repo {repo_dir}` creates one (hostile s17c F6).")


def verify_server(repo_dir: Path, server) -> None:
    """Refuse (UserError on ``--url``, exit 2) a ``server`` that does not serve ``repo_dir``, before
    anything is changed: the parameters that identify the repository must be the same in the files
    and in the configs the server loaded: the ensemble's ``IDENTITY_PARAM`` (repositories created
    since it exists) and the preprocessing's ``tokenizer_dir`` (an absolute path into the repository).
    At least one of the two models must be loaded there. A tritonserver of this machine at --url must serve
    ``repo_dir`` itself (by path or directory identity): a copy's server has the original's identities. A repository whose ``tokenizer_dir`` points
    outside it (a copy or a move: its files still name the original) is refused (UserError on ``--repo``).
    Nothing to check without a server."""
    if server is None:
        return
    repo_dir = Path(repo_dir)
    where = f"the server at {server.http_url}"
    fix = (f"pass the --url of the server that serves {repo_dir} (`invoke serve --repo {repo_dir}` starts one), "
           "or the --repo that this server serves.")
    from precision_pipeline.serving.server_procs import repository_at, same_directory

    served = repository_at(server.http_url)  # a local server's own folder: a copy carries the original's identities
    if served and served != str(repo_dir.resolve()) and not same_directory(served, str(repo_dir)):
        raise UserError("--url", f"{where} does not serve {repo_dir}: it is a tritonserver of this machine serving "
                        f"{served} (the folder decides: a copy of a repository carries its identity parameters)."
                        , fix)  # hostile s15c N7, s15d T3
    checked = 0
    for model, key in (("ensemble", IDENTITY_PARAM), ("preprocessing", "tokenizer_dir")):
        p = repo_dir / model / "config.pbtxt"
        want = pack.config_params(load_config(p)).get(key) if p.is_file() else None
        if not want:
            continue
        if key == "tokenizer_dir":
            refuse_copied_repository(repo_dir, "the server at --url would load the original's configs, not these.")
        try:
            live = server.model_config(model)
        except (OSError, http.client.HTTPException) as e:  # it answered attach(): it stopped since (hostile s12 F-P)
            raise (e if isinstance(e, ServerStopped) else server.stopped("reading its ensemble's configuration", e)) from None
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
    in-progress rollout's candidate and not routed to (``routed_units``) unloaded (a warm previous
    release stays). Returns what was done; [] without a server. Raises RuntimeError when the
    reloaded ensemble still calls another unit."""
    if server is None:
        return []
    fixed: list[str] = []
    cur = state["current"]
    live = live_unit(server)
    if live is not None and not ensemble_serves(cur):  # an LLM-API release: the ensemble cannot serve it
        if loaded_models(server).get(cur) != "READY":
            server.load(cur)
            fixed.append(f"{cur} loaded")
        server.unload("ensemble")
        fixed.append(f"live ensemble (on {live}) unloaded: the current release {cur} is an LLM-API unit")
    elif live is not None and live != cur:
        if loaded_models(server).get(cur) != "READY":
            server.load(cur)
            fixed.append(f"{cur} loaded")
        server.load("ensemble")
        now = live_unit(server)
        if now != cur:
            raise RuntimeError(f"the live ensemble calls {now} after reloading it, releases.json says {cur}")
        fixed.append(f"live ensemble moved from {live} to {cur}, the current release releases.json records (a command "
                     "interrupted mid-switch, or releases.json edited by hand)")  # not "back": s17c F1/H02
    # the entry points unloaded by hand (hostile s15 F13: every BLS request 404 after a "promoted"): loaded again, the
    # ensemble after the unit it calls; a model the server does not list at all is left as it is
    entry = ("preprocessing", "postprocessing", "tensorrt_llm_bls") + (("ensemble",) if ensemble_serves(cur) else ())
    states = loaded_models(server)
    down = [m for m in entry if states.get(m) not in (None, "READY")]
    if "ensemble" in down and states.get(cur) != "READY":
        server.load(cur)
        fixed.append(f"{cur} loaded")
    for m in down:
        server.load(m)
        fixed.append(f"{m} loaded again (its state was {states[m] or 'not loaded'})")
    rejected = rejected_units(state)
    releases = set(current_order(state)) | {r.get("unit") for r in state.get("releases", [])}
    keep = {cur} | routed_units(repo_dir, server) | {u for u in releases if u not in rejected}
    if state.get("rollout"):
        keep.add(state["rollout"].get("candidate"))
    if state.get("fallback") and state.get("warm_fallback"):  # loaded by design (hostile s8 #127), rejected or not
        keep.add(state["fallback"])
    for name, st in loaded_models(server).items():
        if is_any_unit(name) and st == "READY" and name not in keep:
            with contextlib.suppress(Exception):
                server.unload(name)
                fixed.append(f"{name} unloaded (no release; nothing routes to it)")
    return fixed
