"""The stage runner: strict keys, declared code, the one model fingerprint, and what a build re-runs.

Fast tests check keys directly; the slow ones run ``run_build`` on a reused FP8 test checkpoint
with one golden prompt per category, and once with a stand-in ``trtllm-build`` (a test double:
tests/engine/doubles.py: it records its argv and writes a minimal engine folder) found by the engine stage's own probe.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from precision_pipeline.core import fingerprint as fp_mod
from precision_pipeline.core import stage as stage_mod
from precision_pipeline.core.fingerprint import Fingerprint, fingerprint
from precision_pipeline.core.paths import PACKAGE_DIR
from precision_pipeline.core.store import canonical, hash_obj

SHA0 = "0" * 64


# ---- strict canonical form


@pytest.mark.parametrize("bad,where", [
    ({"a": {"b": object()}}, "$.a.b"),
    ({"s": {1, 2}}, "$.s"),
    ({"x": [1.0, math.nan]}, "$.x[1]"),
    ({"inf": math.inf}, "$.inf"),
    ({"p": Path("/tmp")}, "$.p"),
    ({"b": b"bytes"}, "$.b"),
    ({1: "int key"}, "$"),
])
def test_canonical_refuses_unknown_types(bad, where):
    with pytest.raises(TypeError) as e:
        hash_obj(bad)
    assert str(e.value).startswith(where + ":"), str(e.value)


def test_canonical_accepts_models_enums_and_fingerprints_without_their_path(tmp_path):
    from precision_pipeline.spec.profile import QuantAlgo

    a = Fingerprint(sha256=SHA0, path=tmp_path / "a")
    b = Fingerprint(sha256=SHA0, path=tmp_path / "b")
    assert canonical({"f": a, "q": QuantAlgo.FP8, "t": (1, 2)}) == {"f": {"sha256": SHA0}, "q": "FP8", "t": [1, 2]}
    assert hash_obj({"f": a}) == hash_obj({"f": b})


# ---- declared code: editing the MoE re-sharding code changes the quantize key (and only that)


def test_moe_reshard_code_is_in_the_quantize_key(tmp_path, monkeypatch):
    from precision_pipeline.gate.options import GateOptions
    from precision_pipeline.gate.stage import GateInputs, GateStage
    from precision_pipeline.quantize.stage import QuantizeStage, ReuseInputs
    from precision_pipeline.spec.profile import GateThresholds

    pkg = tmp_path / "precision_pipeline"
    shutil.copytree(PACKAGE_DIR, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(stage_mod, "CODE_ROOT", pkg)
    q_in = ReuseInputs(checkpoint=Fingerprint(sha256=SHA0, path=tmp_path))
    g_in = GateInputs(checkpoint=Fingerprint(sha256=SHA0, path=tmp_path), model=Fingerprint(sha256=SHA0, path=tmp_path),
                      thresholds=GateThresholds(), golden=Fingerprint(sha256=SHA0, path=tmp_path),
                      options=GateOptions(prompts_per_category=1))
    q1 = stage_mod.stage_key(QuantizeStage(), q_in, {})
    g1 = stage_mod.stage_key(GateStage(), g_in, {"quantize": SHA0})
    assert q1 == stage_mod.stage_key(QuantizeStage(), q_in, {})  # deterministic
    with open(pkg / "quantize" / "moe_reshard.py", "a") as f:
        f.write("\n# an edit to the expert re-sharding\n")
    assert stage_mod.stage_key(QuantizeStage(), q_in, {}) != q1
    assert stage_mod.stage_key(GateStage(), g_in, {"quantize": SHA0}) == g1


def test_stage_inputs_must_be_frozen_models():
    from precision_pipeline.quantize.stage import QuantizeStage

    with pytest.raises(TypeError, match="frozen pydantic model"):
        stage_mod.stage_key(QuantizeStage(), {"not": "a model"}, {})


# ---- one model-fingerprint policy: full sha256, memoized by (path, size, mtime_ns)


def test_model_fingerprint_is_full_and_memoized(tmp_path, monkeypatch):
    from precision_pipeline.core.store import hash_dir

    monkeypatch.setenv("PRECISION_CACHE_DIR", str(tmp_path / "cache"))
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text("{}")
    big = m / "model.safetensors"
    big.write_bytes(b"a" * (3 << 20))
    calls = []
    real = fp_mod.hash_file
    monkeypatch.setattr(fp_mod, "hash_file", lambda p: calls.append(Path(p).name) or real(p))
    f1 = fp_mod.model_fingerprint(m)
    assert f1.sha256 == hash_dir(m) and sorted(calls) == ["config.json", "model.safetensors"]
    calls.clear()
    assert fp_mod.model_fingerprint(m) == f1 and calls == []  # unchanged files are not read again
    # a change in the middle of the file (first/last MiB untouched) is seen
    with open(big, "r+b") as f:
        f.seek(3 << 19)
        f.write(b"b")
    os.utime(big, ns=(big.stat().st_atime_ns, big.stat().st_mtime_ns + 1000))
    f2 = fp_mod.model_fingerprint(m)
    assert calls == ["model.safetensors"] and f2.sha256 != f1.sha256


def test_gate_fingerprint_is_the_same_policy(tmp_path, monkeypatch):
    from precision_pipeline.gate.reference import model_fingerprint as gate_fp

    monkeypatch.setenv("PRECISION_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"x" * 10)
    assert gate_fp(tmp_path / "m") == fingerprint(tmp_path / "m").sha256


def _model(tmp_path: Path) -> Path:
    m = tmp_path / "model"
    m.mkdir()
    (m / "config.json").write_text("{}")
    (m / "tokenizer.json").write_text("{}")
    (m / "model.safetensors").write_bytes(os.urandom(8 << 20))
    return m


def test_model_fingerprint_sees_1_mb_rewritten_with_size_and_mtime_put_back(tmp_path, monkeypatch):
    """Issue 25 item 7: 1 MB of weights changed in place, then ``touch -r`` (size and mtime as before)."""
    monkeypatch.setenv("PRECISION_CACHE_DIR", str(tmp_path / "cache"))
    m = _model(tmp_path)
    w = m / "model.safetensors"
    f1 = fp_mod.model_fingerprint(m)
    st = w.stat()
    with open(w, "r+b") as f:
        f.seek(3 << 20)
        f.write(os.urandom(1_000_000))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (w.stat().st_size, w.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    f2 = fp_mod.model_fingerprint(m)
    assert f2.sha256 != f1.sha256 and f2.sha256 == fingerprint(m, memo=False).sha256
    # the content sample alone (a memo row whose stat fields all match) still sees a change in a sampled block
    memo = json.loads((tmp_path / "cache" / fp_mod.MEMO_FILE).read_text())
    with open(w, "r+b") as f:
        f.write(b"\xff" * 16)  # the header: block 0 of the sample
    now = w.stat()
    row = memo["files"][str(w.resolve())]
    row[:4] = [now.st_size, now.st_mtime_ns, now.st_ctime_ns, now.st_ino]
    (tmp_path / "cache" / fp_mod.MEMO_FILE).write_text(json.dumps(memo))
    assert fp_mod.model_fingerprint(m).sha256 == fingerprint(m, memo=False).sha256 != f2.sha256


def test_model_fingerprint_reads_only_the_loader_files(tmp_path, monkeypatch):
    """Issue 25 item 19: a README.md (or LICENSE, .git/) added to the model folder changes no key."""
    monkeypatch.setenv("PRECISION_CACHE_DIR", str(tmp_path / "cache"))
    m = _model(tmp_path)
    f1 = fp_mod.model_fingerprint(m)
    assert f1.sha256 == fingerprint(m).sha256  # a folder of loader files only: the full digest, as before
    (m / "README.md").write_text("# my notes\n")
    (m / "LICENSE").write_text("Apache-2.0\n")
    (m / ".git").mkdir()
    (m / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    assert fp_mod.model_fingerprint(m) == f1
    (m / "tokenizer_config.json").write_text('{"x": 1}')  # a file the tokenizer reads is in the key
    f3 = fp_mod.model_fingerprint(m)
    assert f3 != f1
    (m / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 8)
    assert fp_mod.model_fingerprint(m) != f3


class _In(stage_mod.Frozen):
    n: int


class _Writes(stage_mod.Stage):
    name, output, artifact_type = "quantize", "checkpoint", stage_mod.Artifact

    def inputs(self, plan, request, upstream):
        return _In(n=plan)

    def run(self, inputs, workdir):
        (workdir / "rank0.safetensors").write_bytes(bytes([inputs.n]) * (3 << 20))
        (workdir / "config.json").write_text('{"n": %d}' % inputs.n)
        (workdir / "report.md").write_text("view")
        return stage_mod.Artifact()


def _runner(out: Path):
    return stage_mod.StageRunner(out, stage_mod.Manifest.open(out / "manifest.json", profile="p", profile_source="p",
                                                              model_dir="m", out_dir=str(out)))


@pytest.mark.parametrize("damage", ["truncate", "rewrite", "add", "delete", "bitflip"])
def test_a_cache_hit_checks_the_folder_is_what_its_record_says(tmp_path, damage):
    """Issue 25 item 7: ``truncate -s`` of a checkpoint after its build made quantize (and the gate) say cached.
    Hostile s16b F7: one byte flipped in place between the sampled blocks (``dd conv=notrunc``) was reused too; the
    modification time in the record sees it. A hard link of the files (pack links the checkpoint into its unit)
    changes their ctime only, and stays a cache hit."""
    out = tmp_path / "out"
    assert _runner(out).run(_Writes(), 1, None, {}).record.status == "done"
    (tmp_path / "linked").mkdir()
    os.link(out / "checkpoint" / "rank0.safetensors", tmp_path / "linked" / "rank0.safetensors")
    os.chmod(out / "checkpoint" / "config.json", 0o600)
    assert _runner(out).run(_Writes(), 1, None, {}).record.status == "cached"
    (out / "checkpoint" / "report.md").write_text("re-rendered by a later task")  # views are not vouched for
    (out / "checkpoint" / "__pycache__").mkdir()
    (out / "checkpoint" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")  # served in place
    assert _runner(out).run(_Writes(), 1, None, {}).record.status == "cached"
    w = out / "checkpoint" / "rank0.safetensors"
    if damage == "truncate":
        os.truncate(w, 1_000_000)
        why = "rank0.safetensors is 1,000,000 bytes, its record says 3145728"
    elif damage == "rewrite":
        with open(w, "r+b") as f:
            f.write(b"\x07" * 10)
        why = "rank0.safetensors changed after it was written"
    elif damage == "bitflip":
        with open(w, "r+b") as f:
            f.seek(100_000)  # between sample blocks 0 (bytes 0..65535) and 1 (from 205,346): the sample cannot see it
            f.write(b"\x08")
        why = "rank0.safetensors was modified after it was written (its modification time differs"
    elif damage == "add":
        (out / "checkpoint" / "rank1.safetensors").write_bytes(b"x")
        why = "rank1.safetensors was added"
    else:
        (out / "checkpoint" / "config.json").unlink()
        why = "config.json is missing"
    r = _runner(out)
    assert r.run(_Writes(), 1, None, {}).record.status == "done"
    assert why in r.not_reused["quantize"]
    assert w.stat().st_size == 3 << 20
    assert _runner(out).run(_Writes(), 1, None, {}).record.status == "cached"


# ---- builds


LOOSE = ("extends: fp8-h100\ngate:\n  kl_mean_max: 5.0\n  kl_p99_max: 50.0\n  top1_min: 0.1\n  ppl_delta_pct_max: 500.0\n"
         "  greedy_same_min: 0.0\n  overrides: {}\n")


def _statuses(res) -> dict[str, str]:
    return {s.name: s.status for s in res.stages}


@pytest.fixture
def golden_copy(tmp_path, monkeypatch) -> Path:
    from precision_pipeline.gate import golden

    g = tmp_path / "golden_prompts.jsonl"
    shutil.copy2(golden.GOLDEN_PATH, g)
    monkeypatch.setattr(golden, "GOLDEN_PATH", g)
    return g


@pytest.mark.slow
def test_rebuilds_follow_golden_file_and_model(tmp_path, fp8_checkpoint, default_model_dir, golden_copy, small_gate):
    from precision_pipeline.pipeline import run_build

    prof = tmp_path / "loose.yaml"
    prof.write_text(LOOSE)
    out = tmp_path / "out"

    def build(model=None):
        return run_build(str(prof), model=str(model) if model else None, out=str(out), golden_limit=1,
                         checkpoint=str(fp8_checkpoint))

    assert _statuses(build()) == {"resolve": "done", "quantize": "done", "verify": "done", "gate": "done", "engine": "skipped",
                                  "engine_gate": "skipped", "pack": "done", "deploy": "done"}
    assert _statuses(build()) == {"resolve": "done", "quantize": "cached", "verify": "cached", "gate": "cached", "engine": "skipped",
                                  "engine_gate": "skipped", "pack": "cached", "deploy": "cached"}
    # editing the golden set re-runs the gate and what follows it, not quantize
    lines = golden_copy.read_text().splitlines()
    row = json.loads(lines[0])
    lines[0] = json.dumps({**row, "answer": row["answer"] + " (edited)"})
    golden_copy.write_text("\n".join(lines) + "\n")
    st = _statuses(build())
    assert st == {"resolve": "done", "quantize": "cached", "verify": "cached", "gate": "done", "engine": "skipped", "engine_gate": "skipped", "pack": "done",
                  "deploy": "done"}, st
    # the same checkpoint against another model (same name, one file differs) is not a gate cache hit
    other = tmp_path / "models" / Path(default_model_dir).name
    other.mkdir(parents=True)
    for p in Path(default_model_dir).iterdir():
        if p.is_file():
            (other / p.name).symlink_to(p)
    (other / "generation_config.json").unlink()
    gen = json.loads((Path(default_model_dir) / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**gen, "note": "another model"}))
    st = _statuses(build(other))
    assert st["quantize"] == "cached" and st["gate"] == "done", st
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["model_dir"] == str(other.resolve()) and manifest["stages"]["gate"]["status"] == "done"
    assert json.loads((out / "plan.json").read_text())["layers"]["linears"]


@pytest.mark.slow
def test_unchanged_engine_is_not_rebuilt(tmp_path, fp8_checkpoint, monkeypatch, small_gate):
    """With a toolchain the engine stage's probe accepts (fake tensorrt_llm package, nvidia-smi
    reporting SM 9.0, trtllm-build on PATH), the stage runs once, is cached, and runs again only
    when a limit changes."""
    from precision_pipeline.pipeline import run_build

    from tests.engine import doubles

    log = doubles.install(tmp_path, monkeypatch)["calls"]  # the stand-in trtllm-build, nvidia-smi (one H100), tensorrt_llm 1.2.1

    prof = tmp_path / "loose.yaml"
    out = tmp_path / "out"

    def build(max_batch_size: int):
        prof.write_text(LOOSE + f"build:\n  max_batch_size: {max_batch_size}\n")
        return _statuses(run_build(str(prof), out=str(out), golden_limit=1, checkpoint=str(fp8_checkpoint)))

    def calls() -> list[list[str]]:
        return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []

    st = build(64)
    assert st["engine"] == "done" and st["pack"] == "done", st
    assert len(calls()) == 1
    assert (out / "engine" / "config.json").is_file() and not (out / "engine" / "ENGINE_ABSENT").exists()
    st = build(64)
    assert st["engine"] == "cached" and st["pack"] == "cached", st
    assert len(calls()) == 1  # not run again
    st = build(32)
    assert st["gate"] == "cached" and st["engine"] == "done", st
    assert len(calls()) == 2
    argv = calls()[-1]
    assert argv[argv.index("--max_batch_size") + 1] == "32"
    rec = json.loads((out / "engine" / "trtllm-build.args.json").read_text())
    assert rec["argv"][rec["argv"].index("--output_dir") + 1] == str((out / "engine").resolve())
    assert json.loads((out / "manifest.json").read_text())["engine_present"] is True
    assert st["engine_gate"] == "skipped"  # the stand-in engine has no runner here (no CUDA device visible)
    # where the engine gate can run, a failing verdict stops the build before pack: exit 3, nothing packed
    from precision_pipeline.core.errors import GateFailed
    from precision_pipeline.gate import engine_gate

    class Failing:
        passed = False

        def failed_metrics(self):
            return ["kl_p99"]

        def summary(self):
            return {"kl_p99": 9.0}

    monkeypatch.setattr(engine_gate, "engine_available", lambda: (True, ""))
    monkeypatch.setattr(engine_gate, "run_engine_gate", lambda *a, **k: Failing())
    packed = {p: p.stat().st_mtime_ns for p in (out / "model_repository").rglob("config.pbtxt")}
    with pytest.raises(GateFailed, match=r"engine gate failed for .*kl_p99"):
        build(16)
    rows = {k: v["status"] for k, v in json.loads((out / "manifest.json").read_text())["stages"].items()}
    assert rows["engine_gate"] == "failed" and rows["engine"] == "done"
    assert {p: p.stat().st_mtime_ns for p in (out / "model_repository").rglob("config.pbtxt")} == packed
    assert "--gather_context_logits" in calls()[-1]  # the gate-only build


def test_the_same_calibration_file_at_another_path_is_the_same_quantize_key(tmp_path, monkeypatch, default_model_dir):
    """Issue 25 item 19: the same dataset at another path re-quantized (the key held the path). The path is an
    unkeyed field of the job (``QuantizeJob.calibration_path``); the file's content is keyed."""

    from tests.conftest import request

    from precision_pipeline.quantize.stage import QuantizeStage
    from precision_pipeline.resolve.plan import evaluate
    from precision_pipeline.spec.model_arch import read_model_arch
    from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile

    arch = read_model_arch(default_model_dir)

    monkeypatch.setenv("PRECISION_CACHE_DIR", str(tmp_path / "cache"))
    m = _model(tmp_path)
    text = '{"text": "one"}\n{"text": "two"}\n'
    for d in ("a", "b/c"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "calib.jsonl").write_text(text)
    (tmp_path / "other.jsonl").write_text('{"text": "three"}\n{"text": "two"}\n')

    def key(ds: str, **cal) -> str:
        prof = validate_profile(deep_merge(load_raw("fp8-h100"), {"calibration": {"dataset": ds, "num_samples": 2, **cal}}))
        st = QuantizeStage()
        inputs = st.inputs(evaluate(prof, arch), request(prof, model_dir=m), {})
        assert inputs.job.calibration_to_read().dataset == (ds if ds == "builtin" else str(tmp_path / ds))  # read where it is
        return stage_mod.stage_key(st, inputs, {})

    k = key(str(tmp_path / "a" / "calib.jsonl"))
    assert key(str(tmp_path / "b" / "c" / "calib.jsonl")) == k
    assert key(str(tmp_path / "other.jsonl")) != k  # other content, other key
    assert key(str(tmp_path / "a" / "calib.jsonl"), seed=1) != k  # the other calibration fields still count
    assert key("builtin") != k
