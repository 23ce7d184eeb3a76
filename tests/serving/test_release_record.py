"""releases.json as a typed record, what counts as a release, and the fallback's acceptance (issue 25, hostile
round s8), on files only (no server).

- A damaged releases.json (a field of the wrong type, a unit name that is no unit) is refused with exit 2 naming
  the field, before anything is changed (s8 #41-#44).
- Only a failed check is a verdict on a unit: an interrupt, a hand abort or a crash of a rollout of an earlier
  release keeps it a release for rollback and retention (s8 #61, #62, #72).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import release, release_recover, release_rollout, release_state
from tests.serving import test_release_safety as safety
from tests.serving.test_release_safety import on_disk, rejected_rollout, serving_repo

units4 = safety.units4  # the module's four packed units (fixture)
ROOT_REPO = Path("/nonexistent/serving/model_repository")


# ---- what counts as a release (s8 #61, #62, #72)


@pytest.mark.parametrize("how", ["interrupted", "manual abort", "error", "crash"])
def test_a_release_whose_later_rollout_was_not_judged_stays_a_release(tmp_path, units4, how):
    """A (init), B promoted, a rollout of A (a real earlier release) ended by Ctrl-C / `--abort` / an error /
    a crash (recovered): A is still the previous release (rollback --to A and plain rollback take it) and the
    next promote's retention keeps it (keep_releases 2: B and A)."""
    a, b, c, _ = (u.engine_unit for u in units4)
    repo = serving_repo(tmp_path, units4[0], keep=2)
    release.promote(repo, units4[1].out_dir)                     # B current, A previous
    if how == "crash":
        release_rollout.begin_rollout(repo, units4[0].out_dir, steps=(50, 100))
        st = release_state.read_state(repo)
        st["rollout"]["pid"] = 2 ** 22 + 12345                    # the rollout's process died (kill -9)
        release_state.write_state(repo, st)
        release_recover.recover(repo)
    else:
        rejected_rollout(repo, units4[0], failed_check=how, percent=50)
    st = release_state.read_state(repo)
    assert st["history"][-1]["action"] == "rollout_abort" and release_state.rejected_units(st) == {}
    t = release.promote(repo, units4[2].out_dir)                 # C current: keep B and A
    assert t["removed"] == [] and on_disk(repo) == sorted([a, b, c])
    assert release.rollback(repo)["unit"] == b                   # the previous release
    assert release.rollback(repo, to=a[len("tensorrt_llm_"):][:6])["unit"] == a


def test_a_release_rejected_by_a_later_failed_check_is_no_rollback_target(tmp_path, units4):
    """A failed check is a verdict: a rollout of A (an earlier release) rejected by the probe makes A no rollback
    target and no kept release, until a later rollout of it passes."""
    a, b, c, _ = (u.engine_unit for u in units4)
    repo = serving_repo(tmp_path, units4[0], keep=2)
    release.promote(repo, units4[1].out_dir)
    rejected_rollout(repo, units4[0], failed_check="probe:kl_p99", percent=5)
    assert release_state.rejected_units(release_state.read_state(repo)) == {a: "probe:kl_p99 at 5 %"}
    with pytest.raises(UserError, match=r"rolled back \(probe:kl_p99 at 5 %\)"):
        release.rollback(repo, to=a)
    with pytest.raises(UserError, match="no previous release"):
        release.rollback(repo)
    t = release.promote(repo, units4[2].out_dir)
    assert t["removed"] == [a] and on_disk(repo) == sorted([b, c])


def test_a_hand_aborted_candidate_that_was_never_a_release_still_never_counts(tmp_path, units4):
    a, _, c, _ = (u.engine_unit for u in units4)
    repo = serving_repo(tmp_path, units4[0])
    rejected_rollout(repo, units4[2], failed_check="interrupted", percent=50)
    with pytest.raises(UserError, match="no previous release"):
        release.rollback(repo)
    with pytest.raises(UserError, match="not a release to roll back to") as ei:
        release.rollback(repo, to=c)
    assert "interrupted at 50 %" in ei.value.problems[0].reason


