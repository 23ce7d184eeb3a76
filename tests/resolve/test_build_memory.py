"""The build's own memory (quantize and the gate) planned from config.json before anything is loaded:
device selection, every refusal of rule ``memory.build_fit`` and its fixes, on the real config.json
files of Llama-3.1-8B/70B/405B (tests/data/models; no weights)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.resolve import plan as P
from precision_pipeline.resolve import build_memory as BM
from precision_pipeline.spec.device import GpuInfo, Machine, probe_machine, select_device
from precision_pipeline.spec.hardware import GIB
from precision_pipeline.spec.model_arch import read_model_arch
from tests.conftest import prof

DATA = Path(__file__).resolve().parents[1] / "data" / "models"
H100_MIB, H200_MIB = 81559, 143771  # driver-reported (spec/hardware.py)


def arch(name: str):
    return read_model_arch(DATA / f"Llama-3.1-{name}")


def machine(host_gib: float, gpus: int = 0, mib: int = H100_MIB, name: str = "NVIDIA H100 80GB HBM3") -> Machine:
    b = mib * 2**20
    return Machine(host_available_bytes=int(host_gib * GIB), host_total_bytes=int(host_gib * GIB),
                   gpus=tuple(GpuInfo(index=i, name=name, total_bytes=b, free_bytes=b) for i in range(gpus)),
                   no_cuda="" if gpus else "no NVIDIA driver on this machine (test)")


def plan(model: str, m: Machine, asked="auto", ref="float32", base="fp8-h100", **dotted):
    p = prof(base, deployment__fallback=None, deployment__warm_fallback=False, **dotted)
    return P.evaluate(p, arch(model), for_build=True, device=select_device(asked, m, ref))


def fit_problems(pl):
    return [pr for pr in pl.problems if pr.rule == "memory.build_fit"]


def test_real_configs_give_the_published_parameter_counts():
    # 2 bytes x these = the safetensors index total_size of the BF16 releases
    assert arch("8B").num_params == 8_030_261_248
    assert arch("70B").num_params == 70_553_706_496
    assert arch("405B").num_params == 405_853_388_800


# ------------------------------------------------------------------------------------------------
# Device selection


def test_auto_picks_the_cpu_here_and_says_why():
    m = probe_machine("auto")
    d = select_device("auto", m)
    assert d.device == "cpu" and not d.is_cuda and d.gpus == ()
    assert d.reason.startswith("auto: no CUDA device (") and m.no_cuda in d.reason
    assert "host memory" in d.reason and d.host_available_bytes > 0
    assert d.compute_dtype("bfloat16") == "float32" and d.device_map() is None


def test_auto_takes_cuda_when_torch_sees_gpus_and_cpu_when_asked():
    m = machine(2048, gpus=8)
    d = select_device("auto", m)
    assert d.device == "cuda" and len(d.gpus) == 8 and d.compute_dtype("bfloat16") == "bfloat16"
    assert d.device_map() == "auto" and d.short() == "cuda x8 (NVIDIA H100 80GB HBM3)"
    assert d.reason.startswith("auto: torch sees CUDA: 8 GPU(s) (NVIDIA H100 80GB HBM3), 637.2 GiB free in all")
    c = select_device("cpu", m)
    assert c.device == "cpu" and c.gpus == () and c.reason.startswith("--device cpu asked")


def test_cuda_without_a_gpu_and_bad_values_are_refused():
    with pytest.raises(UserError) as e:
        select_device("cuda", machine(64))
    pr = e.value.problems[0]
    assert pr.field == "--device" and "no NVIDIA driver on this machine (test)" in pr.reason
    with pytest.raises(UserError) as e:
        select_device("gpu", machine(64))
    assert e.value.problems[0].field == "--device" and "auto, cpu, cuda" in e.value.problems[0].fix
    with pytest.raises(UserError) as e:
        select_device("auto", machine(64), reference_dtype="float16")
    assert e.value.problems[0].field == "--reference-dtype"


def test_cuda_via_the_cli_is_refused_before_anything_is_written(tmp_path, default_model_dir):
    from precision_pipeline.pipeline import build_request

    with pytest.raises(UserError) as e:
        build_request("fp8-h100", str(default_model_dir), str(tmp_path / "out"), device="cuda")
    assert e.value.problems[0].field == "--device" and not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------
# The numbers


def test_the_plan_counts_bytes_per_parameter_as_documented():
    a = arch("8B")
    pl = plan("8B", machine(1024))  # CPU: FP32 everything
    bm = pl.build_memory
    P_ = a.num_params
    assert bm["quantize"]["weights"] == 4 * P_ and bm["gate"]["reference"] == 4 * P_
    assert bm["gate"]["floor"] == 2 * P_ and bm["gate"]["candidate"] == 4 * P_
    assert bm["quantize"]["calibration_activations"] == 8 * 256 * (4 * 4096 + 3 * 14336 + 128256) * 4
    assert bm["quantize"]["search"] == 0 and bm["noise_floor"] is True
    ck = bm["checkpoint_bytes_estimate"]
    assert bm["quantize"]["host_bytes"] == 4 * P_ + bm["quantize"]["calibration_activations"] + ck
    assert bm["gate"]["host_bytes"] == 10 * P_ + bm["gate"]["activations"] + ck
    assert pl.ok and pl.to_json()["build_memory"]["device"]["device"] == "cpu"
    # on CUDA: the profile's dtype, and the reference alone in FP32
    g = plan("8B", machine(1024, gpus=1)).build_memory
    assert g["compute_dtype"] == "bfloat16" and g["quantize"]["weights"] == 2 * P_
    assert g["gate"]["device_bytes"] == 4 * P_ + 2 * P_ + 2 * P_ + g["gate"]["activations"]
    assert g["gate"]["host_bytes"] == 4 * P_ + 2 * P_  # the reader's FP32 tensors + the candidate built on the host
    # a BF16 reference: no floor, half the reference
    b = plan("8B", machine(1024, gpus=1), ref="bfloat16").build_memory
    assert b["gate"]["reference"] == 2 * P_ and b["gate"]["floor"] == 0 and b["noise_floor"] is False


def test_gpus_needed_is_the_smallest_count_that_holds_it():
    per, block = 80 * GIB, 5 * GIB
    assert BM.gpus_needed(10 * GIB, per, block) == 1
    k = BM.gpus_needed(500 * GIB, per, block)
    usable = lambda n: n * (per - (1 << 30)) - (n - 1) * block  # noqa: E731
    assert usable(k) >= 500 * GIB > usable(k - 1)
    assert BM.gpus_needed(500 * GIB, 4 * GIB, 5 * GIB) is None  # one layer alone does not fit a GPU


# ------------------------------------------------------------------------------------------------
# Every refusal, with its numbers and fix


def test_70b_fits_8_h100_on_cuda():
    pl = plan("70B", machine(2048, gpus=8))
    assert pl.ok, [pr.render() for pr in pl.problems]
    bm = pl.build_memory
    assert bm["fits_device"] and bm["fits_host"]
    assert bm["gate"]["device_bytes"] < bm["device_usable_bytes"]


def test_70b_gate_on_3_h200_needs_a_bf16_reference():
    pl = plan("70B", machine(2048, gpus=3, mib=H200_MIB, name="NVIDIA H200"))
    (pr,) = fit_problems(pl)
    assert pr.field == "--device"
    assert pr.reason.startswith("the gate needs ~539.5")
    assert "FP32 reference 262.83 GiB + its BF16 copy for the noise floor 131.42 GiB + the candidate in bfloat16 131.42 GiB" in pr.reason
    assert "the 3 visible GPU(s) (NVIDIA H200, 140.40 GiB free on the fullest)" in pr.reason
    assert "make at least 4 such GPUs visible" in pr.fix
    assert "--reference-dtype bfloat16 (then ~270.2" in pr.fix and "fits)" in pr.fix
    ok = plan("70B", machine(2048, gpus=3, mib=H200_MIB, name="NVIDIA H200"), ref="bfloat16")
    assert ok.ok and ok.build_memory["reference_dtype"] == "bfloat16"


def test_405b_on_8_h100_refuses_quantize_gate_and_host_memory():
    pl = plan("405B", machine(2048, gpus=8), base="fp8-h100", parallel__tp_size=8, deployment__gpus_per_replica=8)
    probs = fit_problems(pl)
    assert [p.reason.split(" needs")[0] for p in probs] == ["quantize", "the gate", "the gate"]
    q, g, h = probs
    assert "weights 405,853,388,800 parameters x 2 B (bfloat16) = 755.96 GiB" in q.reason
    assert "make at least 12 such GPUs visible" in q.fix
    assert "--device cpu (needs ~" in q.fix and "so it does not fit either" in q.fix
    assert "lower calibration.batch_size or calibration.seq_len" in q.fix
    assert "--reference-dtype bfloat16 (then ~" in g.fix and "still too much" in g.fix
    assert "of host memory on CUDA (the checkpoint reader's FP32 tensors" in h.reason and "2,048.00 GiB available" in h.reason


def test_70b_on_a_cpu_machine_points_to_cuda_with_the_gpu_count():
    pl = plan("70B", machine(256))
    q, g = fit_problems(pl)
    assert q.reason.startswith("quantize on the CPU needs ~332.38 GiB of host memory (weights 70,553,706,496 parameters "
                               "x 4 B (float32) = 262.83 GiB")
    assert "256.00 GiB available (auto: no CUDA device" in q.reason
    assert q.fix.startswith("--device cuda on a GPU node (~132.36 GiB of GPU memory in bfloat16, e.g. 2 x NVIDIA H100")
    assert g.reason.startswith("the gate on the CPU needs ~741.32 GiB")
    assert "e.g. 8 x NVIDIA H100" in g.fix and "--reference-dtype bfloat16 (then ~472.05 GiB: still too much)" in g.fix


def test_8b_on_a_64_gib_cpu_machine_fits_with_a_bf16_reference():
    (g,) = fit_problems(plan("8B", machine(64)))
    assert g.reason.startswith("the gate on the CPU needs ~91.75 GiB")
    assert "--reference-dtype bfloat16 (then ~58.63 GiB: fits)" in g.fix
    assert plan("8B", machine(64), ref="bfloat16").ok


def test_calibration_batches_too_large_for_one_gpu_name_the_calibration_fix():
    pl = plan("8B", machine(2048, gpus=1, mib=23034, name="NVIDIA L4"), ref="bfloat16",
              calibration__batch_size=64, calibration__seq_len=2048)
    q = [p for p in fit_problems(pl) if p.reason.startswith("quantize")][0]
    acts = 64 * 2048 * (4 * 4096 + 3 * 14336 + 128256) * 2
    assert f"calibration activations ~{acts / GIB:,.2f} GiB (batch_size 64 x seq_len 2048)" in q.reason
    assert "lower calibration.batch_size or calibration.seq_len" in q.fix
    small = plan("8B", machine(2048, gpus=1, mib=23034, name="NVIDIA L4"), ref="bfloat16")
    assert not [p for p in fit_problems(small) if p.reason.startswith("quantize")]  # 8 x 256 fits


def test_a_reused_checkpoint_skips_the_quantize_phase(tmp_path):
    p = prof("fp8-h100", deployment__fallback=None, deployment__warm_fallback=False)
    d = select_device("auto", machine(256))
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text('{"architecture": "LlamaForCausalLM", "mapping": {"world_size": 1, "tp_size": 1, '
                                    '"pp_size": 1}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}')
    pl = P.evaluate(p, arch("70B"), checkpoint_dir=ck, for_build=True, device=d)
    assert [pr.reason.split(" on the CPU")[0] for pr in fit_problems(pl)] == ["the gate"]


def test_no_device_no_plan_and_the_default_model_fits_here(default_model_dir):
    p = prof("fp8-h100")
    assert P.evaluate(p, default_model_dir, for_build=True).build_memory is None
    pl = P.evaluate(p, default_model_dir, for_build=True, device=select_device("auto", probe_machine("auto")))
    assert pl.ok and pl.build_memory["peak_bytes"] < 4 * GIB  # the gate's KV/logits estimate is generous for 135M
    assert math.isclose(pl.build_memory["num_params"], 134_515_008, rel_tol=0.01)


def test_gate_architectures_are_refused_at_resolve_with_the_list():
    from tests.resolve.test_plan import MIXTRAL

    from precision_pipeline.spec.families import GATE_ARCHITECTURES
    from precision_pipeline.spec.model_arch import arch_from_config

    pl = P.evaluate(prof("fp8-h100"), arch_from_config(MIXTRAL, name="mixtral"), for_build=True)
    pr = [x for x in pl.problems if x.rule == "model.gate_reads"][0]
    assert GATE_ARCHITECTURES == ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
    assert ("the accuracy gate's checkpoint reader handles LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM only"
            in pr.reason)
    assert pr.fix.startswith("use a model of: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (MixtralForCausalLM, "
                             "Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM: route llm_api with FP8 or NO_QUANT "
                             "and kv_cache_quant_algo NONE, spec/families.py Family.hf_read;"), pr.fix
    # Mixtral on the engine route: ModelOpt exports it (decoder llama), the gate has no reader of that checkpoint
    assert "Stages missing for MixtralForCausalLM: gate: the accuracy gate has no reader of its TensorRT-LLM" in pr.reason
    assert "quantize:" not in pr.reason and "route llm_api reads its unified HF checkpoint" in pr.reason
    mx_llm = P.evaluate(prof("fp8-h100-llmapi", quantization__kv_cache_quant_algo="NONE"),
                        arch_from_config(MIXTRAL, name="mixtral"), for_build=True)
    assert [x for x in mx_llm.problems if x.rule == "model.gate_reads"] == []
    # Qwen3-MoE: built on route llm_api (no model.gate_reads), refused on the engine route naming both stages
    q3 = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128,
          "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
          "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}
    m = arch_from_config(q3, name="q3moe")
    llm = P.evaluate(prof("fp8-h100-llmapi", quantization__kv_cache_quant_algo="NONE"), m, for_build=True)
    assert [x for x in llm.problems if x.rule == "model.gate_reads"] == []
    (eng,) = [x for x in P.evaluate(prof("fp8-h100"), m, for_build=True).problems if x.rule == "model.gate_reads"]
    assert "Stages missing for Qwen3MoeForCausalLM: quantize:" in eng.reason and "; gate:" in eng.reason
    (kv,) = [x for x in P.evaluate(prof("fp8-h100-llmapi"), m, for_build=True).problems if x.rule == "model.gate_reads"]
    assert ("gate: the gate's HF reader (gate/moe_model.py load_hf_moe_model) reads an unquantized KV cache only, not FP8"
            in kv.reason)  # FP8 KV


def test_free_host_memory_is_recorded_but_not_keyed():
    """plan.json records the build machine's free memory; a stage key (the plan's canonical form) does
    not see it, so a build whose inputs did not change is not re-packed because memory moved."""
    a, b = plan("8B", machine(100.0)), plan("8B", machine(120.0))
    assert a.ok and b.ok
    assert a.to_json()["build_memory"]["host_available_bytes"] != b.to_json()["build_memory"]["host_available_bytes"]
    assert "build_memory" not in a.canonical() and a.canonical() == b.canonical()


def test_device_cuda_without_a_gpu_says_what_is_missing(monkeypatch):
    """Issue 25 item 21: ``--device cuda`` on a machine without a GPU said "not asked (--device cpu)"."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.spec import device as dev

    monkeypatch.setattr(dev, "nvidia_driver_present", lambda: False)
    with pytest.raises(UserError) as e:
        dev.choose_device("cuda")
    pr = e.value.problems[0]
    assert pr.field == "--device" and "cuda was asked but no CUDA device is usable here: no NVIDIA driver" in pr.reason
    assert "not asked" not in pr.reason
    with pytest.raises(UserError, match="is not a reference dtype"):
        dev.choose_device("cuda", reference_dtype="float8")
    with pytest.raises(UserError, match="is not a device"):
        dev.choose_device("gpu")
    assert dev.choose_device("auto").device == "cpu"
