"""Engine stage: the trtllm-build command line, and an honest skip where it cannot run."""

from __future__ import annotations

import json

from precision_pipeline.engine.trtllm_build import ARGS_FILE, Toolchain, build_args, run_engine

def _plan():
    """A typed plan (tp 1, SM 90) with the limits and per-phase settings the tests below assert."""
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.spec.default_model import ensure_default_model
    from precision_pipeline.spec.profile import load_profile

    base = P.evaluate(load_profile("fp8-h100"), ensure_default_model())
    return base.model_copy(update={
        "limits": P.Limits(max_batch_size=64, max_input_len=4096, max_seq_len=8192, max_num_tokens=8192, max_beam_width=1),
        "effective": base.effective.model_copy(update={
            "context_fmha": True, "use_paged_context_fmha": True, "use_fp8_context_fmha": True,
            "enable_chunked_context": True, "kv_cache_type": "paged", "tokens_per_block": 32, "gemm_plugin": "auto",
            "gpt_attention_plugin": "auto", "logits_dtype": "float32", "multi_block_mode": True}),
    })


PLAN = _plan()


def _argmap(argv):
    out, i = {}, 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]] = argv[i + 1]
            i += 2
        else:
            out[argv[i]] = True
            i += 1
    return out


def test_build_args_per_phase_flags(tmp_path):
    a = _argmap(build_args(PLAN, tmp_path / "ckpt", tmp_path / "eng"))
    assert a["--checkpoint_dir"] == str(tmp_path / "ckpt")
    assert a["--max_seq_len"] == "8192" and a["--max_input_len"] == "4096"
    assert a["--max_num_tokens"] == "8192" and a["--max_batch_size"] == "64"
    assert a["--use_fp8_context_fmha"] == "enable"
    assert a["--use_paged_context_fmha"] == "enable"
    assert a["--logits_dtype"] == "float32"
    assert a["--kv_cache_type"] == "paged"
    assert a["--gemm_plugin"] == "auto"
    assert "--gather_context_logits" not in a
    # multi_block_mode is a runtime knob in TensorRT-LLM 1.x, never a build flag
    assert "--multi_block_mode" not in a


def test_skip_without_tensorrt_llm_writes_args_only(tmp_path):
    res = run_engine(PLAN, tmp_path / "ckpt", tmp_path / "engine", PLAN.gpu.sm, toolchain=Toolchain(False, None, []))
    assert res.status == "skipped"
    assert "tensorrt_llm is not installed" in res.reason
    files = sorted(p.name for p in (tmp_path / "engine").iterdir())
    assert files == ["ENGINE_ABSENT", ARGS_FILE]  # never a fake engine
    rec = json.loads((tmp_path / "engine" / ARGS_FILE).read_text())
    assert rec["status"] == "skipped"
    assert rec["command"].startswith("trtllm-build --checkpoint_dir ")
    assert rec["per_phase"]["context_phase"]["use_fp8_context_fmha"] is True


def test_skip_reasons_name_the_missing_piece():
    assert "no NVIDIA GPU" in Toolchain(True, "/usr/bin/trtllm-build", []).reason_not_buildable(90)
    assert "SM 90" in Toolchain(True, "/usr/bin/trtllm-build", [80]).reason_not_buildable(90)
    assert Toolchain(True, "/usr/bin/trtllm-build", [90]).reason_not_buildable(90) is None