def test_no_previous_release_never_offers_the_fallback_that_is_current(tmp_path, units4):
    """s8 #72: the fix offered was `--fallback` although the fallback was the current release."""
    a, b, _, _ = (u.engine_unit for u in units4)
    repo = tmp_path / "serving" / "model_repository"
    release_recover.init_serving_repo(repo, units4[0].out_dir, profile="bf16-h100", fallback_repo=units4[1].out_dir)
    assert release.rollback(repo, fallback=True)["unit"] == b     # the fallback current, A previous
    rejected_rollout(repo, units4[0], failed_check="probe:kl_p99", percent=5)
    with pytest.raises(UserError, match="no previous release") as ei:
        release.rollback(repo)
    assert "--fallback" not in ei.value.problems[0].fix and "promote a build" in ei.value.problems[0].fix


# ---- releases.json is read through one typed record (s8 #41-#44)


def _edit(state: dict, damage: str) -> tuple[dict, str]:
    """``state`` damaged as a hand edit would; returns it and the field the refusal must name."""
    if damage == "current-fixed-model":          # s8 #41: the ensemble would call preprocessing twice
        state["current"] = "preprocessing"
        return state, "field current"
    if damage == "release-a-string":             # s8 #42
        state["releases"].append("tensorrt_llm_0123456789ab")
        return state, f"field releases[{len(state['releases']) - 1}]"
    if damage == "rollout-a-string":             # s8 #43
        state["rollout"] = "yes"
        return state, "field rollout"
    if damage == "history-from-a-list":          # s8 #44
        state["history"].append({"action": "promote", "from": [1], "to": 5, "time": "", "by": "x", "ms": 0})
        return state, f"field history[{len(state['history']) - 1}].from"
    if damage == "fallback-ensemble":
        state["fallback"] = "ensemble"
        return state, "field fallback"
    if damage == "keep-text":
        state["keep_releases"] = "2"
        return state, "field keep_releases"
    if damage == "unit-files-row":
        unit = next(iter(state["unit_files"]))
        state["unit_files"][unit]["config.pbtxt"] = ["12", "abc"]
        return state, f"field unit_files.{unit}"
    raise AssertionError(damage)


DAMAGES = ["current-fixed-model", "release-a-string", "rollout-a-string", "history-from-a-list", "fallback-ensemble",
           "keep-text", "unit-files-row"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_hand_edited_releases_json_is_refused_naming_the_field_before_anything_changes(tmp_path, units4, damage):
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)          # releases.json.prev exists
    path = release_state.state_path(repo)
    state, field = _edit(json.loads(path.read_text()), damage)
    path.write_text(json.dumps(state))
    text = path.read_text()
    configs = {p: p.read_text() for p in (repo / "ensemble" / "config.pbtxt", repo / "tensorrt_llm_bls" / "config.pbtxt",
                                          repo / "tensorrt_llm_bls" / "route.json") if p.is_file()}
    calls = [lambda: release.rollback(repo), lambda: release.rollback(repo, fallback=True),
             lambda: release.promote(repo, units4[2].out_dir), lambda: release_recover.recover(repo),
             lambda: release_rollout.begin_rollout(repo, units4[2].out_dir, steps=(100,)), lambda: release.list_releases(repo)]
    for call in calls:
        with pytest.raises(UserError) as ei:
            call()
        p = ei.value.problems[0]
        assert p.field == str(path) and p.reason.startswith(field) and "damaged" in p.reason, p.reason
        assert f"cp {path}.prev {path}" in p.fix
    assert path.read_text() == text and on_disk(repo) == sorted(u.engine_unit for u in units4[:2])
    assert {p: p.read_text() for p in configs} == configs   # nothing re-pointed


def test_a_damaged_field_exits_2_without_a_traceback(tmp_path, units4):
    repo = serving_repo(tmp_path, units4[0])
    path = release_state.state_path(repo)
    state, _ = _edit(json.loads(path.read_text()), "release-a-string")
    path.write_text(json.dumps(state))
    r = safety.inv("rollback", "--repo", str(repo))
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr and "field releases[1]" in (r.stdout + r.stderr)


