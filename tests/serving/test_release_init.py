"""The first promote (``init_serving_repo``) under a crash at each of its steps (issue 11 item 4).

Every crash state is either the old state (no repository) or the new one (a repository with its
releases.json); ``recover()`` (and the next promote / rollback / init) completes an interrupted one.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import pack, release, release_configs, release_recover, release_state
from tests.serving.test_release import REPO_ROOT, units  # noqa: F401  (the module-scoped packed repositories)


def _init_crashing_at(repo, packed, step: str) -> subprocess.CompletedProcess:
    code = ("from pathlib import Path; from precision_pipeline.serving import release_recover; "
            f"release_recover.init_serving_repo(Path({str(repo)!r}), Path({str(packed)!r}), profile='bf16-h100', by='crash-test')")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT / "build", capture_output=True, text=True,
                          env=dict(os.environ, **{release_state.CRASH_ENV: step}), timeout=300)


@pytest.mark.parametrize("step", release_state.INIT_STEPS)
def test_crash_during_first_promote_is_old_or_new_state(tmp_path, units, step):  # noqa: F811
    a, c = units[0].engine_unit, units[2].engine_unit
    repo = tmp_path / "serving" / "model_repository"
    p = _init_crashing_at(repo, units[0].out_dir, step)
    assert p.returncode == release_state.CRASH_EXIT, p.stderr
    committed = step != "init_stage"
    if step == "init_swap":  # killed between the renames
        assert not repo.exists() and release_state.read_state(repo) is None
    fixed = release_recover.recover(repo)
    assert bool(fixed) == committed, fixed
    assert not [q.name for q in repo.parent.iterdir() if ".tmp-" in q.name or ".old-" in q.name or q.name.endswith(".swap.json")]
    if not committed:  # old state: nothing there, and the first promote can simply be done
        assert not repo.exists() and release_state.read_state(repo) is None
        release_recover.init_serving_repo(repo, units[0].out_dir, profile="bf16-h100")
    st = release_state.read_state(repo)
    assert st["current"] == a and [h["action"] for h in st["history"]] == ["init"]
    pack.check_repository(repo)
    assert release_configs.current_of_configs(repo) == (a, a)
    # every command can use it: promote, then roll back
    release.promote(repo, units[2].out_dir)
    assert release_state.read_state(repo)["current"] == c
    release.rollback(repo)
    assert release_state.read_state(repo)["current"] == a


def test_repeating_an_interrupted_first_promote_completes_it(tmp_path, units):  # noqa: F811
    """What `invoke promote` does again after the crash: no "already exists", the same release."""
    a = units[0].engine_unit
    repo = tmp_path / "serving" / "model_repository"
    assert _init_crashing_at(repo, units[0].out_dir, "init_swap").returncode == release_state.CRASH_EXIT
    st = release_recover.init_serving_repo(repo, units[0].out_dir, profile="bf16-h100")
    assert st["current"] == a and release_state.read_state(repo)["current"] == a
    with pytest.raises(UserError, match="already exists"):  # a different unit is a real conflict
        release_recover.init_serving_repo(repo, units[2].out_dir)


def test_a_first_promote_of_another_unit_after_an_interrupted_one_says_it_completed_it(tmp_path, units):  # noqa: F811
    """Hostile s16 H7: the next first promote (another build) completed the interrupted one, then said "nothing was
    changed ... already exists"; now the refusal says what the recovery did, and the fix is the same command again."""
    repo = tmp_path / "serving" / "model_repository"
    assert _init_crashing_at(repo, units[0].out_dir, "init_swap").returncode == release_state.CRASH_EXIT
    with pytest.raises(UserError, match="already exists") as ei:
        release_recover.init_serving_repo(repo, units[2].out_dir)
    assert ei.value.done == (f"first promote into {repo} completed (interrupted before releases.json)",)
    assert "run the same promote again" in ei.value.problems[0].fix
    assert release_state.read_state(repo)["current"] == units[0].engine_unit


def test_repository_without_releases_json_says_how_to_proceed(tmp_path, units):  # noqa: F811
    repo = tmp_path / "serving" / "model_repository"
    (repo / "ensemble").mkdir(parents=True)  # e.g. left by an earlier version's interrupted first promote
    with pytest.raises(UserError, match="has no releases.json") as e:
        release_recover.init_serving_repo(repo, units[0].out_dir)
    assert "delete" in e.value.problems[0].fix
