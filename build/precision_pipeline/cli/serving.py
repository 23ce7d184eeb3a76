"""``invoke serve``, ``promote``, ``rollback``, ``rollout``, ``probe``, ``releases``: a build's typed output
(``serving.build_output``) in, one call, printed."""

from __future__ import annotations

import json
import os
from pathlib import Path

from precision_pipeline.cli.console import console, int_arg
from precision_pipeline.core.errors import UserError
from precision_pipeline.core.paths import REPO_ROOT


def serving_repo(repo) -> Path:
    """``--repo``: the serving repository (default ``artifacts/serving/model_repository``). UserError (exit 2) when the
    path is too long for any file call (``core.outputs.path_length_problem``; hostile s16b T143: it read as a
    damaged releases.json)."""
    from precision_pipeline.core.outputs import path_length_problem

    if repo and (why := path_length_problem(str(Path(repo).expanduser().absolute()))):
        raise UserError("--repo", why + ".", "give the serving repository a shorter path.")
    p = Path(repo).expanduser().resolve() if repo else None
    if p is not None and (q := _enclosing_repository(p)) is not None:
        if q == p.parent:  # hostile s17b F13
            raise UserError("--repo", f"{p} is a model folder inside the serving repository {q}, not a serving "
                            "repository.", f"pass --repo {q}.")
        raise UserError("--repo", f"{p} is inside the serving repository {q} (a new repository there would be "
                        "created inside one of its model folders).", f"pass --repo {q}, or a folder outside it "
                        "for a new repository.")  # hostile s17c F2
    if p is not None and (p / "releases.json").is_file() and (inner := [
            c for c in sorted(p.iterdir()) if c.is_dir() and ((c / "tensorrt_llm_bls").is_dir() or (c / "ensemble").is_dir())]):
        raise UserError("--repo", f"{p} is the folder that holds the releases.json of the serving repository "
                        f"{inner[0]}; --repo names the repository folder itself.", f"pass --repo {inner[0]}.")  # s18b F6
    return Path(repo).expanduser().resolve() if repo else REPO_ROOT / "artifacts" / "serving" / "model_repository"


def _enclosing_repository(p: Path) -> Path | None:
    """The serving repository a folder ``p`` lies inside (an ancestor whose parent holds its releases.json and which
    holds the BLS or the ensemble model folder), None when none does. ``p`` itself is not one of them."""
    for q in p.parents:
        if q.parent != q and (q.parent / "releases.json").is_file() \
                and ((q / "tensorrt_llm_bls").is_dir() or (q / "ensemble").is_dir()) \
                and not (q / "releases.json").exists():
            return q
    return None


def serve(profile=None, repo=None, http_port=None, grpc_port=None, metrics_port=None) -> None:
    """A real Triton server (CPU reference backend) on 127.0.0.1 for a build's packed repository or ``repo``."""
    from precision_pipeline.serving import build_output
    from precision_pipeline.serving.triton_server import serve as serve_repo

    if profile and repo:  # hostile s17 F18: --profile was ignored without a word
        raise UserError("--profile", f"and --repo name two things to serve (the build of {profile} and {repo}).",
                        "pass one of them.")
    try:
        path = build_output.open_build(profile).packed if profile else serving_repo(repo)
    except build_output.NotBuilt as e:  # its fix offered --out, which serve does not have
        raise UserError("--profile", e.problems[0].reason, f"build it first (`invoke build --profile {profile}`); to serve "
                        "another folder's build, promote it into a serving repository and serve that with --repo.") from None
    serve_repo(path, http_port=int_arg("--http-port", http_port, 1, 65535, 8000) or 8000,  # not "port 1" (s17c note)
               grpc_port=int_arg("--grpc-port", grpc_port, 1, 65535, 8001) or 8001,
               metrics_port=int_arg("--metrics-port", metrics_port, 1, 65535, 8002) or 8002)


def server_of(url, repo_dir: Path):
    """The server a promote or rollback acts on: ``TritonServer.from_url(url)`` (None when --url is not given; ''
    is refused); without --url, UserError (exit 2, before anything is read or written) when a tritonserver on this
    machine serves ``repo_dir`` (``servers_of``): only the files would switch while it keeps serving the old unit
    (hostile s8 #56); with --url, UserError when another one serves it too (``refuse_other_servers``)."""
    from precision_pipeline.serving.triton_server import TritonServer, servers_of

    if url is None and (live := servers_of(repo_dir)):
        pid, at = live[0]
        raise UserError("--url", f"is not given, but tritonserver (pid {pid}) serves {repo_dir} at {at}: without --url "
                        "only the files would switch and that server would keep serving the unit it has; nothing was "
                        "changed.", f"pass --url {at} (the server then loads, smoke-tests and switches too), or stop "
                        "that server first.")
    try:
        server = TritonServer.from_url(url)
    except UserError as e:  # hostile s15c T58: the fix said "leave --url out", refused while the repository's server runs
        if not (live := servers_of(repo_dir)) or not e.problems[0].reason.startswith("no Triton server answers"):
            raise
        pid, at = live[0]
        raise UserError("--url", f"{e.problems[0].reason} tritonserver (pid {pid}) serves {repo_dir} at {at}; nothing was "
                        "changed.", f"pass --url {at}.") from None
    if server is not None:
        refuse_other_servers(server, repo_dir)
    return server


