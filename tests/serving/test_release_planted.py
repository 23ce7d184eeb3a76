"""Rollback ordering and its smoke test, with a recording stand-in server (planted-bug tests).

* ``releases.json`` is the commit point: it names the new current release only after both configs
  (ensemble, BLS route) were switched; a failure while switching leaves releases.json and the
  configs on the previous release.
* A rollback to a release the server has not loaded (cold) loads it and smoke-tests it BEFORE the
  switch; a failed smoke test changes nothing. A loaded (warm) target costs only the switch.

The stand-in server records, at every call, what releases.json and the configs said then.
"""

from __future__ import annotations

import time

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import release, release_configs, release_live, release_state, release_switch
from tests.serving.test_release import new_repo, units  # noqa: F401  (units: module fixture)


class RecordingServer:
    """The calls ``release.rollback`` makes on a server, with the repository's state at each call."""

    def __init__(self, repo, ready=(), fail_load=None, load_s=0.0):
        self.repo, self.ready, self.fail_load, self.calls, self.load_s = repo, set(ready), fail_load, [], load_s

    def _snap(self, what, name):
        self.calls.append((what, name, release_state.read_state(self.repo)["current"], release_configs.current_of_configs(self.repo)))

    http_url = "recording-server:0"

    def model_config(self, name):
        """The config a real server reports for a loaded model (JSON of its config.pbtxt): this stand-in
        serves ``repo``, so its configs are the files'."""
        from google.protobuf import json_format

        p = self.repo / name / "config.pbtxt"
        return json_format.MessageToDict(release_configs.load_config(p), preserving_proto_field_name=True) if p.is_file() else None

    def loaded_models(self):
        return {n: "READY" for n in self.ready}

    def load(self, name, config=None):
        self._snap("load", name)
        if name == self.fail_load:
            raise RuntimeError(f"load {name} failed")
        time.sleep(self.load_s)
        self.ready.add(name)
        return 0.0

    def unload(self, name):
        self._snap("unload", name)
        self.ready.discard(name)
        return 0.0


@pytest.fixture
def smoke_calls(monkeypatch):
    calls, fail = [], []

    def fake_smoke(server, unit, **kw):
        server._snap("smoke", unit)
        calls.append(unit)
        if fail:
            raise RuntimeError(f"smoke test of {unit}: empty text")
        return {"text": "4", "tokens": 1, "ms": 1.0}

    monkeypatch.setattr(release_live, "smoke_test", fake_smoke)
    return calls, fail


def _promoted(tmp_path, units):  # noqa: F811
    """current c, previous a, fallback b (cold)."""
    repo = new_repo(tmp_path, units)
    release.promote(repo, units[2].out_dir)
    return repo, (u.engine_unit for u in units)


def test_cold_rollback_loads_and_smoke_tests_before_the_switch(tmp_path, units, smoke_calls):  # noqa: F811
    repo, (a, b, c) = _promoted(tmp_path, units)
    srv = RecordingServer(repo, ready={c, "ensemble"})
    t = release.rollback(repo, server=srv)
    assert t["unit"] == a and t["warm"] is False
    assert t["smoke"] == {"text": "4", "tokens": 1, "ms": 1.0}
    assert smoke_calls[0] == [a]
    loads = [x for x in srv.calls if x[0] in ("load", "smoke")]
    # the target is loaded, then smoke-tested while releases.json and both configs still say c
    assert loads[:2] == [("load", a, c, (c, c)), ("smoke", a, c, (c, c))]
    # then the ensemble is reloaded on the switched config; releases.json is written after it
    assert ("load", "ensemble", c, (a, c)) in srv.calls
    assert release_state.read_state(repo)["current"] == a and release_configs.current_of_configs(repo) == (a, a)


def test_failed_smoke_test_on_rollback_changes_nothing(tmp_path, units, smoke_calls):  # noqa: F811
    repo, (a, b, c) = _promoted(tmp_path, units)
    before = release_state.read_state(repo)
    smoke_calls[1].append(True)
    srv = RecordingServer(repo, ready={c, "ensemble"})
    with pytest.raises(UserError, match="loads but fails its smoke request"):
        release.rollback(repo, fallback=True, server=srv)
    assert smoke_calls[0] == [b]
    assert release_state.read_state(repo) == before and release_configs.current_of_configs(repo) == (c, c)
    assert not [x for x in srv.calls if x[:2] == ("load", "ensemble")]


def test_warm_rollback_skips_load_but_smoke_tests(tmp_path, units, smoke_calls):  # noqa: F811
    """A loaded target is not loaded again, but smoke-tested before the switch (hostile s7 #54: being loaded
    proves nothing, e.g. a unit left loaded by a refused rollback)."""
    repo, (a, b, c) = _promoted(tmp_path, units)
    srv = RecordingServer(repo, ready={a, c, "ensemble"})
    t = release.rollback(repo, server=srv)
    assert t["warm"] is True and t["smoke"]["text"] == "4" and smoke_calls[0] == [a]
    assert [x[:2] for x in srv.calls if x[0] in ("load", "smoke")] == [("smoke", a), ("load", "ensemble")]


def test_rollback_without_smoke_flag_does_not_smoke(tmp_path, units, smoke_calls):  # noqa: F811
    repo, (a, b, c) = _promoted(tmp_path, units)
    t = release.rollback(repo, server=RecordingServer(repo, ready={c}), smoke=False)
    assert t["warm"] is False and "smoke" not in t and smoke_calls[0] == []


def test_failed_switch_leaves_releases_json_on_the_previous_release(tmp_path, units, smoke_calls):  # noqa: F811
    repo, (a, b, c) = _promoted(tmp_path, units)
    srv = RecordingServer(repo, ready={a, c, "ensemble"}, fail_load="ensemble")
    with pytest.raises(RuntimeError, match="load ensemble failed"):
        release.rollback(repo, server=srv)
    # the ensemble load saw the switched ensemble config but the old commit point
    assert ("load", "ensemble", c, (a, c)) in srv.calls
    assert release_state.read_state(repo)["current"] == c
    assert release_configs.current_of_configs(repo) == (c, c)  # put back


def test_rollback_commits_only_after_both_configs_switched(tmp_path, units, monkeypatch):  # noqa: F811
    repo, (a, b, c) = _promoted(tmp_path, units)
    seen = []
    real = release_configs.point_bls

    def spy(repo_dir, unit):
        seen.append((unit, release_state.read_state(repo)["current"]))
        return real(repo_dir, unit)

    monkeypatch.setattr(release_switch, "point_bls", spy)
    release.rollback(repo)  # no server: the repository alone
    # recover() may re-point the BLS at the current release first; the switch to a happens before the commit
    assert seen[-1] == (a, c) and [u for u, _ in seen].count(a) == 1
    assert release_state.read_state(repo)["current"] == a and release_configs.current_of_configs(repo) == (a, a)
