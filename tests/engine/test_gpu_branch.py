"""The engine stage's GPU branch, exercised with the doubles of tests/engine/doubles.py (no GPU here).

Provenance written and verified (a flipped byte, a truncated or missing rank file, a file from
another build are refused, naming the file), preflight refusals (mixed GPUs, wrong SM, wrong
TensorRT-LLM line, unknown flags under --strict), failure and time-out (exit 5, log tail, log path,
previous engine intact), live progress, and the cached no-op through the runner.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from precision_pipeline.core.errors import EXIT_ENGINE_BUILD_FAILED, EngineBuildFailed, UserError
from precision_pipeline.engine import provenance as prov
from precision_pipeline.engine import trtllm_build as tb
from precision_pipeline.engine.toolchain import detect_toolchain, visible
from tests.engine import doubles
from tests.engine.test_engine import PLAN


def build(tmp_path, strict=False, plan=PLAN, key="ab" * 32, out="engine"):
    return tb.run_engine(plan, tmp_path / "ckpt", tmp_path / "out" / out, plan.gpu.sm, detect_toolchain(),
                         checkpoint_key=key, gpu_name=plan.gpu.name, need_bytes=1 << 30, strict=strict,
                         on_progress=lambda m: None)


def test_probe_reads_every_gpu_and_the_versions(tmp_path, monkeypatch):
    doubles.install(tmp_path, monkeypatch, gpus=[doubles.H100, doubles.A100])
    tc = detect_toolchain()
    assert tc.present() and tc.tensorrt_llm_version == "1.2.1"
    assert [(g.index, g.name, g.sm, g.memory_mib) for g in tc.gpus] == [
        (0, "NVIDIA H100 80GB HBM3", 90, 81559), (1, "NVIDIA A100-SXM4-80GB", 80, 81920)]
    assert tc.gpu_sms == (90, 80)
    assert tc.version("driver") == "575.57.08" and tc.version("cuda_driver") == "12.9"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert [g.name for g in detect_toolchain().gpus] == ["NVIDIA A100-SXM4-80GB"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect_toolchain().gpus == ()


def test_cuda_visible_devices_stops_at_the_first_unknown_entry(tmp_path, monkeypatch):
    doubles.install(tmp_path, monkeypatch, gpus=[doubles.H100, doubles.H100, doubles.H100])
    gpus = list(detect_toolchain().gpus)
    assert [g.index for g in visible(gpus, "2,0")] == [2, 0]
    assert [g.index for g in visible(gpus, "1,7,0")] == [1]
    assert [g.index for g in visible(gpus, "GPU-00000002")] == [2]
    assert visible(gpus, "-1") == []


def test_provenance_written_and_verified(tmp_path, monkeypatch):
    doubles.install(tmp_path, monkeypatch)
    res = build(tmp_path)
    assert res.status == "done"
    eng = tmp_path / "out" / "engine"
    rec = prov.verify_engine_dir(eng)
    assert rec["versions"]["tensorrt_llm"] == "1.2.1" and rec["engine_version"] == "1.2.1"
    assert rec["versions"]["driver"] == "575.57.08" and rec["versions"]["cuda_driver"] == "12.9"
    assert [(g["name"], g["sm"], g["memory_mib"]) for g in rec["gpus"]] == [("NVIDIA H100 80GB HBM3", 90, 81559)]
    assert rec["sm"] == 90 and rec["world_size"] == 1 and rec["checkpoint_key"] == "ab" * 32
    assert rec["argv"][0] == "trtllm-build" and "--output_dir" in rec["argv"]
    assert rec["argv"] == ["trtllm-build", *doubles.calls({"calls": tmp_path / "trtllm-build.calls"})[0]]
    assert set(rec["files"]) == {"config.json", "rank0.engine"}
    assert rec["files"]["rank0.engine"]["size"] == len(b"stand-in, not an engine 0")
    assert rec["trtllm_build_help"]["size"] > 0 and len(rec["trtllm_build_help"]["sha256"]) == 64
    assert rec["host"] and rec["time"] and rec["log"].endswith("logs/trtllm-build.log")
    assert Path(rec["log"]).is_file()


def test_image_from_the_environment_is_recorded(tmp_path, monkeypatch):
    doubles.install(tmp_path, monkeypatch)
    monkeypatch.setenv(prov.IMAGE_ENV, "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3")
    build(tmp_path)
    assert prov.read_provenance(tmp_path / "out" / "engine")["image"] == "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"


@pytest.mark.parametrize("damage,says", [
    ("flip", "does not match the sha256"),
    ("truncate", "truncated"),
    ("delete", "is missing"),
    ("extra", "comes from another build"),
])
def test_tampered_engine_is_refused_naming_the_file(tmp_path, monkeypatch, damage, says):
    doubles.install(tmp_path, monkeypatch)
    build(tmp_path)
    eng = tmp_path / "out" / "engine"
    f = eng / "rank0.engine"
    data = bytearray(f.read_bytes())
    if damage == "flip":
        data[3] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(bytes(data[:-1]))
    elif damage == "delete":
        f.unlink()
    else:
        f = eng / "rank1.engine"
        f.write_bytes(b"from another build")
    with pytest.raises(UserError) as e:
        prov.verify_engine_dir(eng)
    assert e.value.problems[0].field == f"engine: {f}" and says in e.value.problems[0].reason


def test_missing_rank_file_of_a_multi_gpu_build_fails_the_build(tmp_path, monkeypatch):
    doubles.install(tmp_path, monkeypatch, mode="missing-rank")
    plan = PLAN.model_copy(update={"mapping": PLAN.mapping.model_copy(update={"tp_size": 2, "world_size": 2})})
    with pytest.raises(EngineBuildFailed) as e:
        build(tmp_path, plan=plan)
    assert "rank engines [0]" in str(e.value) and "2 GPU(s)" in str(e.value)
    assert not (tmp_path / "out" / "engine").exists()


def test_mixed_gpus_are_refused_before_any_gpu_time(tmp_path, monkeypatch):
    paths = doubles.install(tmp_path, monkeypatch, gpus=[doubles.H100, doubles.A100])
    with pytest.raises(UserError) as e:
        build(tmp_path)
    fields = [p.field for p in e.value.problems]
    assert fields == ["engine.gpus", "target.gpu"]
    assert "GPU 1 (NVIDIA A100-SXM4-80GB) is SM 80" in e.value.problems[1].reason
    assert "CUDA_VISIBLE_DEVICES=0" in e.value.problems[0].fix
    assert doubles.calls(paths) == []  # trtllm-build never started
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert build(tmp_path).status == "done"


def test_wrong_sm_and_too_little_memory_are_refused(tmp_path, monkeypatch):
    doubles.install(tmp_path, monkeypatch, gpus=[doubles.L4])
    with pytest.raises(UserError) as e:
        tb.run_engine(PLAN, tmp_path / "ckpt", tmp_path / "engine", 90, detect_toolchain(), gpu_name="H100",
                      need_bytes=30 << 30, on_progress=lambda m: None)
    assert [p.field for p in e.value.problems] == ["target.gpu", "engine.memory"]
    assert "23034 MiB" in e.value.problems[1].reason and "30720 MiB" in e.value.problems[1].reason


def test_no_gpu_is_still_an_honest_skip(tmp_path, monkeypatch):
    paths = doubles.install(tmp_path, monkeypatch, gpus=[])
    res = build(tmp_path)
    assert res.status == "skipped" and "no NVIDIA GPU" in res.reason and doubles.calls(paths) == []


@pytest.mark.parametrize("version", ["1.3.0rc24", "1.1.0", "0.21.0"])
def test_trtllm_off_the_pinned_line_is_refused(tmp_path, monkeypatch, version):
    doubles.install(tmp_path, monkeypatch, version=version)
    with pytest.raises(UserError) as e:
        build(tmp_path)
    assert e.value.problems[0].field == "tensorrt_llm" and version in e.value.problems[0].reason


def test_unknown_flag_is_refused_under_strict_and_a_warning_otherwise(tmp_path, monkeypatch):
    paths = doubles.install(tmp_path, monkeypatch, help_drop="--use_fp8_context_fmha")
    with pytest.raises(UserError) as e:
        build(tmp_path, strict=True)
    assert e.value.problems[0].field == "engine.flags" and "--use_fp8_context_fmha" in e.value.problems[0].reason
    assert doubles.calls(paths) == []
    res = build(tmp_path)
    assert res.status == "done" and any("--use_fp8_context_fmha" in w for w in res.warnings)
    rec = json.loads((tmp_path / "out" / "engine" / tb.ARGS_FILE).read_text())
    assert rec["warnings"] == res.warnings


def test_failed_build_is_a_clean_error_and_keeps_the_previous_engine(tmp_path, monkeypatch):
    doubles.install(tmp_path, monkeypatch)
    build(tmp_path)
    eng = tmp_path / "out" / "engine"
    before = prov.verify_engine_dir(eng)["build_id"]
    monkeypatch.setenv("FAKE_TRTLLM_MODE", "fail")
    with pytest.raises(EngineBuildFailed) as e:
        build(tmp_path)
    msg = str(e.value)
    assert e.value.exit_code == EXIT_ENGINE_BUILD_FAILED == 5
    assert "exited with status 1" in msg and "OutOfMemory" in msg and "Engine building failed" in msg
    assert f"full log: {tmp_path / 'out' / 'logs' / 'trtllm-build.log'}" in msg
    assert "phase: building network" in msg
    assert prov.verify_engine_dir(eng)["build_id"] == before  # the previous engine is intact
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith(".")]


def test_timed_out_build_is_stopped_with_its_phase(tmp_path, monkeypatch):
    doubles.install(tmp_path, monkeypatch, mode="hang")
    monkeypatch.setenv(tb.TIMEOUT_ENV, "1.5")
    with pytest.raises(EngineBuildFailed) as e:
        build(tmp_path)
    assert "time limit of 2s" in str(e.value) and "phase: building network" in str(e.value)
    assert not (tmp_path / "out" / "engine").exists()


def test_live_progress_says_elapsed_time_and_phase(tmp_path, monkeypatch):
    paths = doubles.install(tmp_path, monkeypatch, mode="hang")
    lines: list[str] = []
    with pytest.raises(EngineBuildFailed):
        tb.run_trtllm_build(str(paths["bin"] / "trtllm-build"), ["--output_dir", str(tmp_path / "e")],
                            tmp_path / "b.log", timeout_s=2.5, on_progress=lines.append, every_s=0.5)
    assert lines and all(ln.startswith("[engine] trtllm-build: ") for ln in lines)
    assert lines[-1].startswith("[engine] trtllm-build: building network (") and lines[-1].endswith("s)")


def test_bad_timeout_setting_is_a_user_error(tmp_path, monkeypatch):
    doubles.install(tmp_path, monkeypatch)
    monkeypatch.setenv(tb.TIMEOUT_ENV, "soon")
    with pytest.raises(UserError) as e:
        build(tmp_path)
    assert e.value.problems[0].field == tb.TIMEOUT_ENV


def test_phase_parser_and_log_tail():
    assert tb.phase_of(["[TRT-LLM] [I] Loading checkpoint from /c"]) == "loading checkpoint"
    assert tb.phase_of(["x", "[TRT-LLM] [I] Serializing engine to /e"], "building network") == "serializing engine"
    assert tb.phase_of(["nothing known"], "building network") == "building network"
    log = "\n".join([f"[TRT] [I] step {i}" for i in range(40)] + ["", "=====", "[TRT] [E] 2: OutOfMemory", "bye"])
    tail = tb.meaningful_tail(log, n=3)
    assert tail == ["[TRT] [I] step 39", "[TRT] [E] 2: OutOfMemory", "bye"]


def test_unchanged_engine_is_a_cached_no_op_through_the_runner(tmp_path, monkeypatch):
    from precision_pipeline.engine.stage import EngineStage

    paths = doubles.install(tmp_path, monkeypatch)
    out, runner, up, req = doubles.stage_runner(tmp_path)
    first = runner.run(EngineStage(), PLAN, req, up)
    assert first.record.status == "done" and first.artifact.built
    second = runner.run(EngineStage(), PLAN, req, up)
    assert second.record.status == "cached" and second.key == first.key
    assert len(doubles.calls(paths)) == 1  # not run again
    assert prov.verify_engine_dir(out / "engine")["checkpoint_key"] == "1" * 64
    # a node without the toolchain accepts the verified engine built from the same checkpoint (built elsewhere)
    monkeypatch.setenv("FAKE_GPUS", "")
    third = runner.run(EngineStage(), PLAN, req, up)
    assert third.record.status == "cached" and third.key == first.key
    # ...but not after a byte of it changed: then it is an honest skip
    f = out / "engine" / "rank0.engine"
    f.write_bytes(f.read_bytes()[:-1])
    assert runner.run(EngineStage(), PLAN, req, up).record.status == "skipped"


def test_gate_only_build_is_the_served_argv_plus_context_logits(tmp_path):
    from precision_pipeline.gate.engine_gate import gate_build_args

    served = tb.build_args(PLAN, tmp_path / "ckpt", tmp_path / "engine")
    gate = gate_build_args(served, tmp_path / "engine_gate" / "engine")
    assert "--gather_context_logits" not in served
    assert gate[gate.index("--output_dir") + 1] == str(tmp_path / "engine_gate" / "engine")
    assert [a for a in gate if a != "--gather_context_logits"] == [
        str(tmp_path / "engine_gate" / "engine") if a == str(tmp_path / "engine") else a for a in served]
    assert gate_build_args(gate, tmp_path / "g").count("--gather_context_logits") == 1