def refuse_other_servers(server, repo_dir: Path) -> None:
    """UserError on ``--url`` (exit 2, nothing changed) while a tritonserver on this machine other than ``server``
    (the one at --url) serves ``repo_dir`` (``triton_server.other_servers``): a change through --url switches only
    that one, and the other's BLS, which reads the shared route.json, would route every request to a unit it never
    loaded (hostile s12 F-Q: HTTP 400 until it was restarted). Used by promote, rollback, rollout and a recorded
    probe."""
    from precision_pipeline.serving.release_live import verify_server
    from precision_pipeline.serving.triton_server import other_servers, repository_at

    if others := other_servers(repo_dir, server.http_url):
        pid, at = others[0]
        try:  # first: does the server at --url serve it at all? (hostile s15 F6: the fix named the right server's pid)
            verify_server(repo_dir, server)
        except UserError as e:
            if e.problems[0].field != "--url":
                raise
            raise UserError("--url", f"{e.problems[0].reason} tritonserver (pid {pid}) at {at} is the server of {repo_dir}.",
                            f"pass --url {at}; nothing was changed.") from None
        if len(others) == 1 and repository_at(server.http_url) is None:  # hostile s16 H2: a port forward to the one server
            raise UserError("--url", f"{server.http_url} serves {repo_dir}, but no tritonserver of this machine listens "
                            f"there, and tritonserver (pid {pid}) at {at} serves it here: --url reaches that server through "
                            "a port forward or a proxy, or is a second server elsewhere; nothing was changed.",
                            f"pass --url {at} (the server on this machine); if {server.http_url} is another server of "
                            "this repository, stop that one: one repository is served by one server.")
        raise UserError("--url", f"tritonserver (pid {pid}) at {at} serves {repo_dir} too, not only the server at "
                        f"{server.http_url}: a change through --url would switch that one alone, and the other's BLS "
                        "(it reads the shared route.json) would send every request to a unit it never loaded; nothing "
                        "was changed.", f"stop the second server (kill {pid}) and run this again: one repository is "
                        "served by one server (`invoke serve` refuses a second); to scale, give each server its own "
                        "repository (promote into each).")


def refuse_new_repository_url(server, repo_dir: Path) -> None:
    """UserError on ``--url`` (exit 2, before anything is created) for the first promote of ``repo_dir`` (no
    releases.json yet) with a ``server``: that creates the files only, and the server at --url serves another
    repository (hostile s12 F-E: it said "created" and --url was not used). Names that repository when a
    tritonserver of this machine listens at --url (``triton_server.repository_at``)."""
    from precision_pipeline.serving import release
    from precision_pipeline.serving.triton_server import repository_at

    if server is None or release.read_state(repo_dir) is not None:
        return
    other = repository_at(server.http_url)
    raise UserError("--url", f"{server.http_url} serves {f'repository {other}' if other else 'another repository'}, "
                    f"not the new {repo_dir}; the first promote creates the files only (nothing was created).",
                    f"leave --url out, then `invoke serve --repo {repo_dir}`.")


def promote_server(url, repo_dir: Path):
    """The server a promote (``invoke promote``, ``invoke nightly --promote``) switches: ``server_of`` (None without
    --url; refused while a local server serves the repository) and, for the first promote, ``refuse_new_repository_url``."""
    server = server_of(url, repo_dir)
    refuse_new_repository_url(server, repo_dir)
    return server


def nightly_server(promote: bool, url, repo_dir: Path):
    """``invoke nightly --promote [--url]``: the ``attach`` of ``nightly.run_nightly`` (None without --promote), checked
    now, before hours of builds (``promote_server``: a repository a local tritonserver serves needs --url, hostile s16
    H9), and again at the promote (a server may have started meanwhile). UserError for --url without --promote."""
    if url is not None and not promote:
        raise UserError("--url", "is read only with --promote.", "add --promote, or leave --url out.")
    if not promote:
        return None
    promote_server(url, repo_dir)
    return lambda: promote_server(url, repo_dir)