def test_both_kinds_of_unit_names_are_release_units():
    """The one unit name pattern: engine units and the LLM-API units of issue 28; nothing else."""
    ok = {"current": "llm_api_0123456789ab", "fallback": "tensorrt_llm_ba9876543210",
          "releases": [{"unit": "llm_api_0123456789ab", "kind": "release", "route": "llm_api"}], "history": []}
    assert release_state.check_state(release_state.state_path(ROOT_REPO), ok) is ok   # extra fields are kept
    for bad in ("tensorrt_llm_0123456789AB", "llm_api_0123", "tensorrt_llm_bls", "ensemble", "llm_api_0123456789ab/.."):
        with pytest.raises(UserError, match="a unit name is tensorrt_llm_ or llm_api_"):
            release_state.check_state(release_state.state_path(ROOT_REPO), {**ok, "current": bad})


# ---- a refused command never ends a live rollout's canary (s8 #76, #78, #87)


def test_a_refused_command_leaves_a_live_rollouts_canary_in_route_json(tmp_path, units4):
    """The rollout's process is alive (this one): recovery at the start of promote/rollback/recover must not rewrite
    route.json without the canary (the step would measure a candidate that gets no request and pass)."""
    a, _, c, _ = (u.engine_unit for u in units4)
    repo = serving_repo(tmp_path, units4[0])
    release_rollout.begin_rollout(repo, units4[2].out_dir, steps=(50, 100))
    release_rollout.set_rollout_percent(repo, 50)
    route = repo / "tensorrt_llm_bls" / "route.json"
    canary = {"tensorrt_llm_model_name": a, "canary": {"tensorrt_llm_model_name": c, "percent": 50}}
    assert json.loads(route.read_text()) == canary
    for call in (lambda: release.rollback(repo), lambda: release.promote(repo, units4[1].out_dir)):
        with pytest.raises(UserError, match="in progress"):
            call()
        assert json.loads(route.read_text()) == canary
    assert units4[1].engine_unit not in on_disk(repo)               # s8 #74: the refused promote installed nothing
    release_recover.recover(repo)
    assert json.loads(route.read_text()) == canary
    route.write_text(json.dumps({"tensorrt_llm_model_name": a}))     # a lost canary is put back as recorded
    release_recover.recover(repo)
    assert json.loads(route.read_text()) == canary
    release_rollout.abort_rollout(repo, failed_check="manual abort")
    assert json.loads(route.read_text()) == {"tensorrt_llm_model_name": a}


# ---- a Ctrl-C during the candidate's load or smoke test unloads it (s8 #59)


@pytest.mark.parametrize("where", ["load", "smoke"])
def test_an_interrupt_during_the_candidates_load_or_smoke_unloads_it(tmp_path, units4, monkeypatch, where):
    from precision_pipeline.serving import release_live
    from tests.serving.test_release_planted import RecordingServer

    repo = serving_repo(tmp_path, units4[0])
    a, b = units4[0].engine_unit, units4[1].engine_unit
    before = release_state.state_path(repo).read_text()

    def interrupted(*args, **kw):
        raise KeyboardInterrupt
    if where == "smoke":
        monkeypatch.setattr(release_live, "smoke_test", interrupted)
    for call in (lambda s: release_rollout.begin_rollout(repo, units4[1].out_dir, server=s, steps=(50, 100)),
                 lambda s: release.promote(repo, units4[1].out_dir, server=s)):
        srv = RecordingServer(repo, ready={"ensemble", "preprocessing", a})
        if where == "load":
            real = srv.load
            monkeypatch.setattr(srv, "load", lambda m: real(m) if m != b else (real(m), interrupted()))
        with pytest.raises(KeyboardInterrupt):
            call(srv)
        assert ("unload", b) in [x[:2] for x in srv.calls]
        assert release_state.state_path(repo).read_text() == before


