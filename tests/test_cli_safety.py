"""Nothing lost, nothing written before a refusal (issue 11 items 1, 2, 5, 6), as a user runs the tasks.

* ``--out``: only a new/empty folder or one with our marker is written; a web project holding
  ``manifest.json``, ``k8s/``, ``gate/`` and ``.env.tmp-backup`` is refused and left as it was;
* ``--checkpoint``: random bytes or a truncated rank file are refused before anything is copied;
* ``calibration.dataset``: ``invoke check`` refuses the 8 bad datasets as ``build`` does, with
  relative paths read from the profile's folder;
* a Ctrl-C during a stage leaves the previous plan.json; the lock lives inside ``--out`` and names
  its holder; ``--no-wait`` refuses at once.

A refusal is checked through Invoke's own ``program`` in this process (fixture ``invoke_here``: same parsing,
tasks.py, exit codes and text); a new process where the process is the point (``run_task``: the web project
refused, the first bad dataset, the waiting build).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import hash_dir

ROOT = Path(__file__).resolve().parent.parent
INVOKE = [sys.executable, "-m", "invoke"]


def run_task(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="250")
    return subprocess.run([*INVOKE, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


def _refused(r: subprocess.CompletedProcess, field: str, *needles: str) -> str:
    text = r.stdout + r.stderr
    assert r.returncode == 2, text
    assert "Traceback" not in text and "internal error" not in text, text
    assert f"{field}:" in r.stderr, text  # errors on stderr (hostile s12 F-J)
    for n in needles:
        assert n in text, f"{n!r} not in:\n{text}"
    return text


def _tree(d: Path) -> dict[str, str]:
    return {p.relative_to(d).as_posix(): (p.read_text() if p.is_file() else "/") for p in sorted(d.rglob("*"))}


@pytest.fixture()
def previous_output(tmp_path) -> Path:
    """A previous build's output (marker written, as every build does first)."""
    from precision_pipeline.core.outputs import write_output_marker

    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    write_output_marker(out, "fp8-h100")  # the profile the tests build into it again
    (out / "manifest.json").write_text('{"profile": "earlier"}\n')
    (out / "plan.json").write_text('{"profile": "earlier"}\n')
    (out / "checkpoint" / "config.json").write_text('{"quantization": {"quant_algo": "FP8"}}\n')
    return out


# ---- item 1: our output is recognised by our marker only


def test_web_project_as_out_is_refused_and_survives(tmp_path):
    web = tmp_path / "web"
    (web / "k8s").mkdir(parents=True)
    (web / "gate").mkdir()
    (web / "manifest.json").write_text('{"name": "my-web-app", "version": "1.0.0"}\n')
    (web / "k8s" / "web-deployment.yaml").write_text("kind: Deployment\n")
    (web / "gate" / "notes.txt").write_text("release notes\n")
    (web / ".env.tmp-backup").write_text("SECRET=1\n")
    before = _tree(web)
    r = run_task("build", "--profile", "fp8-h100", "--out", str(web))
    _refused(r, "--out", "is not a build output", ".precision-build.json", "fix:")
    assert _tree(web) == before


def test_output_from_before_the_marker_is_refused_with_how_to_proceed(tmp_path, invoke_here):
    old = tmp_path / "artifacts" / "fp8-h100"
    (old / ".stages").mkdir(parents=True)
    (old / "checkpoint").mkdir()
    (old / "manifest.json").write_text(json.dumps({"profile": "fp8-h100", "stages": {"quantize": {"status": "done"}}}))
    before = _tree(old)
    r = invoke_here("build", "--profile", "fp8-h100", "--out", str(old))
    _refused(r, "--out", "from before output folders were marked", "delete it yourself", "give a new --out")
    assert _tree(old) == before


# ---- item 2: every tensor's byte range is checked before anything is copied


def _checkpoint(d: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architecture": "LlamaForCausalLM", "mapping": {"world_size": 1, "tp_size": 1},
                                               "quantization": {"quant_algo": None}}))
    save_file({"lm_head.weight": torch.zeros(64, 64, dtype=torch.bfloat16)}, str(d / "rank0.safetensors"))
    return d