def promote(profile, repo=None, url=None, out=None) -> None:
    """``serving.build_output.promote_build`` of the build, printed (warnings on every promote, the first too)."""
    from precision_pipeline.serving import build_output
    from precision_pipeline.serving.triton_server import terminate_as_interrupt

    b = build_output.open_build(profile, out)
    server = promote_server(url, serving_repo(repo))
    with terminate_as_interrupt():  # SIGTERM/SIGHUP as Ctrl-C: a loaded candidate is unloaded, said (hostile s8 #103)
        p = build_output.promote_build(b, serving_repo(repo), by="invoke promote", server=server)
    con = console()
    for w in p.warnings:
        con.print(f"[yellow]warning[/]: {w}", soft_wrap=True)
    for n in p.notes:
        con.print(f"[yellow]note[/]: {n}", soft_wrap=True)
    if p.created:
        con.print(f"created {serving_repo(repo)}: current {p.unit}, fallback {p.fallback}")
    else:
        con.print(f"promoted {p.unit} in {p.total_ms:.0f} ms" + ("" if server else " (no server given: repository only)"))
    _warn_entry_files(serving_repo(repo))
    if not p.created:
        _entry_point(server, serving_repo(repo), f"promoted {p.unit}")


def _warn_entry_files(repo_dir: Path) -> None:
    """After a promote or rollback: a warning for each python entry model whose files are gone
    (``release_units.entry_model_problems``; hostile s17c F7: a rollback exited 0 and said nothing)."""
    from precision_pipeline.serving.release_units import entry_model_problems

    for m, why in entry_model_problems(repo_dir).items():
        console().print(f"[yellow]warning[/]: {why}: the server cannot load {m} from this repository (a restarted "
                        "server, or serve's watchdog after its instance died); every request through it fails then.",
                        soft_wrap=True)


def _entry_point(server, repo_dir: Path, done: str) -> None:
    """After a promote or rollback through ``server``: the BLS answers (``serve_watchdog.entry_point_note``, a note
    when it had to be reloaded; PipelineError when it still fails)."""
    if server is not None:
        from precision_pipeline.core.errors import InterruptedAfterCommit
        from precision_pipeline.serving.serve_watchdog import entry_point_note

        try:
            note = entry_point_note(server, repo_dir, done)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM, SIGHUP: after the commit (hostile s17 F16: "artifacts are intact")
            raise InterruptedAfterCommit(f"{done}, interrupted after the switch, while a request checked the entry "
                                         "point: the change took effect (releases.json records it and the server "
                                         "serves it); only that check was not finished.") from None
        if note:
            console().print(f"[yellow]note[/]: {note}", soft_wrap=True)


def rollback(repo=None, to=None, fallback=False, url=None) -> None:
    from precision_pipeline.serving import release
    from precision_pipeline.serving.triton_server import terminate_as_interrupt

    if to is not None and not str(to).strip():
        raise UserError("--to", "is empty (an unset shell variable?); rolling back to the previous release instead "
                        "would be a guess.", "pass a unit name (or a prefix of its 12 hex digits), or leave --to out "
                        "for the previous release.")
    server = server_of(url, serving_repo(repo))
    with terminate_as_interrupt():  # as in promote: a cold target being loaded is unloaded
        t = release.rollback(serving_repo(repo), to=to, fallback=fallback, server=server, by="invoke rollback")
    if t.get("already_current"):
        console().print(f"current: {t['unit']}, already (nothing to switch; the repository's files"
                        + (" and the server" if server is not None else "") + " agree with releases.json)")
    else:
        console().print(f"current: {t['unit']} ({'warm' if t.get('warm') else 'cold'}) in {t.get('total_ms', 0):.1f} ms")
    if t.get("verified") is False:  # hostile s17b F11: said nothing
        console().print(f"[yellow]warning[/]: {t['unit']} has no install record in releases.json: its files were not "
                        "verified (promote its build again to record it).", soft_wrap=True)
    _warn_entry_files(serving_repo(repo))
    _entry_point(server, serving_repo(repo), f"rolled back to {t['unit']}")


def _attach(url: str, metrics_port, repo_dir: Path | None = None):
    """The server at ``url`` with its metrics port; with ``repo_dir``, refused while another server serves it
    (``refuse_other_servers``; not for ``rollout --abort``, which puts every server's routes back on the stable unit)."""
    from precision_pipeline.serving.triton_server import TritonServer

    server = TritonServer.attach(url)
    server.metrics_port = metrics_port or server.http_port + 2
    if repo_dir is not None:
        refuse_other_servers(server, repo_dir)
    return server


