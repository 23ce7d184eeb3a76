"""Planning from a config.json alone (issue 29): the Qwen2.5-72B-Instruct config (tests/data/models, the real
values of Qwen/Qwen2.5-72B-Instruct config.json), its parameter count and memory plan with the QKV bias terms,
a verdict per shipped profile, what needs the weights, and the build's refusal naming the missing stages."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.resolve import plan as P
from precision_pipeline.spec import families as FAM
from precision_pipeline.spec.default_model import NEEDS_WEIGHTS, model_dir, model_files, plan_model_dir
from precision_pipeline.spec.model_arch import read_model_arch
from precision_pipeline.spec.profile import shipped_profiles
from tests.conftest import prof

QWEN72 = Path(__file__).resolve().parents[1] / "data" / "models" / "Qwen2.5-72B-Instruct"
H, I, L, V = 8192, 29568, 80, 152064
QKV = (64 + 2 * 8) * 128  # q, k, v output rows: 10,240 (head_dim 8192 / 64 = 128)


def test_qwen25_72b_config_reads_as_published():
    """Qwen2.5-72B-Instruct's model card: 72.7 B parameters, 80 layers, 64 Q / 8 KV heads, QKV bias (its
    "70.0 B non-embedding" is 70.21 B by this count: total less the two 152,064 x 8192 tables). Hand count: per layer q/k/v/o 8192 x 10,240 + 8192 x 8192, the 3 bias vectors 10,240, gate/up/down
    3 x 8192 x 29,568, 2 norms; embedding and the untied lm_head 152,064 x 8192 each; the final norm."""
    m = read_model_arch(QWEN72)
    assert (m.architecture, m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (
        "Qwen2ForCausalLM", 80, 8192, 64, 8, 128)
    assert (m.intermediate_size, m.vocab_size, m.max_position_embeddings, m.tied_embeddings, m.dtype) == (
        29568, 152064, 32768, False, "bfloat16")
    assert m.attention_bias  # from the family (spec/families.py): Qwen2's config.json does not say it
    per_layer = H * QKV + H * H + QKV + 3 * H * I + 2 * H
    assert per_layer == 877_684_736
    assert m.num_params == L * per_layer + 2 * V * H + H == 72_706_203_648
    print(f"Qwen2.5-72B-Instruct parameters: {m.num_params:,} (published: 72.7 B)")
    assert round(m.num_params / 1e9, 1) == 72.7
    assert m.num_params - 2 * V * H == 70_214_787_072


def test_qwen2_memory_plan_counts_the_three_bias_vectors_per_layer():
    """BF16 weights on one GPU: decoder 80 x 2 B x per-layer elements (biases in the model dtype), embedding and
    lm_head (+ final norm) in BF16; the biases weigh exactly 80 x 10,240 x 2 B, half of that per GPU at tp 2."""
    m = read_model_arch(QWEN72)
    no_bias = m.model_copy(update={"attention_bias": False})
    plan = P.evaluate(prof("bf16-h100"), m)
    wb = plan.memory.weight_breakdown
    assert (wb.decoder, wb.embedding, wb.lm_head, wb.total) == (
        140_429_557_760, 2_491_416_576, 2_491_432_960, 145_412_407_296)
    assert wb.decoder == L * 2 * (H * QKV + H * H + QKV + 3 * H * I + 2 * H)
    assert [pr.rule for pr in plan.problems] == ["memory.fit"]  # 135.43 GiB of BF16 weights on an 80 GB H100
    bias = plan.memory.weight_bytes_per_gpu - P.evaluate(prof("bf16-h100"), no_bias).memory.weight_bytes_per_gpu
    assert bias == L * QKV * 2 == 1_638_400
    tp2 = prof("bf16-h100", parallel__tp_size=2)
    bias2 = P.evaluate(tp2, m).memory.weight_bytes_per_gpu - P.evaluate(tp2, no_bias).memory.weight_bytes_per_gpu
    assert bias2 == L * (32 + 2 * 4) * 128 * 2 == 819_200
    # a quantized format keeps the biases in the model dtype: the same 1,638,400 B beside INT4 AWQ weights
    awq = P.evaluate(prof("int4-awq-a100"), m)
    assert awq.ok and awq.memory.weight_breakdown.total == 44_491_698_176
    assert awq.memory.weight_bytes_per_gpu - P.evaluate(prof("int4-awq-a100"), no_bias).memory.weight_bytes_per_gpu == 1_638_400


def test_check_all_from_config_alone_gives_a_verdict_per_shipped_profile():
    """The done-when of issue 29: a folder holding only Qwen2.5-72B's config.json gets a verdict per shipped profile
    (the timing is printed, not asserted: benchmarks/check.py --model tests/data/models/Qwen2.5-72B-Instruct)."""
    d = plan_model_dir(str(QWEN72))
    assert model_files(d).planning_note() and not model_files(d).buildable
    t = time.perf_counter()
    rows = P.check_all(d, for_build=False)
    print(f"check_all over {len(rows)} profiles from config.json alone: {(time.perf_counter() - t) * 1000:.0f} ms")
    got = {name: (ok, line) for name, ok, line in rows}
    assert list(got) == list(shipped_profiles())
    assert got["int4-awq-a100"] == (True, "W4A16_AWQ GEMMs, NONE KV on a100-80gb (SM 80), tp 1 x pp 1: weights 41.436 "
                                          "GiB/GPU, KV 327,680 B/token, 106,432 tokens (25 seqs at 4,096); 1 warning")
    assert got["bf16-h100"][0] is False and got["bf16-h100"][1].endswith("(rule memory.fit)")
    assert "weights 135.43 GiB" in got["bf16-h100"][1]
    assert got["nvfp4-b200"][0] is True and "weights 41.427 GiB/GPU" in got["nvfp4-b200"][1]


def test_what_a_config_only_folder_lacks_and_what_needs_it(tmp_path):
    """model_files is the one test of "buildable or planned only": it names every missing file; model_dir (build)
    refuses with all of them, plan_model_dir (check, profiles, compare, recommend) takes the folder."""
    cfg_only = tmp_path / "m"
    cfg_only.mkdir()
    (cfg_only / "config.json").write_text((QWEN72 / "config.json").read_text())
    mf = model_files(cfg_only)
    assert mf.weights == () and mf.tokenizer == () and len(mf.missing) == 2
    note = mf.planning_note()
    assert "no *.safetensors weights" in note[0] and "no tokenizer" in note[0] and "config.json alone" in note[0]
    assert len(note) == 1 + len(NEEDS_WEIGHTS)
    assert note[1].startswith("needs the weights and tokenizer: model fingerprint")
    assert any(n.startswith("needs the tokenizer: calibration token lengths") for n in note)
    assert plan_model_dir(str(cfg_only)) == cfg_only.resolve()
    with pytest.raises(UserError) as ei:
        model_dir(str(cfg_only))
    pr = ei.value.problems[0]
    assert pr.field == "--model" and "has no *.safetensors weights" in pr.reason and "and no tokenizer" in pr.reason
    (cfg_only / "model-00001-of-00037.safetensors").write_bytes(b"")
    assert model_files(cfg_only).missing == (model_files(cfg_only).missing[0],)
    assert model_files(cfg_only).missing[0].startswith("no tokenizer")
    with pytest.raises(UserError, match="has no tokenizer"):
        model_dir(str(cfg_only))
    (cfg_only / "tokenizer.json").write_text("{}")
    assert model_files(cfg_only).buildable and model_files(cfg_only).planning_note() == []


def test_qwen2_is_planned_and_built():
    """Qwen2: same linears as Llama (the unified ModelWeightsLoader names), a QKV bias, TensorRT-LLM's
    QWenForCausalLM; planning works and a build (weights present) passes resolve: quantize and gate read it."""
    q = FAM.FAMILIES["Qwen2ForCausalLM"]
    assert q.attention_bias and q.trtllm_class == "QWenForCausalLM" and q.linears == FAM.LLAMA.linears
    assert q.build_gaps() == () == FAM.LLAMA.build_gaps()
    q3 = FAM.FAMILIES["Qwen3ForCausalLM"]  # served on route llm_api only, built there through its unified HF checkpoint
    assert q3.hf_read and q3.build_gaps() == () == q3.build_gaps("llm_api", "FP8", "NONE")
    assert [stage for stage, _ in q3.build_gaps("llm_api", "NVFP4", "NONE")] == ["gate"]
    assert "qwen/config.py" in q.sources["attention_bias"] and "modeling_qwen.py" in q.sources["routes"]
    m = read_model_arch(QWEN72)
    assert P.evaluate(prof("int4-awq-a100"), m).ok  # planning: no build-only rule
    built = P.evaluate(prof("int4-awq-a100"), m, for_build=True)
    assert [x for x in built.problems if x.rule == "model.gate_reads"] == []


def test_readme_family_table_lists_every_family_with_its_build_gaps():
    """README "Model families": one row naming each registry architecture; a row of a family the build cannot
    run end to end names each stage it lacks (Family.build_gaps), a buildable family's row names none."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = text.split("### Model families", 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    for arch, fam in FAM.FAMILIES.items():
        row = [r for r in rows if f"`{arch}`" in r.split("|")[1]]
        assert len(row) == 1, arch
        build = row[0].split("|")[3]
        assert all(stage in build for stage, _ in fam.build_gaps()), (arch, build)
        assert ("refused" in build) == bool(fam.build_gaps()), (arch, build)


