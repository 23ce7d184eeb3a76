"""Releases: promote / rollback / fallback / retention, crash at every step, and a live switch on a real server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from precision_pipeline.serving import pack, release, release_configs, release_recover, release_state
from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.profile import load_profile

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def units(tmp_path_factory, default_model_dir):
    """Three packed repositories (different plans -> different engine hashes) of the default model."""
    from tests.serving.test_pack import make_plan, with_limits

    base = tmp_path_factory.mktemp("units")
    prof = load_profile("bf16-h100")
    out = []
    for i, mb in enumerate((64, 32, 16)):
        plan = with_limits(make_plan(prof), max_batch_size=mb)
        d = base / f"build{i}"
        res = pack.pack_repository(plan, prof, Path(default_model_dir), d / "no-checkpoint", d / "engine", False,
                                   d / "model_repository", str(d))
        out.append(res)
    assert len({r.engine_unit for r in out}) == 3
    return out


def new_repo(tmp_path, units, fallback=True, warm=False, keep=2) -> Path:
    repo = tmp_path / "serving" / "model_repository"
    release_recover.init_serving_repo(repo, units[0].out_dir, profile="bf16-h100", gate={"kl_mean": 0.001},
                              fallback_repo=units[1].out_dir if fallback else None, warm_fallback=warm, keep_releases=keep)
    return repo


def test_init_promote_rollback_files(tmp_path, units):
    a, b, c = (u.engine_unit for u in units)
    repo = new_repo(tmp_path, units)
    st = release_state.read_state(repo)
    assert st["current"] == a and st["fallback"] == b and release_state.state_path(repo) == repo.parent / "releases.json"
    pack.check_repository(repo)
    # paths in the serving repository point into it
    cfg = pack.parse_model_config((repo / a / "config.pbtxt").read_text(), "x")
    assert pack.config_params(cfg)["gpt_model_path"] == f"{repo.resolve()}/{a}/engine"
    pre = pack.parse_model_config((repo / "preprocessing" / "config.pbtxt").read_text(), "x")
    assert pack.config_params(pre)["tokenizer_dir"] == f"{repo.resolve()}/preprocessing/tokenizer"
    # the source pack output is not modified (configs were replaced, not edited through hard links)
    src = pack.parse_model_config((units[0].out_dir / a / "config.pbtxt").read_text(), "x")
    assert pack.config_params(src)["gpt_model_path"] == f"{units[0].out_dir}/{a}/engine"

    t = release.promote(repo, units[2].out_dir, profile="bf16-h100", gate={"kl_mean": 0.002}, promoted_by="test")
    assert t["unit"] == c and release_configs.current_of_configs(repo) == (c, c)
    # Triton refuses an ensemble larger than a step: the ensemble follows the unit's max_batch_size (16)
    assert pack.parse_model_config((repo / "ensemble" / "config.pbtxt").read_text(), "x").max_batch_size == 16
    st = release_state.read_state(repo)
    assert st["current"] == c and st["releases"][-1]["gate"] == {"kl_mean": 0.002} and st["releases"][-1]["promoted_by"] == "test"
    with pytest.raises(UserError, match="already the current"):
        release.promote(repo, units[2].out_dir)
    release.rollback(repo)                     # previous release
    assert release_configs.current_of_configs(repo) == (a, a)
    release.rollback(repo, fallback=True)
    assert release_configs.current_of_configs(repo) == (b, b) and release_state.read_state(repo)["current"] == b
    release.rollback(repo, to=c[len(pack.UNIT_PREFIX):len(pack.UNIT_PREFIX) + 6])  # by hash prefix
    assert release_state.read_state(repo)["current"] == c
    with pytest.raises(UserError, match="no single release"):
        release.rollback(repo, to="ffffffffffff")
    release.rollback(repo, to=f"{a}/")  # as the shell completes a folder's name (hostile s17c E32)
    assert release_state.read_state(repo)["current"] == a
    release.rollback(repo, to=c[len(pack.UNIT_PREFIX):len(pack.UNIT_PREFIX) + 6].upper())  # hex in capitals (E34)
    assert release_state.read_state(repo)["current"] == c
    assert [h["action"] for h in release_state.read_state(repo)["history"]] == ["init", "promote"] + ["rollback"] * 5


def test_retention_keeps_n_previous_and_fallback(tmp_path, units):
    a, b, c = (u.engine_unit for u in units)
    repo = new_repo(tmp_path, units, fallback=False, keep=0)
    release.promote(repo, units[1].out_dir)
    assert sorted(p.name for p in repo.iterdir() if pack.is_unit(p.name)) == [b]
    repo2 = new_repo(tmp_path / "x", units, fallback=True, keep=1)
    release.promote(repo2, units[2].out_dir)
    on_disk = sorted(p.name for p in repo2.iterdir() if pack.is_unit(p.name))
    assert on_disk == sorted([a, b, c])  # current c, 1 previous (a), fallback b
    with pytest.raises(UserError, match="no previous release"):
        release.rollback(repo, server=None)


@pytest.mark.parametrize("step", release_state.STEPS)
def test_crash_at_each_step_leaves_loadable_repo(tmp_path, units, step):
    a, c = units[0].engine_unit, units[2].engine_unit
    repo = new_repo(tmp_path, units)
    code = ("import sys; from pathlib import Path; from precision_pipeline.serving import release; "
            f"release.promote(Path({str(repo)!r}), Path({str(units[2].out_dir)!r}), promoted_by='crash-test')")
    env = dict(os.environ, **{release_state.CRASH_ENV: step})
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT / "build", env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == release_state.CRASH_EXIT, p.stderr
    committed = release_state.STEPS.index(step) >= release_state.STEPS.index("commit")
    want = c if committed else a
    assert release_state.read_state(repo)["current"] == want
    release_recover.recover(repo)
    pack.check_repository(repo)
    assert release_configs.current_of_configs(repo) == (want, want)
    assert not [q.name for q in repo.iterdir() if q.name.startswith(".")]
    # the repository is usable afterwards: the promote can be redone (or was done)
    if not committed:
        release.promote(repo, units[2].out_dir)
    assert release_state.read_state(repo)["current"] == c


# ---- live: one real server for this part


def _assert_smoke(r: dict) -> None:
    """A real smoke test's result: non-empty text of 1..8 tokens (max_tokens 8), timed."""
    assert set(r) == {"text", "tokens", "ms"}, r
    assert r["text"].strip() and 1 <= r["tokens"] <= 8 and r["ms"] > 0, r