def _abort(repo_dir: Path, url, metrics_port, con) -> int:
    """``rollout --abort``: the rollout in progress ended (``serving.rollout.abort``), printed; without --url the server
    this machine runs on the repository, else the files only (hostile s15 F12: refused on 127.0.0.1:8000). Returns 0."""
    from precision_pipeline.serving import rollout as ro

    if url is None:
        from precision_pipeline.serving.triton_server import servers_of

        url = next((at for _pid, at in servers_of(repo_dir)), None)
        if url is None:
            con.print("note: no --url and no tritonserver on this machine serves the repository: the abort "
                      "rewrites its files (route.json, the configs) only; a server elsewhere follows route.json "
                      "at its next request.", soft_wrap=True)
    rec = ro.abort(repo_dir, _attach(url, metrics_port) if url is not None else None)
    at = (f"after its switch to 100 % (interrupted before its commit; recorded at {rec['percent']} %)"
          if rec.get("ensemble_reloaded") else f"at {rec['percent']} %")  # the live ensemble was on it (hostile s15 T49)
    con.print(f"rollout of {rec['candidate']} aborted {at}: {rec['stable']} serves all traffic "
              f"(decision to last candidate request {rec.get('decision_to_stable_ms', 0):.0f} ms)", soft_wrap=True)
    if rec.get("candidate_kept") or rec.get("server_error"):
        con.print(f"[yellow]note[/]: {rec['candidate']} was not unloaded: "
                  f"{rec.get('candidate_kept') or rec.get('server_error')}", soft_wrap=True)
    return 0


def rollout(profile=None, steps=None, hold=None, url=None, metrics_port=None, abort=False, repo=None, out=None,
            probe_prompts=4) -> int:
    """``serving.rollout.rollout`` of the build with a live accuracy probe (or ``abort``); returns 3 when the
    candidate was not promoted (rolled back or aborted), as ``invoke rollout`` exits."""
    from precision_pipeline.core.errors import EXIT_GATE_FAILED
    from precision_pipeline.serving import acceptance, build_output, release
    from precision_pipeline.serving import rollout as ro

    repo_dir, con = serving_repo(repo), console()
    metrics_port = int_arg("--metrics-port", metrics_port, 1, 65535, 8002)  # before anything else is asked
    if abort:
        return _abort(repo_dir, url, metrics_port, con)
    given_url, url = url is not None, "127.0.0.1:8000" if url is None else url  # '' refused by attach
    if not profile:
        raise UserError("--profile", "is required (or pass --abort).", "e.g. invoke rollout --profile fp8-h100")
    given_steps = ro.parse_steps(str(steps)) if steps is not None else None  # the flags before the build is read
    given_hold = _hold_arg(hold)
    n_probe = int_arg("--probe-prompts", probe_prompts, 1, 65)
    b = build_output.open_build(profile, out)
    prof = b.profile
    ok = acceptance.check_promotable(prof, b.out_dir, b.packed, action="rollout", profile_ref=b.ref, **b.serving_facts())
    for w in ok.warnings + build_output.repository_settings_warnings(prof, repo_dir):
        con.print(f"[yellow]warning[/]: {w}", soft_wrap=True)
    step_list = given_steps or ro.parse_steps(list(prof.deployment.canary_steps))
    hold_s = float(prof.deployment.canary_pause_s) if given_hold is None else given_hold
    if release.read_state(repo_dir) is None:
        raise UserError("--repo", f"{repo_dir} is not a serving repository yet.", f"`invoke promote --profile {profile}` creates it.")
    server = _rollout_server(url, given_url, metrics_port, repo_dir)
    pset = b.probe_set(n_probe)

    def show(s):
        pr = s.get("probe") or {}
        if s.get("counters_reset"):
            return con.print(f"  {s['percent']:>3} %: {COUNTERS_RESET_TEXT}: nothing judged -> rolled back", soft_wrap=True)
        con.print(f"  {s['percent']:>3} %: " + ("switched" if s["percent"] == 100 else
                  f"candidate {s['candidate']['success']} ok / {s['candidate']['failure']} failed, share "
                  f"{(s.get('share_measured') or 0):.1f} %, probe KL P99 {_num(pr.get('kl_p99'))} top-1 "
                  f"{_num(pr.get('top1'), 3)}{_on_route(pr.get('route'))} -> {'pass' if s.get('passed') else 'FAIL'}"
                  + (" (no live request reached the candidate: its error and latency checks had nothing to judge; "
                     "a longer --hold lets traffic through)" if s["percent"] != 100 and
                     not (s["candidate"]["success"] + s["candidate"]["failure"]) else "")), soft_wrap=True)

    con.print(f"rolling out {prof.name} in steps {','.join(map(str, step_list))} ({hold_s:g} s each) on {url}")
    res = ro.rollout(repo_dir, b.packed, server, pset, steps=step_list, hold_s=hold_s, profile=prof.name, gate=ok.gate,
                     on_step=show)
    con.print(rollout_outcome(res, server, url, repo_dir), soft_wrap=True)
    return 0 if res.status == "promoted" else EXIT_GATE_FAILED  # 3: not promoted