def test_a_first_promote_into_a_path_triton_cannot_serve_is_refused(tmp_path, units4):
    """s8 #117: build refuses such an --out, but the first promote created a serving repository under a space /
    non-ASCII path (rc 0) that `serve` could never bring up (the Python stubs' command line splits it)."""
    for name in ("h-repo sp", "h-repo-ü"):
        repo = tmp_path / name / "model_repository"
        with pytest.raises(UserError) as ei:
            release_recover.init_serving_repo(repo, units4[0].out_dir, profile="bf16-h100")
        assert ei.value.problems[0].field == "--repo" and "never become ready" in ei.value.problems[0].reason
        assert not (tmp_path / name).exists()


def test_rollback_to_and_fallback_together_is_refused(tmp_path, units4):
    """s8 #111: --fallback silently won over --to."""
    repo = tmp_path / "serving" / "model_repository"
    release_recover.init_serving_repo(repo, units4[0].out_dir, profile="bf16-h100", fallback_repo=units4[1].out_dir)
    release.promote(repo, units4[2].out_dir)
    before = release_state.state_path(repo).read_text()
    with pytest.raises(UserError) as ei:
        release.rollback(repo, to=units4[0].engine_unit, fallback=True)
    assert ei.value.problems[0].field == "--to" and "--fallback" in ei.value.problems[0].reason
    assert release_state.state_path(repo).read_text() == before


def test_a_garbled_route_json_is_rewritten_from_the_record(tmp_path, units4):
    """s8 #109: route.json holding invalid JSON made every command exit 1 (JSONDecodeError). It is derived from
    releases.json: recovery rewrites it; the listing shows it as unreadable."""
    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    route = repo / "tensorrt_llm_bls" / "route.json"
    route.write_text("garbage{")
    assert release.list_releases(repo)["configs"] == (b, f"{b}|route.json:(unreadable)")
    assert release.rollback(repo)["unit"] == a
    assert json.loads(route.read_text()) == {"tensorrt_llm_model_name": a}


def test_a_missing_ensemble_or_bls_config_is_refused_naming_it(tmp_path, units4):
    """s8 #108: a serving repository whose ensemble/ folder was deleted: rollback exited 1 (FileNotFoundError)."""
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    before = release_state.state_path(repo).read_text()
    for model in ("ensemble", "tensorrt_llm_bls"):
        cfg = repo / model / "config.pbtxt"
        text = cfg.read_text()
        cfg.unlink()
        with pytest.raises(UserError) as ei:
            release.rollback(repo)
        p = ei.value.problems[0]
        assert p.field == str(cfg) and "missing" in p.reason and "invoke promote" in p.fix
        assert release_state.state_path(repo).read_text() == before
        cfg.write_text(text)


def test_a_probe_is_recorded_only_in_the_repository_its_server_serves(tmp_path, units4, monkeypatch):
    """s8 #101: `probe --repo G --url <server of A>` recorded A's measurement in G's history."""
    from precision_pipeline.serving import probe
    from tests.serving.test_release_planted import RecordingServer

    repo_a = serving_repo(tmp_path / "a", units4[0])
    repo_g = serving_repo(tmp_path / "g", units4[0])
    srv = RecordingServer(repo_a, ready={"ensemble", "preprocessing", units4[0].engine_unit})
    monkeypatch.setattr(probe, "run_probe", lambda *a: (_ for _ in ()).throw(AssertionError("probed")))
    before = release_state.state_path(repo_g).read_text()
    with pytest.raises(UserError) as ei:
        probe.probe_and_record(srv, units4[0].engine_unit, None, repo_dir=repo_g, profile="bf16-h100")
    assert ei.value.problems[0].field == "--url" and "does not serve" in ei.value.problems[0].reason
    assert release_state.state_path(repo_g).read_text() == before


def test_reconcile_keeps_the_warm_fallback_loaded_after_its_aborted_rollout(tmp_path, units4):
    """s8 #127: a hand-aborted rollout of the warm fallback's unit (never current: not a release) made the next
    command's reconcile unload the warm fallback, so `rollback --fallback` became a cold load."""
    from tests.serving.test_release_planted import RecordingServer

    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = tmp_path / "serving" / "model_repository"
    release_recover.init_serving_repo(repo, units4[0].out_dir, profile="bf16-h100", fallback_repo=units4[1].out_dir,
                                      warm_fallback=True)
    rejected_rollout(repo, units4[1], failed_check="manual abort", percent=50)
    srv = RecordingServer(repo, ready={"ensemble", "preprocessing", a, b})
    release_recover.recover(repo, server=srv)
    assert ("unload", b) not in [x[:2] for x in srv.calls] and b in srv.ready


