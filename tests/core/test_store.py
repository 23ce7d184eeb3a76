"""Artifact store: hashing, atomic writes, atomic directory swaps."""

from __future__ import annotations

import hashlib

import pytest

from precision_pipeline.core.store import atomic_dir, atomic_write_json, clean_stale, hash_dir, hash_obj, read_json


def test_hash_obj_is_key_order_independent():
    assert hash_obj({"a": 1, "b": [1, 2]}) == hash_obj({"b": [1, 2], "a": 1})
    assert hash_obj({"a": 1}) != hash_obj({"a": 2})
    assert hash_obj({"a": 1}) == hashlib.sha256(b'{"a":1}').hexdigest()


def test_hash_dir_sees_content_and_names(tmp_path):
    (tmp_path / "x").write_text("1")
    h1 = hash_dir(tmp_path)
    (tmp_path / "x").write_text("2")
    h2 = hash_dir(tmp_path)
    (tmp_path / "x").rename(tmp_path / "y")
    h3 = hash_dir(tmp_path)
    assert len({h1, h2, h3}) == 3


def test_atomic_dir_replaces_on_success(tmp_path):
    target = tmp_path / "art"
    with atomic_dir(target) as d:
        (d / "f").write_text("old")
    with atomic_dir(target) as d:
        (d / "f").write_text("new")
    assert (target / "f").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_atomic_dir_keeps_previous_on_crash(tmp_path):
    target = tmp_path / "art"
    with atomic_dir(target) as d:
        (d / "f").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as d:
            (d / "f").write_text("half")
            raise RuntimeError("crash mid-stage")
    assert (target / "f").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_atomic_write_json_and_clean_stale(tmp_path):
    atomic_write_json(tmp_path / "m.json", {"b": 2, "a": 1})
    assert read_json(tmp_path / "m.json") == {"a": 1, "b": 2}
    assert read_json(tmp_path / "missing.json", default={}) == {}
    (tmp_path / ".art.tmp-123").mkdir()
    (tmp_path / ".x.old-9").write_text("")
    clean_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


@pytest.mark.parametrize("umask,file_mode,dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750)])
def test_atomic_writers_follow_the_umask(tmp_path, umask, file_mode, dir_mode):
    """mkstemp/mkdtemp create 0600/0700; what the atomic writers leave follows the umask like open() does."""
    import os
    import stat

    from precision_pipeline.core.store import atomic_dir, atomic_write_json, current_umask

    old = os.umask(umask)
    try:
        assert current_umask() == umask
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        with atomic_dir(tmp_path / "d") as tmp:
            (tmp / "f").write_text("x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == dir_mode
