"""The artifact store under kills and concurrency (issue 11 items 3 and 6).

* a kill at each step of a directory swap (``atomic_dir``): the next ``clean_stale`` never leaves
  the target missing; from the journal on, the new copy and its commit files are rolled forward;
* only leftovers of the named targets are removed (never a user's ``.env.tmp-backup``);
* the lock names its holder (pid, host, since) to a second process, which waits with messages or
  is refused at once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from precision_pipeline.core import store
from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import CRASH_ENV, CRASH_EXIT, SWAP_STEPS, atomic_dir, clean_stale

BUILD = Path(__file__).resolve().parents[2] / "build"


def _python(code: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=BUILD, capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=120, **kw)


def _swap_in_subprocess(target: Path, record: Path, step: str | None) -> subprocess.CompletedProcess:
    """A second version of ``target`` (file f = "new") with ``record`` as commit file, killed at ``step``."""
    code = f"""
        from pathlib import Path
        from precision_pipeline.core.store import atomic_dir
        commit = {{}}
        with atomic_dir(Path({str(target)!r}), commit_files=commit) as tmp:
            (tmp / "f").write_text("new")
            commit[Path({str(record)!r})] = {{"key": "new"}}
    """
    return _python(code, {CRASH_ENV: step} if step else {})


def _first_version(tmp_path: Path) -> tuple[Path, Path]:
    target, record = tmp_path / "checkpoint", tmp_path / ".stages" / "quantize.json"
    with atomic_dir(target, commit_files={record: {"key": "old"}}) as d:
        (d / "f").write_text("old")
    assert json.loads(record.read_text()) == {"key": "old"}
    return target, record


@pytest.mark.parametrize("step", SWAP_STEPS)
def test_kill_inside_the_swap_is_rolled_forward(tmp_path, step):
    target, record = _first_version(tmp_path)
    p = _swap_in_subprocess(target, record, step)
    assert p.returncode == CRASH_EXIT, p.stderr
    if step == "swap":  # killed between the two renames: no target at all until the next start
        assert not target.exists()
    clean_stale(tmp_path, names=["checkpoint", ".stages"])
    assert (target / "f").read_text() == "new"
    assert json.loads(record.read_text()) == {"key": "new"}  # the folder's record came with it
    assert sorted(p.name for p in tmp_path.iterdir()) == [".stages", "checkpoint"]


def test_kill_before_the_journal_keeps_the_previous_copy(tmp_path):
    target, record = _first_version(tmp_path)
    code = f"""
        import os
        from pathlib import Path
        from precision_pipeline.core.store import atomic_dir
        with atomic_dir(Path({str(target)!r})) as tmp:
            (tmp / "f").write_text("half")
            os._exit(9)
    """
    assert _python(code).returncode == 9
    assert any(".checkpoint.tmp-" in q.name for q in tmp_path.iterdir())
    clean_stale(tmp_path, names=["checkpoint"])
    assert (target / "f").read_text() == "old" and json.loads(record.read_text()) == {"key": "old"}
    assert sorted(q.name for q in tmp_path.iterdir()) == [".stages", "checkpoint"]


def _writing_stage(stage_name: str, folder: str):
    """A stage that writes its input ``n`` into ``<folder>/f`` (the swap tests' stand-in for a real stage)."""
    from precision_pipeline.core.stage import Artifact, Frozen, Stage

    class In(Frozen):
        n: int

    class Writes(Stage):
        name, output, artifact_type = stage_name, folder, Artifact

        def inputs(self, plan, request, upstream):
            return In(n=plan)

        def run(self, inputs, workdir):
            (workdir / "f").write_text(str(inputs.n))
            return Artifact()

    return Writes


def test_a_stage_killed_mid_swap_is_a_cache_hit_after_recovery(tmp_path, monkeypatch):
    """Through the runner: the record is committed with the folder, so the next build reuses it."""
    from precision_pipeline.core.stage import Manifest, StageRunner, execute

    Writes = _writing_stage("quantize", "checkpoint")

    execute(Writes(), 1, None, {}, tmp_path)

    def kill(step):
        if step == "swap":
            raise SystemExit("killed between the renames")
    monkeypatch.setattr(store, "_crash_point", kill)
    with pytest.raises(SystemExit):
        execute(Writes(), 2, None, {}, tmp_path)
    assert not (tmp_path / "checkpoint").exists()
    monkeypatch.undo()
    clean_stale(tmp_path, names=["checkpoint", ".stages"])
    assert (tmp_path / "checkpoint" / "f").read_text() == "2"
    runner = StageRunner(tmp_path, Manifest.open(tmp_path / "manifest.json", profile="p", profile_source="p",
                                                 model_dir="m", out_dir=str(tmp_path)))
    assert runner.run(Writes(), 2, None, {}).record.status == "cached"
    assert runner.run(Writes(), 1, None, {}).record.status == "done"  # the old key is not taken for the new folder


@pytest.mark.parametrize("step", ["journal", "swap"])
def test_a_kill_mid_swap_then_the_temporary_folder_removed_is_no_cache_hit(tmp_path, step):
    """Issue 25 item 10: after a kill in the swap, someone deletes the ``.NAME.tmp-*`` folder; recovery must not
    write the new record over the old folder (that made the next build say ``pack: cached`` for a stale pack)."""
    import shutil

    from precision_pipeline.core.stage import Manifest, StageRunner, execute

    Writes = _writing_stage("pack", "model_repository")

    execute(Writes(), 1, None, {}, tmp_path)
    # the kill, in this process: the crash hook raises instead of exiting
    def kill(s):
        if s == step:
            raise SystemExit("killed")
    from unittest import mock
    with mock.patch.object(store, "_crash_point", kill), pytest.raises(SystemExit):
        execute(Writes(), 2, None, {}, tmp_path)
    leftovers = [q for q in tmp_path.iterdir() if q.name.startswith(".model_repository.tmp-")]
    assert len(leftovers) == 1
    shutil.rmtree(leftovers[0])  # "the temporary folder removed"
    clean_stale(tmp_path, names=["model_repository", ".stages"])
    assert (tmp_path / "model_repository" / "f").read_text() == "1"  # the previous copy, put back when needed
    assert not list(tmp_path.glob(".*.swap.json"))
    runner = StageRunner(tmp_path, Manifest.open(tmp_path / "manifest.json", profile="p", profile_source="p",
                                                 model_dir="m", out_dir=str(tmp_path)))
    assert runner.run(Writes(), 2, None, {}).record.status == "done"  # not "cached": the folder held n=1
    assert (tmp_path / "model_repository" / "f").read_text() == "2"
    assert runner.run(Writes(), 2, None, {}).record.status == "cached"


def test_clean_stale_with_names_touches_only_those_leftovers(tmp_path):
    (tmp_path / ".env.tmp-backup").write_text("user secret")
    (tmp_path / ".gate.tmp-abc").mkdir()
    (tmp_path / ".gate.old-12").mkdir()
    clean_stale(tmp_path, names=["gate", "checkpoint"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".env.tmp-backup"]
    assert (tmp_path / ".env.tmp-backup").read_text() == "user secret"


HOLDER = """
    import sys, time
    from pathlib import Path
    from precision_pipeline.core.store import locked
    with locked(Path(sys.argv[1]), what="holder test"):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
"""


def _hold(lock: Path, seconds: float) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), str(lock), str(seconds)], cwd=BUILD,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_lock_held_by_another_process_is_refused_naming_it(tmp_path):
    lock = tmp_path / "out" / ".build.lock"
    holder = _hold(lock, 30)
    try:
        t0 = time.monotonic()
        with pytest.raises(UserError) as e:
            with store.locked(lock, timeout_s=0, field="--out", busy_fix="use --out elsewhere"):
                pass
        assert time.monotonic() - t0 < 2.5  # at once, not after the 3 s wait
        pr = e.value.problems[0]
        assert pr.field == "--out" and f"pid {holder.pid} on " in pr.reason and "since " in pr.reason
        assert "(holder test)" in pr.reason and pr.fix == "use --out elsewhere"
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_file_that_cannot_be_created_is_refused_at_once():
    """s9 hostile round F12: ``promote --repo /proc/self/model_repository`` waited silently for ever (filelock retries a
    lock file it cannot create as if someone held it)."""
    from precision_pipeline.core.errors import UserError
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        with store.locked(Path("/proc/self/.releases.lock"), timeout_s=3, field="--repo"):
            pass
    assert time.monotonic() - t0 < 2.5  # at once, not after the 3 s wait
    p = e.value.problems[0]
    assert p.field == "--repo" and p.reason.startswith("cannot create the lock file /proc/self/.releases.lock: ")