def _rollout_server(url: str, given_url: bool, metrics_port, repo_dir: Path):
    """The server a rollout moves: ``_attach(url)``; without --url (``given_url`` False, ``url`` the default
    127.0.0.1:8000) the repository's local tritonserver is named when it listens elsewhere, and a default where
    nothing answers says a rollout needs its server (hostile s16 H11: the fix was "leave --url out")."""
    from precision_pipeline.serving.triton_server import servers_of

    if not given_url and (local := servers_of(repo_dir)) and local[0][1] != url:  # hostile s16 H11: named, not the default
        raise UserError("--url", f"is not given (default 127.0.0.1:8000), but tritonserver (pid {local[0][0]}) serves "
                        f"{repo_dir} at {local[0][1]}; nothing was changed.", f"pass --url {local[0][1]}.")
    try:
        server = _attach(url, metrics_port, repo_dir)
    except UserError as e:  # the default answered nothing: a rollout needs its server (never "leave --url out")
        if given_url or not e.problems[0].reason.startswith("no Triton server answers"):
            raise
        raise UserError("--url", f"is not given, and no Triton server answers at the default {url}: a rollout moves live "
                        "traffic, so it needs the server of the repository.", f"start one (`invoke serve --repo "
                        f"{repo_dir}`) and pass its --url HOST:PORT.") from None
    return server


COUNTERS_RESET_TEXT = ("the candidate's or the stable unit's counters went backwards during the step (unloaded or "
                       "reloaded meanwhile: `invoke rollout --abort` from another shell, a hand unload, serve's watchdog)")


def rollout_outcome(res, server, url: str, repo_dir: Path) -> str:
    """The last line of ``invoke rollout`` (rich markup) for its ``RolloutResult`` ``res``: promoted, aborted by
    another shell, or rolled back naming the failed check; when the check "server" failed because the server at
    ``url`` stopped answering, that it stopped and what it serves when started again (hostile s12 F-O: it said
    "serves all traffic ... (None ms ...)" of a dead server). Never prints a missing value."""
    if res.status == "promoted":
        return f"{res.candidate} is the current release ({res.seconds:.0f} s)"
    if res.status == "aborted":
        return f"[red]rollout of {res.candidate} was aborted[/] (`invoke rollout --abort`); {res.stable} serves all traffic"
    if res.failed_check == "server" and not _answers(server):
        return (f"[red]rolled back[/] at {res.failed_step} %: the server at {url} stopped answering; releases.json names "
                f"{res.stable}, which it serves when started again (`invoke serve --repo {repo_dir}`); {res.candidate} "
                "was not promoted")
    from precision_pipeline.serving.rollout import COUNTERS_RESET

    if res.failed_check == COUNTERS_RESET:  # hostile s17c F3: "check counters_reset failed", negative counts
        return (f"[red]rolled back[/] at {res.failed_step} %: {COUNTERS_RESET_TEXT}, so nothing was judged: no verdict "
                f"on {res.candidate} (it may be rolled out again); {res.stable} serves all traffic")
    took = ("" if res.decision_to_stable_ms is None else
            f" ({res.decision_to_stable_ms:.0f} ms from the decision to the candidate's last request)")
    return (f"[red]rolled back[/] at {res.failed_step} %: check {res.failed_check} failed; {res.stable} serves all "
            f"traffic{took}")


def _answers(server) -> bool:
    """Whether ``server`` answers its repository index (a rollout's "server" check failed: died, or a refused switch)."""
    try:
        server.loaded_models()
    except OSError:  # ServerStopped among them
        return False
    return True


def _hold_arg(hold) -> float | None:
    """``--hold``: seconds in 0..86400 (None when not given). UserError otherwise (nan, inf, text, negative)."""
    if hold is None:
        return None
    try:
        hold_s = float(hold)
    except ValueError:
        hold_s = -1.0
    if not 0 <= hold_s <= 86400:
        raise UserError("--hold", f"{str(hold)[:40]!r} is not a number of seconds in 0..86400.", "e.g. --hold 30")
    return hold_s