def test_a_releases_json_that_is_a_folder_is_refused(tmp_path, units4):
    """s8 #128/#129: IsADirectoryError, exit 1."""
    repo = tmp_path / "serving" / "model_repository"
    repo.mkdir(parents=True)
    release_state.state_path(repo).mkdir()
    for call in (lambda: release_state.read_state(repo), lambda: release.list_releases(repo),
                 lambda: release_recover.init_serving_repo(repo, units4[0].out_dir)):
        with pytest.raises(UserError) as ei:
            call()
        assert ei.value.problems[0].field == str(release_state.state_path(repo)) and "is a folder, not a file" in str(ei.value)


def test_a_second_repository_beside_a_served_one_is_refused(tmp_path, units4):
    """Hostile round s11: `promote --repo DIR/A`, then `promote --repo DIR/B` (releases.json lies beside the
    repository, so B read A's record) ended in a FileNotFoundError traceback and left B half made. Refused now
    (exit 2, --repo), nothing written; A and its record unchanged. A repository with another id beside the record
    is refused the same way."""
    import shutil

    from precision_pipeline.core.errors import EXIT_INVALID

    repo = serving_repo(tmp_path, units4[0])
    before = release_state.state_path(repo).read_text()
    other = repo.parent / "B"
    with pytest.raises(UserError) as ei:
        release.promote(other, units4[1].out_dir)
    p = ei.value.problems[0]
    assert ei.value.exit_code == EXIT_INVALID and p.field == "--repo" and "does not exist" in p.reason
    assert "one folder holds one serving repository" in p.reason and "a folder of its own" in p.fix
    assert not other.exists() and release_state.state_path(repo).read_text() == before
    shutil.copytree(repo, other, symlinks=True)
    cfg = other / "ensemble" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace(release_state.read_state(repo)["repository_id"], "0123456789abcdef"))
    with pytest.raises(UserError) as ei:
        release_state.read_state(other)
    assert "is another repository (its id 0123456789abcdef" in ei.value.problems[0].reason


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_copy_beside_a_repository_is_refused_and_the_original_is_untouched(tmp_path, units4):
    """Hostile round s11 F3: `cp -a A D` in the same folder shares A's releases.json and its repository_id, so
    `rollback --repo D` rewrote A's record, and a later refused command on A re-pointed A's configs to the unit D's
    rollback recorded. The record names its folder (repository_folder): every command on D is refused (exit 2,
    --repo, nothing written on either side); A keeps working."""
    import shutil

    from precision_pipeline.core.errors import EXIT_INVALID

    a = serving_repo(tmp_path, units4[0])
    release.promote(a, units4[1].out_dir)
    assert release_state.read_state(a)["repository_folder"] == "model_repository"
    d = a.parent / "D"
    shutil.copytree(a, d, symlinks=True)
    rec, before_a, before_d = release_state.state_path(a), _files(a), _files(d)
    before = rec.read_bytes()
    for call in (lambda: release.rollback(d), lambda: release.list_releases(d), lambda: release_recover.recover(d),
                 lambda: release.promote(d, units4[2].out_dir), lambda: release_state.read_state(d)):
        with pytest.raises(UserError) as ei:
            call()
        p = ei.value.problems[0]
        assert ei.value.exit_code == EXIT_INVALID and p.field == "--repo"
        assert p.reason.startswith(f"{rec} is the record of {a.resolve()}, and {d.resolve()} is a copy of it (the same id ")
        assert p.fix.startswith(f"pass --repo {a.resolve()}; give a new repository a folder of its own")
        assert rec.read_bytes() == before and _files(a) == before_a and _files(d) == before_d
    assert release.rollback(a)["unit"] == units4[0].engine_unit  # the original is still served by its record