@pytest.mark.parametrize("damage", ["random-bytes", "truncated", "header-only", "empty"])
def test_damaged_checkpoint_is_refused_before_anything_is_copied(damage, tmp_path, previous_output, invoke_here):
    ck = _checkpoint(tmp_path / "ck")
    rank = ck / "rank0.safetensors"
    data = rank.read_bytes()
    if damage == "random-bytes":
        rank.write_bytes(os.urandom(4096))
    elif damage == "truncated":
        rank.write_bytes(data[: len(data) // 2])
    elif damage == "header-only":
        rank.write_bytes(data[: 8 + int.from_bytes(data[:8], "little")])
    else:
        rank.write_bytes(b"")
    before = hash_dir(previous_output)
    r = invoke_here("build", "--profile", "bf16-h100", "--checkpoint", str(ck), "--out", str(previous_output))
    _refused(r, "--checkpoint", str(rank), "is not a complete safetensors file")
    assert hash_dir(previous_output) == before


def test_header_reader_checks_each_range(tmp_path):
    from precision_pipeline.checkpoint.reader import safetensors_header
    from precision_pipeline.core.errors import UserError

    ck = _checkpoint(tmp_path / "ck")
    rank = ck / "rank0.safetensors"
    h = safetensors_header(rank)
    assert h["lm_head.weight"]["data_offsets"] == [0, 64 * 64 * 2]
    data = bytearray(rank.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["lm_head.weight"]["shape"] = [64, 65]  # dtype x shape no longer matches the range
    text = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(text) == n
    rank.write_bytes(bytes(data[:8]) + text + bytes(data[8 + n:]))
    with pytest.raises(UserError, match=r"needs 8320 bytes, its data_offsets give 8192") as e:
        safetensors_header(rank, field="--checkpoint")
    assert e.value.problems[0].field == "--checkpoint"
    rank.write_bytes((2**63).to_bytes(8, "little") + b"{}")  # a header length that used to raise OverflowError
    with pytest.raises(UserError, match="claims"):
        safetensors_header(rank)


# ---- item 5: the calibration dataset is one rule that check and build both run


def _dataset_profile(d: Path, dataset: str, name: str) -> Path:
    prof = d / "profiles" / f"{name}.yaml"
    prof.parent.mkdir(parents=True, exist_ok=True)
    prof.write_text(f"extends: fp8-h100\nname: {name}\ncalibration:\n  dataset: {json.dumps(dataset)}\n  num_samples: 2\n")
    return prof


def _bad_datasets(d: Path) -> dict[str, tuple[str, str]]:
    """name -> (dataset value, expected text)."""
    (d / "profiles").mkdir(parents=True, exist_ok=True)
    (d / "adir").mkdir()
    (d / "profiles" / "line3.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n{"text": broken\n')
    (d / "profiles" / "latin1.jsonl").write_bytes('{"text": "caf\u00e9"}\n{"text": "ok"}\n'.encode("latin-1"))
    (d / "calib.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')  # beside the cwd-ish parent, not the profile
    return {
        "missing": (str(d / "nope.jsonl"), "no file at"),
        "directory": (str(d / "adir"), "is a directory"),
        "dev-zero": ("/dev/zero", "is not a regular file"),
        "invalid-json-line-3": ("line3.jsonl", "line 3 is not valid JSON"),
        "latin-1": ("latin1.jsonl", "is not UTF-8 (line 1)"),
        "relative-not-beside-profile": ("../calib-missing.jsonl", "no file at"),
        "empty": ("", "is empty"),
        "misspelt-builtin": ("bultin", "did you mean 'builtin'"),
    }


def test_check_refuses_every_bad_dataset(tmp_path, invoke_here):
    cases = _bad_datasets(tmp_path)
    for i, (name, (value, expected)) in enumerate(cases.items()):
        prof = _dataset_profile(tmp_path, value, name)
        # the first case as a user runs it (a new process); the others through Invoke in this process
        r = (run_task if i == 0 else invoke_here)("check", "--profile", str(prof))
        text = _refused(r, "calibration.dataset", expected)
        assert "rule: calibration.dataset" in text, (name, text)


def test_relative_dataset_is_read_beside_the_profile(tmp_path, invoke_here):
    prof = _dataset_profile(tmp_path, "data/calib.jsonl", "relative-ok")
    (prof.parent / "data").mkdir()
    (prof.parent / "data" / "calib.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    r = invoke_here("check", "--profile", str(prof))
    assert r.returncode == 0 and r.stdout.startswith("ok"), r.stdout + r.stderr
    from precision_pipeline.resolve.dataset import load_build_profile

    assert load_build_profile(str(prof)).calibration.dataset == str((prof.parent / "data" / "calib.jsonl").resolve())


def test_build_refuses_a_bad_dataset_before_writing(tmp_path, previous_output, invoke_here):
    prof = _dataset_profile(tmp_path, "/dev/zero", "devzero")
    before = hash_dir(previous_output)
    names = sorted(p.name for p in previous_output.iterdir())
    r = invoke_here("build", "--profile", str(prof), "--out", str(previous_output))
    _refused(r, "calibration.dataset", "is not a regular file")
    assert hash_dir(previous_output) == before and sorted(p.name for p in previous_output.iterdir()) == names


def test_check_counts_bytes_and_tokens_of_the_samples_as_the_build_does(tmp_path, invoke_here):
    """Issue 25 item 16: a sample too large passed ``invoke check`` and only failed (or OOMed) at build."""
    prof = _dataset_profile(tmp_path, "big.jsonl", "bigsample")
    prof.write_text(prof.read_text().replace("num_samples: 2\n", "num_samples: 2\n  seq_len: 16\n"))
    data = prof.parent / "big.jsonl"
    data.write_text(json.dumps({"text": "x" * 5000}) + "\n" + json.dumps({"text": "short"}) + "\n"
                    + json.dumps({"text": "word " * 50}) + "\n")
    _refused(invoke_here("check", "--profile", str(prof)), "calibration.dataset",
             "line 1 (5,012 bytes): more than 4,096 bytes, so more than calibration.seq_len = 16 tokens")
    data.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "word " * 50}) + "\n")
    _refused(invoke_here("check", "--profile", str(prof)), "calibration.dataset",
             "line 2 (51 tokens) is longer than calibration.seq_len = 16 tokens")


def test_build_refuses_texts_longer_than_seq_len_before_writing(tmp_path, previous_output, invoke_here):
    prof = _dataset_profile(tmp_path, "long.jsonl", "longtexts")
    prof.write_text(prof.read_text().replace("num_samples: 2\n", "num_samples: 2\n  seq_len: 16\n"))
    (prof.parent / "long.jsonl").write_text(json.dumps({"text": "word " * 50}) + "\n" + json.dumps({"text": "short"}) + "\n")
    before = hash_dir(previous_output)
    r = invoke_here("build", "--profile", str(prof), "--out", str(previous_output))
    _refused(r, "calibration.dataset", "line 1 (51 tokens) is longer than calibration.seq_len = 16 tokens")
    assert hash_dir(previous_output) == before


@pytest.mark.parametrize("flags, field", [
    (["--repo-root", "relative/path"], "--repo-root"),
    (["--image", "bad image"], "--image"),
])
def test_bad_serving_options_are_refused_before_writing(flags, field, previous_output, invoke_here):
    before = hash_dir(previous_output)
    _refused(invoke_here("build", "--profile", "fp8-h100", "--out", str(previous_output), *flags), field)
    assert hash_dir(previous_output) == before


@pytest.mark.parametrize("name, says", [("my build", "contains a space"), ("café", "non-ASCII character 'é' (U+00E9)"),
                                        ("tab\there", "contains whitespace"), ("a$b", "the character '$'")])
def test_out_path_the_serving_stubs_cannot_start_from_is_refused_at_build_time(tmp_path, name, says, invoke_here):
    """Issue 25 item 13: a build into a path with a space exited 0 and ``serve`` never became ready; a non-ASCII path
    gave a traceback. Refused by ``build_request`` (before any write), and by the task with exit 2."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.pipeline import build_request

    out = tmp_path / name
    with pytest.raises(UserError) as e:
        build_request("fp8-h100", out=str(out), device="cpu")
    pr = e.value.problems[0]
    assert pr.field == "--out" and says in pr.reason and "unquoted" in pr.reason and "ASCII letters" in pr.fix
    assert not out.exists()
    with pytest.raises(UserError) as e:
        build_request("fp8-h100", out=str(tmp_path / "ok"), repo_root=f"/srv/{name}", device="cpu")
    assert e.value.problems[0].field == "--repo-root"
    build_request("fp8-h100", out=str(tmp_path / "fine-1.0_x"), device="cpu")  # ordinary names still pass
    if name == "café":
        _refused(invoke_here("build", "--profile", "fp8-h100", "--out", str(out)), "--out", "non-ASCII")
        assert not out.exists()


@pytest.mark.parametrize("name", [".precision-build.json", ".build.lock"])
def test_a_folder_where_the_build_writes_its_marker_or_lock_is_refused(tmp_path, name, invoke_here):
    """Found re-trying issue 25 items 13/17: ``mkdir <out>/.precision-build.json`` then ``build --out <out>`` was an
    internal error (IsADirectoryError from the marker's atomic replace). Refused on --out before any write."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.core.outputs import validate_out_dir

    out = tmp_path / "out"
    (out / name).mkdir(parents=True)
    with pytest.raises(UserError) as e:
        validate_out_dir(out)
    p = e.value.problems[0]
    assert p.field == "--out" and f"{out / name} is not a regular file (a folder)" in p.reason
    assert p.fix.startswith(f"remove it if it is not yours (rm -r {out / name})")
    r = invoke_here("build", "--profile", "fp8-h100", "--out", str(out), "--no-wait")
    assert r.returncode == 2 and "--out:" in (r.stdout + r.stderr) and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert sorted(q.name for q in out.iterdir()) == [name]


def test_golden_limit_is_checked_by_run_build_itself(previous_output):
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.pipeline import run_build

    before = hash_dir(previous_output)
    with pytest.raises(UserError) as e:
        run_build("fp8-h100", out=str(previous_output), golden_limit=0)
    assert e.value.problems[0].field == "--golden-limit"
    assert hash_dir(previous_output) == before


# ---- item 5 (plan.json goes with its stages) and item 6 (lock inside the output), with stand-in stages


def _fake_stages(monkeypatch, interrupt_in: str | None = None):
    from precision_pipeline import pipeline
    from precision_pipeline.core.stage import Artifact, Frozen, Stage

    class In(Frozen):
        profile: str

    class Art(Artifact):
        layers: dict = {}
        built: bool = False
        passed: bool = True

    def make(stage_name: str, folder: str):
        class Fake(Stage):
            name, output, artifact_type = stage_name, folder, Art

            def inputs(self, plan, request, upstream):
                return In(profile=plan.profile.name)

            def run(self, inputs, workdir):
                (workdir / "made-by").write_text(f"{stage_name} of {inputs.profile}\n")
                if stage_name == interrupt_in:
                    raise KeyboardInterrupt
                return Art()
        return Fake()

    from precision_pipeline.core.route import Route

    monkeypatch.setitem(pipeline.ROUTES, "engine", Route("engine", (pipeline.ROUTES["engine"].stages[0], make("quantize", "checkpoint"),
                                                                    make("gate", "gate"), make("engine", "engine"))))


def test_ctrl_c_during_a_stage_leaves_the_previous_plan(monkeypatch, previous_output):
    from precision_pipeline.pipeline import run_build

    _fake_stages(monkeypatch, interrupt_in="quantize")
    before = {n: (previous_output / n).read_text() for n in ("plan.json",)}
    ck = hash_dir(previous_output / "checkpoint")
    with pytest.raises(KeyboardInterrupt):
        run_build("fp8-h100", out=str(previous_output))
    assert (previous_output / "plan.json").read_text() == before["plan.json"]
    assert hash_dir(previous_output / "checkpoint") == ck
    assert not [p.name for p in previous_output.iterdir() if ".tmp-" in p.name]


def test_lock_lives_inside_out_and_parent_is_untouched(monkeypatch, tmp_path):
    from precision_pipeline.pipeline import run_build

    _fake_stages(monkeypatch)
    parent = tmp_path / "volume-root"
    out = parent / "out"
    out.mkdir(parents=True)
    if os.geteuid() != 0:  # as root, permissions do not stop writes: the listing below is the check
        parent.chmod(0o555)
    try:
        res = run_build("fp8-h100", out=str(out))
    finally:
        parent.chmod(0o755)
    assert sorted(p.name for p in parent.iterdir()) == ["out"]
    assert {".build.lock", ".precision-build.json", "plan.json", "manifest.json", "checkpoint"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "plan.json").read_text())["profile"] == "fp8-h100"
    assert [s.status for s in res.stages] == ["done", "done", "done", "done"]


KILLED_BUILD = """
    import os, signal, sys
    from pathlib import Path
    from precision_pipeline.core.outputs import output_lock, write_output_marker
    from precision_pipeline.core.store import atomic_dir
    out = Path(sys.argv[1])
    with output_lock(out, "build of fp8-h100"):
        write_output_marker(out, "fp8-h100")
        with atomic_dir(out / "checkpoint") as tmp:  # quantize writing its checkpoint aside
            (tmp / "rank0.safetensors").write_bytes(b"half")
            os.kill(os.getpid(), signal.SIGTERM)    # the default action: no finally runs
"""


def test_a_build_killed_mid_quantize_is_cleaned_up_by_the_next_one(monkeypatch, tmp_path, capsys):
    """Hostile round s11: SIGTERM during quantize left ``<out>/.checkpoint.tmp-*`` and ``.build.lock.json`` (the
    sidecar naming the dead holder). The next build takes the lock over at once, saying from whom, and removes the
    staged copy, saying so; afterwards neither is left."""
    import signal

    from precision_pipeline.core.outputs import output_lock
    from precision_pipeline.pipeline import run_build

    _fake_stages(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(KILLED_BUILD), str(out)], cwd=ROOT / "build",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGTERM, r.stderr
    staged = [p.name for p in out.iterdir() if p.name.startswith(".checkpoint.tmp-")]
    assert len(staged) == 1 and (out / ".build.lock.json").is_file()
    dead = json.loads((out / ".build.lock.json").read_text())["pid"]
    capsys.readouterr()
    res = run_build("fp8-h100", out=str(out), wait=False)
    err = capsys.readouterr().err
    assert f"{out / '.build.lock'}: taken over from pid {dead} on " in err, err
    assert ("(build of fp8-h100), which ended without releasing it (killed?); the system released its lock when it "
            "died\n") in err
    assert f"[build] removed what an interrupted build left: {staged[0]}\n" in err
    assert [s.status for s in res.stages] == ["done", "done", "done", "done"]
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name or p.name == ".build.lock.json"]
    with output_lock(out, "again", wait=False, on_wait=pytest.fail):
        pass  # a build that ended normally leaves no sidecar: nothing to take over


HOLD = """
    import sys, time
    from pathlib import Path
    from precision_pipeline.core.store import locked
    with locked(Path(sys.argv[1]) / ".build.lock", what="build of fp8-h100"):
        print("held", flush=True)
        time.sleep(120)
"""


def test_second_build_of_the_same_out_names_the_first(tmp_path, previous_output, invoke_here):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLD), str(previous_output)], cwd=ROOT / "build",
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = hash_dir(previous_output, exclude=(".build.lock", ".build.lock.json"))
        r = invoke_here("build", "--profile", "fp8-h100", "--out", str(previous_output), "--no-wait")  # another process holds it
        _refused(r, "--out", f"held by pid {holder.pid} on ", "since ", "--no-wait")
        assert hash_dir(previous_output, exclude=(".build.lock", ".build.lock.json")) == before
        # without --no-wait it waits, saying for whom, every few seconds
        waiter = subprocess.Popen([*INVOKE, "build", "--profile", "fp8-h100", "--out", str(previous_output)], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, COLUMNS="250"))
        try:
            t0, line = time.monotonic(), ""
            while time.monotonic() - t0 < 60 and "waiting for" not in line:
                line = waiter.stdout.readline()
                assert line or waiter.poll() is None, "the waiting build ended"
            assert "waiting for" in line and f"held by pid {holder.pid}" in line, line
            assert waiter.poll() is None
        finally:
            waiter.kill()
            waiter.wait()
    finally:
        holder.kill()
        holder.wait()