def probe(url=None, profile=None, repo=None, gate=None, unit=None, every=None, prompts=None, metrics_port=None,
          runs=None, out=None, model=None) -> int:
    """The accuracy probe of the live server (``serving.probe``), once or every N s; returns 3 when a single run
    failed."""
    from precision_pipeline.core.errors import EXIT_GATE_FAILED
    from precision_pipeline.serving import release
    from precision_pipeline.serving import probe as pr
    from precision_pipeline.serving.triton_server import TritonServer

    con = console()
    repo_dir = serving_repo(repo)
    state = release.read_state(repo_dir) if repo_dir.is_dir() else None
    n = int_arg("--prompts", prompts, 1, 65) or 4  # default None: invoke would int() a typed default itself
    every_s = None if every is None else float(int_arg("--every", every, 1, 86400))
    max_runs = int_arg("--runs", runs, 1) if runs is not None else None
    port = int_arg("--metrics-port", metrics_port, 1, 65535, 8004) or 8004
    if metrics_port is not None and every is None:  # hostile s15b F15: ignored silently, even a port in use
        raise UserError("--metrics-port", "only applies with --every (the exporter of repeated probes); a single probe "
                        "exports nothing.", "add --every N, or leave --metrics-port out.")
    if url is not None and not str(url).strip():  # attach's own fix speaks of promote's files-only mode (s17 F18)
        raise UserError("--url", "is empty (an unset shell variable?).", "pass HOST:PORT of the server's HTTP endpoint, "
                        "or leave --url out for 127.0.0.1:8000.")
    if unit:
        release.check_probe_unit(unit)
    rec_profile = next((r.get("profile", "") for r in state.get("releases", [])
                        if r.get("unit") == state["current"]), "") if state else ""
    packed = None
    if gate:
        pset = pr.load_probe_set(Path(gate).expanduser().resolve(), n, model_dir=Path(model).expanduser() if model else None)
        prof_name = profile or rec_profile
    else:
        if not (profile or rec_profile):
            raise UserError("--profile", "is required: no serving repository names the current release's profile.",
                            "e.g. invoke probe --profile fp8-h100 (or --gate <build out>/gate)")
        b = _open_for_probe(profile, rec_profile, out)
        prof_name, packed, pset = b.profile.name, b.packed, b.probe_set(n)
    if not unit and not state and packed is None:
        raise UserError("--unit", "no serving repository and no built profile to take the unit from.", "pass --unit tensorrt_llm_<h12> or llm_api_<h12>.")
    server = TritonServer.attach("127.0.0.1:8000" if url is None else url)
    if state:  # recorded in releases.json: no other server of the repository (hostile s12 F-Q), and it serves the record
        refuse_other_servers(server, repo_dir)
        _recover_for_probe(repo_dir, server, state)  # what it did is said when it releases the lock
    routes = pr.route_units(repo_dir) if state else {}
    if unit:
        _check_probe_unit_fits(server, unit, state, prof_name)
        units = {unit: routes.get(unit, "")}
    elif state and not profile:
        units = routes  # every route's unit: the current release's and the warm fallback its routing table uses
    elif packed is not None:
        units = {(u := release.resolve_unit_source(packed).name): routes.get(u, "")}  # `unit` stays the flag (s17b F3)
    else:
        units = routes
    units = _units_of_gate(Path(gate), units) if gate else _units_of_recorded_build(packed, units, not profile and rec_profile, state)
    exporter = None
    if every_s is not None:
        exporter = pr.ProbeExporter(port)
        con.print(f"probe metrics on http://0.0.0.0:{port}/metrics")
    try:
        failed = _probe_runs(con, lambda u, route: _probe_one(con, server, u, pset, repo_dir if state else None, prof_name,
                                                                exporter, route), units, every_s, max_runs,
                             repo_dir if state and not unit else None)
    finally:
        if exporter is not None:
            exporter.close()
    return EXIT_GATE_FAILED if failed and every_s is None else 0


def _probe_runs(con, probe_one, units: dict[str, str], every_s, max_runs, routed_of) -> bool:
    """Probe ``units`` ({unit: route}) once, or every ``every_s`` s until ``max_runs`` runs or Ctrl-C; whether the
    last run failed. ``routed_of`` (the repository; not with --unit): the units of ``units`` its routes reach at the
    start are watched; before each repeated run the routes are read again, and once one of them no longer serves (a
    promote, rollback or rollout moved the current release) the probe stops, saying so, instead of judging an
    unloaded unit against the old build's bar for ever (hostile s16b T72; with --profile too: s17b F3)."""
    import time as _time

    from precision_pipeline.serving import probe as pr

    k, failed = 0, False
    watched = sorted(set(units) & set(pr.route_units(routed_of))) if routed_of is not None and every_s else []
    try:
        while True:
            summaries = [probe_one(u, route) for u, route in units.items()]
            k += 1
            failed = not all(s.get("passed", False) for s in summaries)
            if every_s is None or (max_runs is not None and k >= max_runs):
                return failed
            _time.sleep(min(pr.next_wait_s(every_s, s) for s in summaries))
            if watched and set(watched) - set(now := pr.route_units(routed_of)):
                con.print(f"[yellow]stopped[/]: the repository's routes now reach {', '.join(now) or 'no unit'}, not "
                          f"{', '.join(watched)} (a promote, rollback or rollout moved the current release); this probe's "
                          "reference and bar are of the old release's build: start `invoke probe` again for the new one.",
                          soft_wrap=True)
                return failed
    except KeyboardInterrupt:
        return failed