def test_a_folder_in_place_of_the_lock_file_is_named(tmp_path):
    """Hostile s15c T83: a folder named like the lock file was refused with "use a folder this user can write to"."""
    from precision_pipeline.core.errors import UserError

    (tmp_path / ".releases.lock").mkdir()
    with pytest.raises(UserError) as e:
        with store.locked(tmp_path / ".releases.lock", timeout_s=3, field="--repo"):
            pass
    p = e.value.problems[0]
    assert p.reason == f"cannot open the lock file {tmp_path}/.releases.lock: a folder of that name is there, not a file."
    assert p.fix.startswith(f"remove that folder (rmdir {tmp_path}/.releases.lock;")


def test_a_lock_file_that_cannot_be_opened_gets_the_fix_for_what_is_there(tmp_path):
    """Hostile s17c F5: an immutable lock file (chattr +i) and a link to a missing target were both told to "use a
    folder this user can write to" -- the folder was writable."""
    import errno

    from precision_pipeline.core.errors import UserError

    lock = tmp_path / ".releases.lock"
    lock.symlink_to("/nonexistent/x")
    with pytest.raises(UserError) as e:
        with store.locked(lock, timeout_s=3, field="--repo"):
            pass
    assert e.value.problems[0].fix == (f"{lock} is a symbolic link to /nonexistent/x, which cannot be opened: remove the "
                                       f"link (rm {lock}; the lock holds no data) and run this again.")
    lock.unlink()
    lock.write_text("")
    assert store._lock_file_fix(lock, OSError(errno.EPERM, "Operation not permitted")) == (
        f"make {lock} writable for this user (`ls -l`, `lsattr`: chmod u+w, chattr -i), or remove it (it holds no data) "
        "and run this again.")
    assert store._lock_file_fix(tmp_path / "x.lock", OSError(errno.EROFS, "Read-only file system")).startswith(
        "the file system is mounted read-only")
    assert store._lock_file_fix(tmp_path / "x.lock", OSError(errno.EACCES, "Permission denied")) == (
        "use a folder this user can write to (the lock lives beside what it protects).")