def test_a_record_from_before_repository_folder_is_adopted_unless_a_copy_makes_it_ambiguous(tmp_path, units4):
    """A releases.json written before repository_folder still works and takes the field at its next write; while a
    copy beside it carries the same id, neither folder is taken as the owner (exit 2), the fix names the field."""
    import shutil

    a = serving_repo(tmp_path, units4[0])
    rec = release_state.state_path(a)
    old = json.loads(rec.read_text())
    del old["repository_folder"]
    rec.write_text(json.dumps(old))
    d = a.parent / "D"
    shutil.copytree(a, d, symlinks=True)
    for repo in (a, d):
        with pytest.raises(UserError) as ei:
            release_state.read_state(repo)
        twin = "D" if repo == a else "model_repository"
        assert f"and {twin} beside {repo.name} carries the same id (a copy)" in ei.value.problems[0].reason
        assert ei.value.problems[0].fix.startswith('add "repository_folder": "<the original\'s folder name>" to ')
    shutil.rmtree(d)
    assert "repository_folder" not in release_state.read_state(a)     # a read adopts nothing
    release.promote(a, units4[1].out_dir)
    assert release_state.read_state(a)["repository_folder"] == "model_repository"


def test_a_renamed_repository_is_refused_with_the_rename_back(tmp_path, units4):
    """`mv model_repository other`: the record names the old folder, which is gone; its configs name it too (engine
    paths, tokenizer_dir), so the fix is the rename back."""
    a = serving_repo(tmp_path, units4[0])
    b = a.rename(a.parent / "other")
    with pytest.raises(UserError) as ei:
        release.list_releases(b)
    p = ei.value.problems[0]
    assert p.reason.startswith(f"{release_state.state_path(a)} is the record of {a.resolve()}, which does not exist, "
                               f"and {b.resolve()} carries its id ")
    assert p.fix.startswith(f"rename it back (`mv {b.resolve()} {a.resolve()}`)")
    b.rename(a)
    assert release.list_releases(a)["state"]["current"] == units4[0].engine_unit


# ---- a signal after the commit point says what took effect (hostile s11 F4)


@pytest.mark.parametrize("where", ["retain", "second write", "before the commit"])
def test_an_interrupt_after_the_commit_says_the_change_took_effect(tmp_path, units4, monkeypatch, capsys, where):
    """Hostile round s11 F4: SIGTERM right after a rollback's commit printed "interrupted; previous artifacts are
    intact" (exit 130) although releases.json and the server had switched. After the commit point (during retention
    or the second write) it is InterruptedAfterCommit: exit 130 and "rolled back to X, interrupted after the switch";
    before it (the switch) still the plain interrupt, and the record is unchanged."""
    from precision_pipeline.cli.console import report
    from precision_pipeline.core.errors import InterruptedAfterCommit

    a, b = units4[0].engine_unit, units4[1].engine_unit
    repo = serving_repo(tmp_path, units4[0])
    release.promote(repo, units4[1].out_dir)
    before = release_state.state_path(repo).read_text()
    writes = []

    def interrupted(*args, **kw):
        raise KeyboardInterrupt
    if where == "retain":
        monkeypatch.setattr(release, "retain", interrupted)
    elif where == "second write":
        # the commit writes through release_switch.commit_switch; the second write (after retention) is release's
        monkeypatch.setattr(release, "write_state", lambda *x: (writes.append(1), interrupted()))
    else:
        monkeypatch.setattr(release, "switch", interrupted)
    if where == "before the commit":
        with pytest.raises(KeyboardInterrupt):
            release.rollback(repo)
        assert release_state.state_path(repo).read_text() == before
        return
    with pytest.raises(InterruptedAfterCommit) as ei:
        release.rollback(repo)
    assert release_state.read_state(repo)["current"] == a and release_state.read_state(repo)["history"][-1]["from"] == b
    capsys.readouterr()
    assert report(ei.value) == 130
    assert "".join(capsys.readouterr()) == (f"interrupted: rolled back to {a}, interrupted after the switch: releases.json "
                                       f"records {a} as the current release. Releases no longer kept may still be on "
                                       "disk; the next promote or rollback removes them.\n")