def _units_of_gate(gate: Path, units: dict[str, str]) -> dict[str, str]:
    """The units of ``units`` ({unit: route}) a probe with ``--gate`` judges: the one the gate's build packed
    (``<build out>/model_repository``, beside ``<build out>/gate``); UserError on ``--gate`` (exit 2, nothing recorded)
    when that unit is not among them -- its reference outputs and bar would judge another build, and the verdict be
    recorded (hostile s16 H12). A gate folder outside a build output names no unit: ``units`` as they are."""
    from precision_pipeline.serving.release_units import is_any_unit

    packed = Path(gate).expanduser().resolve().parent / "model_repository"
    built = sorted(p.name for p in packed.iterdir() if is_any_unit(p.name)) if packed.is_dir() else []
    if not built or not units:
        return units
    if keep := {u: r for u, r in units.items() if u in built}:
        return keep
    raise UserError("--gate", f"{gate} is the gate of the build in {packed.parent} (unit {built[0]}), not of "
                    f"{', '.join(units)}, which the probe asks: it would be judged against that build's reference "
                    "outputs and bar, and the verdict recorded.", "pass the gate folder of that unit's build (<its "
                    "--out>/gate), or --profile P --out OUT of that build.")


def _units_of_recorded_build(packed, units: dict[str, str], rec_profile, state) -> dict[str, str]:
    """A probe without --profile (``rec_profile``: the recorded name; falsy when --profile was given: ``units``
    unchanged) judges with the build of the current release's recorded profile name (``packed``): ``units``
    as they are (the fallback route's unit is held to the same bar) when that build packed the current unit
    (``state["current"]``, releases.json); UserError on ``--profile`` (exit 2, nothing recorded) otherwise: a profile file of the same name
    elsewhere (``--profile /path/fp8-h100.yaml`` at promote) or another build at the default output would judge the
    served unit against another build's reference and bar (hostile s16b T5)."""
    from precision_pipeline.serving.release_units import is_any_unit

    if not (rec_profile and state and packed is not None):  # --profile or --gate given, or no repository
        return units
    current = state["current"]
    built = sorted(p.name for p in packed.iterdir() if is_any_unit(p.name)) if packed.is_dir() else []
    if current in built:
        return units
    raise UserError("--profile", f"not given, so the current release's recorded profile {rec_profile} was taken; its "
                    f"build in {packed.parent} packed {', '.join(built) or 'no unit'}, not the current release "
                    f"{current}: the probe would judge it against another build's reference outputs and bar, and "
                    "record the verdict; nothing was probed.", "pass --profile and --out of the current release's "
                    "build (the profile file it was promoted with), or --gate <its build>/gate.")


def _open_for_probe(profile, rec_profile: str, out):
    """``build_output.open_build`` of ``--profile`` or, not given, the current release's recorded profile, a refusal
    of which then says where the profile came from (hostile s15 F8: it blamed --profile, which was not given)."""
    from precision_pipeline.serving import build_output

    try:
        return build_output.open_build(profile or rec_profile, out)
    except build_output.NotBuilt as e:
        if profile:
            raise
        p = e.problems[0]
        raise UserError("--profile", f"not given, so the current release's recorded profile {rec_profile} was taken; "
                        f"{p.reason}", "pass --profile and --out of the current release's build (or --gate "
                        "<its build>/gate). " + p.fix) from None


def _check_probe_unit_fits(server, unit: str, state: dict | None, prof_name: str) -> None:
    """UserError on ``--unit`` (exit 2, nothing recorded) when the probe of ``unit`` would be judged against another
    build: releases.json records it as built from a profile other than ``prof_name`` (the reference and the bar come
    from that profile's build), or the server has not loaded it (a probe of it could only fail; it was exit 3 with
    Triton's raw 404). Hostile s15 F7: a false FAIL of the current release was recorded."""
    built = next((r.get("profile") for r in (state or {}).get("releases", []) if r.get("unit") == unit), None)
    if built and prof_name and built != prof_name:
        raise UserError("--unit", f"{unit} was built from profile {built}, not {prof_name}: its probe would be judged "
                        f"against {prof_name}'s reference outputs and bar, and recorded.",
                        f"pass --profile {built} (and --out of its build), or leave --unit out.")
    try:
        state_now = server.loaded_models().get(unit)
    except Exception:  # the server cannot list its models: the probe itself says why it fails
        return
    if state_now != "READY":
        raise UserError("--unit", f"{unit} is not loaded on the server at {server.http_url} ({state_now or 'unknown to it'}), "
                        "so no request can reach it.", "probe a unit that serves (leave --unit out: every route's "
                        "unit), or load it with a promote or rollback.")