SIGTERM_BUILD = """
import os, signal, sys, time
sys.path.insert(0, 'build')
from invoke.main import program
from precision_pipeline.cli import build as cli

def stopped(*a, **k):  # a build in its gate: SIGTERM from `timeout`, Kubernetes or a CI runner
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)

cli.build = stopped
program.run(['invoke', 'build', '--profile', 'fp8-h100', '--out', sys.argv[1]])
"""


def test_sigterm_during_build_ends_it_as_ctrl_c(tmp_path):
    """Hostile s12 F-I: SIGTERM during `invoke build` ended it with exit 143 and no line (SIGINT said "interrupted;
    previous artifacts are intact." and exited 130). Every task now runs under ``terminate_as_interrupt``
    (``tasks.guarded``): the same exit 130 and line."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", SIGTERM_BUILD, str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, (r.stdout + r.stderr)) == (130, "interrupted; previous artifacts are intact.\n"), r.stdout + r.stderr
    assert time.monotonic() - t0 < 25 and "Traceback" not in r.stderr


def test_an_interrupted_rebuild_leaves_the_output_marked_unfinished_until_a_build_finishes(monkeypatch, tmp_path):
    """Hostile s15 F5 / s15b F2: a rebuild killed between its stages left new records beside old ones (a new resolve
    with the old checkpoint, a new gate with the old packed unit) and promote shipped them as one build. A build
    writes ``finished`` into manifest.json only at its end (``core.stage.unfinished_build`` reads it; promote's
    ``open_build`` and the engine Job's ``check_gated_output`` refuse such an output); the next finished build clears it."""
    from precision_pipeline.core.stage import read_manifest, unfinished_build
    from precision_pipeline.pipeline import run_build

    out = tmp_path / "out"
    _fake_stages(monkeypatch)
    run_build("fp8-h100", out=str(out), wait=False)
    m = read_manifest(out / "manifest.json")
    assert unfinished_build(m) is None and m["finished"] >= m["started"]
    _fake_stages(monkeypatch, interrupt_in="gate")
    (out / ".stages" / "gate.json").unlink()              # the gate runs again, and is interrupted
    with pytest.raises(KeyboardInterrupt):
        run_build("fp8-h100", out=str(out), wait=False)
    m = read_manifest(out / "manifest.json")
    assert "finished" not in m and unfinished_build(m).startswith("the last build into this folder (started 20")
    assert unfinished_build(m).endswith(") did not finish (interrupted or killed)")
    _fake_stages(monkeypatch)
    run_build("fp8-h100", out=str(out), wait=False)
    assert unfinished_build(read_manifest(out / "manifest.json")) is None
    assert unfinished_build({}) is None and unfinished_build({"profile": "x", "stages": {}}) is None


def test_a_build_of_another_profile_into_a_marked_output_is_refused(monkeypatch, tmp_path):
    """Hostile s15b F22: a build of profile B into profile A's output replaced A's passed build without a word (the
    marker kept saying A). Refused before anything is written."""
    from precision_pipeline.core.outputs import read_output_marker
    from precision_pipeline.pipeline import run_build

    _fake_stages(monkeypatch)
    out = tmp_path / "out"
    run_build("fp8-h100", out=str(out), wait=False)
    before = (out / "manifest.json").read_text()
    with pytest.raises(UserError) as ei:
        run_build("bf16-h100", out=str(out), wait=False)
    assert ei.value.problems[0].field == "--out"
    assert ei.value.problems[0].reason == (f"{out.resolve()} holds the build of profile 'fp8-h100' (its "
                                           ".precision-build.json), not 'bf16-h100': this build would replace it.")
    assert (out / "manifest.json").read_text() == before and read_output_marker(out)["profile"] == "fp8-h100"