MISTRAL_7B_V01 = {  # mistralai/Mistral-7B-v0.1 config.json
    "architectures": ["MistralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "sliding_window": 4096, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "model_type": "mistral"}


def test_mistral_is_planned_from_its_config_with_llama_terms_and_built(tmp_path):
    """Mistral: Llama's linears, no bias terms (7,241,732,096 parameters, published 7.24 B); every shipped profile
    gets a verdict from config.json alone; a build passes resolve (quantize and gate read it)."""
    import json

    d = tmp_path / "Mistral-7B-v0.1"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(MISTRAL_7B_V01))
    m = read_model_arch(d)
    assert not m.attention_bias
    assert m.num_params == 32 * (4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    assert m.num_params == 7_241_732_096
    fam = FAM.FAMILIES["MistralForCausalLM"]
    assert "modeling_llama.py" in fam.sources["routes"] and "max_attention_window_size" in fam.sources["sliding_window"]
    rows = P.check_all(d, for_build=False)
    assert [r[0] for r in rows] == list(shipped_profiles()) and dict((r[0], r[1]) for r in rows)["fp8-h100"]
    assert [x for x in P.evaluate(prof("fp8-h100"), m, for_build=True).problems if x.rule == "model.gate_reads"] == []
    # the 4,096-token window under fp8-h100's max_seq_len 8,192: a warning (no max_attention_window_size rendered)
    assert m.sliding_window == 4096
    warned = [w for w in P.evaluate(prof("fp8-h100"), m).warnings if "sliding_window" in w]
    assert len(warned) == 1 and "set build.max_seq_len <= 4096" in warned[0]
    assert not any("sliding_window" in w for w in P.evaluate(prof("fp8-h100", build__max_seq_len=4096), m).warnings)


def test_check_all_imports_no_torch():
    """`invoke check --all` plans without torch (gate.metrics and quantize.stage import it only when a single
    profile is checked for a build); a fresh process, as the CLI runs it."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = ("import contextlib, io, sys; from precision_pipeline.cli import build as B\n"
            "with contextlib.redirect_stdout(io.StringIO()): rc = B.check(all=True, model=sys.argv[1])\n"
            "print(rc, 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code, str(QWEN72)], cwd=root, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root / "build")})
    assert p.stdout.split() == ["2", "False"], p.stdout + p.stderr