def _recover_for_probe(repo_dir: Path, server, state: dict) -> list[str]:
    """Before a recorded probe: the live ``server`` made to serve what releases.json records (``release_recover.recover``:
    a crashed promote or rollback left the live ensemble or route.json on an uncommitted unit, and a probe of the
    recorded unit would pass while the traffic went elsewhere: hostile s15 F1). Returns what was done. A repository
    this user cannot write is only checked: UserError (exit 2) when the live ensemble calls another unit than the
    current release."""
    from precision_pipeline.serving import release
    from precision_pipeline.serving.release_live import live_unit, verify_server
    from precision_pipeline.serving.release_recover import recover

    if os.access(repo_dir.resolve().parent, os.W_OK):
        fixed = recover(repo_dir, server)  # waits for a release command holding the lock: the current may move
        now = (release.read_state(repo_dir) or {}).get("current")
        if now != state["current"]:  # hostile s17 F15: judged the new unit with the old release's build and bar
            raise UserError("--repo", f"the current release changed from {state['current']} to {now} while this probe "
                            "started (a promote or rollback finished meanwhile); its profile and build were chosen "
                            "for the old one, so nothing was probed.", "run the probe again.")
        return fixed
    verify_server(repo_dir, server)
    live = live_unit(server)
    if live not in (None, state["current"]):
        raise UserError("--url", f"the server at {server.http_url} sends the ensemble's requests to {live}, but "
                        f"releases.json records {state['current']} as current (an interrupted promote or rollback), and "
                        f"{repo_dir} is read-only, so it cannot be recovered here; nothing was probed.",
                        "run `invoke rollback --url ...` (or promote) where the repository is writable, then probe again.")
    return []


def _probe_one(con, server, unit: str, pset, repo_dir, prof_name: str, exporter, route: str) -> dict:
    """One ``probe_and_record`` run of ``unit`` (serving ``route``: ``probe.route_units``), printed; a failure names
    the unit and its route. Returns the run's summary."""
    from precision_pipeline.serving import probe as pr
    from precision_pipeline.serving.release_live import loaded_models

    states = loaded_models(server)  # {}: not read (the probe's own request then says why)
    if states and (st := states.get(unit, "not loaded")) != "READY":  # hostile s18b F7: exit 3 on a raw 404
        raise UserError("probe", f"{unit} is {st.lower()} on the server at "
                        f"{server.http_url} (a kept release or another build's unit, not serving), so nothing was "
                        "probed: a probe asks the unit itself.", "probe the current release (leave --profile out), roll "
                        "this build out (`invoke rollout`), or roll back to it first.")
    rec = pr.probe_and_record(server, unit, pset, repo_dir=repo_dir, profile=prof_name, exporter=exporter, route=route)
    s = rec["probe"]
    on = _on_route(route)
    if "error" in s:
        con.print(f"[red]probe of {unit}{on} failed[/]: {s['error']}")
    else:
        con.print(f"probe {unit}{on} ({prof_name or '?'}, {s.get('method')}): KL P99 {_num(s['kl_p99'])} (max "
                  f"{s['checks']['kl_p99']['threshold']}), top-1 {_num(s['top1'], 3)} (min {s['checks']['top1']['threshold']}), {s['tokens']} tokens, "
                  f"{s['prompts']} prompts, {s['ms']:.0f} ms -> {'pass' if s['passed'] else 'FAIL'}"
                  + ("" if repo_dir is not None else " (not recorded: no releases.json)"), soft_wrap=True)
    if "not_recorded" in rec:
        con.print(f"[yellow]note[/]: releases.json cannot be written ({rec['not_recorded']}); the result is "
                  + (f"recorded in {rec['recorded_in']}" if rec["recorded_in"] else "only printed above"), soft_wrap=True)
    return s


def _on_route(route) -> str:
    """`` (route R)`` for a probe of a unit that serves routing rules ``R`` (``probe.route_units``), else ``""``."""
    return f" (route {route})" if route else ""


def _num(v, digits: int = 4) -> str:
    """A probe number for the console: ``n/a`` when not measured (an LLM-API unit has no KL: serving/probe.py)."""
    return "n/a" if v is None else f"{v:.{digits}f}"


def releases(repo=None) -> None:
    """releases.json of the serving repository and what is on disk, as JSON."""
    from precision_pipeline.serving import release

    listed = release.list_releases(serving_repo(repo))  # list_releases refuses a non-repository
    print(json.dumps(listed, indent=2))
    for p in listed["problems"]:  # on stderr: the JSON on stdout stays parseable
        console(stderr=True).print(f"[yellow]warning[/]: {p}", soft_wrap=True)


__all__ = ["serving_repo", "serve", "promote", "rollback", "rollout", "probe", "releases"]