@pytest.mark.slow
def test_live_crash_recovery_promote_and_warm_rollback(tmp_path, units):
    from precision_pipeline.serving.triton_server import serve, text_request

    a, b, c = (u.engine_unit for u in units)
    repo = new_repo(tmp_path, units, fallback=True, warm=True)
    # crash a promote after both configs were rewritten on disk but before the commit
    code = ("from pathlib import Path; from precision_pipeline.serving import release; "
            f"release.promote(Path({str(repo)!r}), Path({str(units[2].out_dir)!r}))")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT / "build", env=dict(os.environ, **{release_state.CRASH_ENV: "bls_config"}),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == release_state.CRASH_EXIT, p.stderr
    from precision_pipeline.serving.triton_server import free_port

    # serve() runs recover() (re-points ensemble/BLS at releases.json's current) and loads that release
    srv = serve(repo, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(), block=False,
                log_file=tmp_path / "server.log")
    try:
        print(f"\n[release] server with 2 units ready in {srv.start_s:.1f} s")

        def ask():
            cl = srv.http_client()
            try:
                text = cl.infer("ensemble", text_request("What is the capital of France?", 8)).as_numpy(
                    "text_output").reshape(-1)[0].decode()
                steps = [s["model_name"] for s in cl.get_model_config("ensemble")["ensemble_scheduling"]["step"]]
                return text, steps[1]
            finally:
                cl.close()

        text, unit = ask()
        assert unit == a and "Paris" in text                        # the old release serves after the crash
        assert srv.loaded_models().get(b) == "READY"                 # warm fallback loaded
        t = release.promote(repo, units[2].out_dir, server=srv, promoted_by="live-test")
        print(f"[release] promote: {json.dumps({k: v for k, v in t.items() if k != 'smoke'})}")
        assert ask() == (text, c)
        _assert_smoke(t["smoke"])                                    # promote smoke-tested the new unit
        assert srv.loaded_models().get(a) != "READY"                 # previous release unloaded (kept on disk)
        t = release.rollback(repo, fallback=True, server=srv)
        print(f"[release] warm rollback: {json.dumps(t)}")
        assert t["warm"] and "load_ms" not in t and ask()[1] == b  # warm: no load, but
        _assert_smoke(t["smoke"])                                    # smoke-tested before the switch (hostile s7 #54)
        assert t["verified"] is True                                 # and its files checked against their record
        t = release.rollback(repo, to=a, server=srv)
        print(f"[release] cold rollback: {json.dumps({k: v for k, v in t.items() if k != 'smoke'})}")
        assert not t["warm"] and ask()[1] == a
        _assert_smoke(t["smoke"])                                    # a cold rollback target is smoke-tested
    finally:
        srv.stop()