def test_lock_waiter_says_who_it_waits_for_then_gets_the_lock(tmp_path):
    lock = tmp_path / "out" / ".build.lock"
    holder = _hold(lock, 4)  # long enough that a loaded machine still finds it held
    said: list[str] = []
    try:
        with store.locked(lock, timeout_s=None, on_wait=said.append, interval_s=0.3):
            assert store.lock_holder(lock)["pid"] == os.getpid()
    finally:
        holder.wait()
    assert said and all(f"held by pid {holder.pid}" in m for m in said), said
    assert not Path(str(lock) + ".json").exists()  # the sidecar goes with the lock


def test_deleting_build_lock_lets_no_second_build_in(tmp_path):
    """Issue 25 item 15: ``rm <out>/.build.lock`` during a build let a second build of the same output run."""
    out = tmp_path / "out"
    out.mkdir()
    code = f"""
        import sys, time
        from pathlib import Path
        from precision_pipeline.core.outputs import output_lock
        with output_lock(Path({str(out)!r}), "build of first"):
            print("held", flush=True)
            time.sleep(30)
    """
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=BUILD, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        (out / ".build.lock").unlink()  # the careless user
        from precision_pipeline.core.outputs import output_lock

        with pytest.raises(UserError) as e:
            with output_lock(out, "build of second", wait=False):
                pytest.fail("a second build got the lock of a running one")
        assert e.value.problems[0].field == "--out" and f"pid {holder.pid}" in e.value.problems[0].reason
    finally:
        holder.kill()
        holder.wait()
    with output_lock(out, "build of third", wait=False):  # a killed holder leaves no lock behind
        pass


def test_a_truncated_manifest_is_a_sentence_and_the_next_build_rewrites_it(tmp_path, capsys):
    """Issue 25 item 17: a truncated manifest.json broke every later command on the output with a traceback."""
    from precision_pipeline.core.stage import Manifest, read_manifest

    m = tmp_path / "manifest.json"
    m.write_text('{"profile": "fp8-h100", "stag')
    with pytest.raises(UserError) as e:
        read_manifest(m)
    pr = e.value.problems[0]
    assert pr.field == "manifest.json" and str(m) in pr.reason and "not valid JSON" in pr.reason
    assert f"--out {tmp_path}" in pr.fix
    m.write_text("[1, 2]")
    with pytest.raises(UserError, match="a JSON list, not an object"):
        read_manifest(m)
    assert read_manifest(tmp_path / "none.json") == {}
    man = Manifest.open(m, profile="p", profile_source="p", model_dir="m", out_dir=str(tmp_path))  # a build replaces it
    assert man.previous == {} and "is damaged" in capsys.readouterr().err
    man.save()
    assert read_manifest(m)["profile"] == "p"
    # a task on that output (promote reads the typed stage records, not manifest.json): exit 2, a sentence, no traceback
    m.write_text('{"profile": "fp8-h100", "stag')
    p = subprocess.run([sys.executable, "-m", "invoke", "promote", "--profile", "fp8-h100", "--out", str(tmp_path),
                        "--repo", str(tmp_path / "serving" / "model_repository")], cwd=BUILD.parent, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stdout + p.stderr and "holds no finished build" in (p.stdout + p.stderr), p.stdout + p.stderr


def test_a_full_disk_or_ulimit_during_a_checkpoint_copy_is_a_sentence_and_leaves_nothing(tmp_path):
    """Issue 25 items 17 and 21: ``ulimit -f`` / a full disk during the ``--checkpoint`` copy was a shutil.Error
    traceback; full-disk errors printed an empty path."""
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "rank0.safetensors").write_bytes(os.urandom(300_000))
    out = tmp_path / "out"
    code = f"""
        import resource
        from pathlib import Path
        from precision_pipeline.core.errors import UserError
        from precision_pipeline.core.fingerprint import fingerprint
        from precision_pipeline.core.stage import execute
        from precision_pipeline.quantize.stage import QuantizeStage, ReuseInputs

        class Req:
            checkpoint = Path({str(src)!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # ulimit -f 100 (KB)
        try:
            execute(QuantizeStage(), None, Req(), {{}}, Path({str(out)!r}))
        except UserError as e:
            print("USERERROR", e.problems[0].field, "|", e.problems[0].reason, "|", e.problems[0].fix)
    """
    p = _python(code)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    line = p.stdout.strip()
    assert line.startswith("USERERROR --checkpoint |") and f"copying {src / 'rank0.safetensors'} to " in line, line
    assert "File too large" in line and "ulimit -f" in line
    assert not (out / "checkpoint").exists() and not [q for q in out.iterdir() if ".tmp-" in q.name]  # nothing half-written
    # a write that fails with no file name (ENOSPC from write()) names the target
    import errno
    from unittest import mock

    with mock.patch.object(os, "fsync", side_effect=OSError(errno.ENOSPC, "No space left on device")):
        with pytest.raises(OSError) as e:
            store.atomic_write_json(tmp_path / "manifest.json", {"a": 1})
    assert e.value.filename == str(tmp_path / "manifest.json") and not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("step", SWAP_STEPS)
def test_a_swap_into_a_stage_temporary_folder_killed_leaves_nothing_after_clean_stale(tmp_path, step):
    """Hostile s15b F3: a stage that writes a folder with ``atomic_dir`` inside its own temporary folder, killed in
    that inner swap, left ``..checkpoint.tmp-X.swap.json``, ``..checkpoint.tmp-X.tmp-Y`` (a full 210 MB checkpoint
    copy) and ``.old-`` copies for ever: the next build removed ``.checkpoint.tmp-X`` only. Now every such leftover
    goes too, and the previous ``checkpoint`` stays."""
    target, record = _first_version(tmp_path)
    code = f"""
        from pathlib import Path
        from precision_pipeline.core.store import atomic_dir
        with atomic_dir(Path({str(target)!r})) as tmp:       # the stage's own temporary folder
            inner = Path(tmp)
            (inner / "f").write_text("half")
            with atomic_dir(inner) as deeper:                  # a swap whose target is that folder
                (deeper / "f").write_text("new")
    """
    assert _python(code, {CRASH_ENV: step}).returncode == CRASH_EXIT
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("..checkpoint.tmp-")]
    removed = clean_stale(tmp_path, names=["checkpoint", ".stages"])
    assert removed and sorted(p.name for p in tmp_path.iterdir()) == [".stages", "checkpoint"], sorted(os.listdir(tmp_path))
    assert (target / "f").read_text() == "old"


def test_a_release_command_waiting_on_the_releases_lock_says_for_whom_even_a_stopped_holder(tmp_path, capsys):
    """Hostile s15c T100/T106: a promote or an abort waited in silence (up to 600 s) on the releases lock held by a
    stopped (Ctrl-Z, SIGSTOP) rollback. The wait now prints a line every few seconds naming the holder's command, and
    a stopped holder as STOPPED with the way to resume it."""
    import signal

    from precision_pipeline.core.errors import UserError
    from precision_pipeline.core.store import describe_holder
    from precision_pipeline.serving import release_state

    repo = tmp_path / "serving" / "model_repository"
    repo.mkdir(parents=True)
    holder = _hold(repo.parent / release_state.LOCK_FILE, 60)
    try:
        holder.send_signal(signal.SIGSTOP)
        with pytest.raises(UserError) as ei:
            with release_state.lock(repo, timeout_s=6):
                pass
        err = capsys.readouterr().err
        assert f"waiting for {repo.parent / release_state.LOCK_FILE}: held by pid {holder.pid} on " in err
        assert f"(holder test), STOPPED (resume it: kill -CONT {holder.pid})" in err
        assert f"STOPPED (resume it: kill -CONT {holder.pid})" in ei.value.problems[0].reason
    finally:
        holder.kill()
        holder.wait()
    assert "STOPPED" not in describe_holder({"pid": os.getpid(), "host": socket.gethostname(), "since": 0})
