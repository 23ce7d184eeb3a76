"""Per-layer sensitivity (build/precision_pipeline/analysis/sensitivity.py) on the fp8 test checkpoint, kept small: two short
golden prompts and the last two decoder layers (a cell in layer 28 runs two layers + lm_head).

Checks: packed reference == plain forward; a cell with the exact FP32 weights has KL 0 and the
FP32 modules come back; resume from cells.jsonl after a simulated kill (only the rest is
measured, a torn line is dropped); a corrupted cell (weight scale x10) ranks first and is the
suggested exclusion, verified; the heatmap PNG decodes at its size; the gate report gets the
heatmap; greedy suggestion and patterns on synthetic numbers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from precision_pipeline.core.errors import UserError
from precision_pipeline.analysis.evaluator import KINDS, Cell, Evaluator
from precision_pipeline.analysis.heatmap import heatmap_size, plot_heatmap
from precision_pipeline.analysis.sensitivity import (SensitivityOptions, SensitivityRuntime,
                                                     exclude_patterns, resolved_trt_names,
                                                     run_sensitivity, suggest_exclusions)

LAYERS = [28, 29]
PROMPTS = [
    {"id": "facts-t1", "category": "facts", "prompt": "What is the capital of France?",
     "answer": "The capital of France is Paris, which is also its largest city."},
    {"id": "code-t1", "category": "code", "prompt": "Write a Python function that adds two numbers.",
     "answer": "def add(a, b):\n    return a + b"},
]


@pytest.fixture(scope="module")
def golden_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("golden") / "golden.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return p


def _profile(**gate):
    from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile

    return validate_profile(deep_merge(load_raw("fp8-h100"), {"gate": gate} if gate else {}))


def _encoded(model_dir, golden_file):
    from transformers import AutoTokenizer

    from precision_pipeline.gate.golden import encode_golden, load_golden

    return encode_golden(AutoTokenizer.from_pretrained(str(model_dir)), load_golden(golden_file))


@pytest.fixture(scope="module")
def evaluator(fp8_checkpoint, default_model_dir, golden_file):
    from precision_pipeline.checkpoint.reader import dequantize_checkpoint

    torch.set_num_threads(1)
    ck = dequantize_checkpoint(fp8_checkpoint)
    return Evaluator(default_model_dir, ck, _encoded(default_model_dir, golden_file))


def test_packed_reference_matches_plain_forward(evaluator, default_model_dir, golden_file):
    ev = evaluator
    assert len(ev.packs) == 1 and ev.prefix_tokens > 0  # both prompts share the template's system header
    enc = {e.id: e for e in _encoded(default_model_dir, golden_file)}
    rows = 0
    with torch.inference_mode():
        for pid in ev.packs[0]["prompts"]:
            e = enc[pid]
            plain = ev.model(input_ids=torch.tensor([e.input_ids]), use_cache=False).logits[0][e.answer_positions]
            n = e.n_answer_tokens
            assert torch.allclose(plain, ev.ref_logits[rows:rows + n], atol=2e-3), pid
            rows += n
    assert rows == ev.answer_tokens == ev.ref_logits.shape[0]


def test_exact_fp32_weights_give_zero_kl(evaluator):
    from precision_pipeline.checkpoint.reader import LinearSpec
    from precision_pipeline.gate.model import QuantLinear

    ev = evaluator
    cell = Cell(29, "mlp.proj")
    trt = "transformer.layers.29.mlp.proj"
    orig = ev.ck.linears[trt]
    fp32 = ev.model.model.layers[29].mlp.down_proj.weight.detach().clone()
    quant = ev.measure([cell]).summary()
    assert quant["kl_mean"] > 1e-7
    try:
        ev.ck.linears[trt] = LinearSpec(weight=fp32, quantized=False)  # same weights, no activation fake-quant
        with ev.swapped([cell]):
            assert isinstance(ev.model.model.layers[29].mlp.down_proj, QuantLinear)
        m = ev.measure([cell]).summary()
        assert m["kl_mean"] == pytest.approx(0.0, abs=1e-9)
        assert m["kl_max"] == pytest.approx(0.0, abs=1e-8)
        assert m["top1"] == 1.0
        # FP8 activation fake-quant alone (exact weights) still costs something
        ev.ck.linears[trt] = LinearSpec(weight=fp32, quantized=True, act_scale=orig.act_scale)
        assert ev.measure([cell]).summary()["kl_mean"] > 0
    finally:
        ev.ck.linears[trt] = orig
    assert isinstance(ev.model.model.layers[29].mlp.down_proj, torch.nn.Linear)  # swapped back
    assert ev.model.model.layers[29].self_attn.kv_format is None


def test_cell_bytes_fp8(evaluator):
    b = evaluator.cell_bytes(Cell(3, "mlp.fc_gate"))
    n = 2 * 576 * 1536
    assert b["bf16_bytes"] == 2 * n
    assert b["quantized_bytes"] == n + 2 * 2 * 4  # FP8 weight + weight/activation scales, two linears
    assert b["cost_bytes"] == n - 16
    kv = evaluator.cell_bytes(Cell(3, "kv_cache"))
    assert kv["kv_bytes_per_token_bf16"] == 2 * 192 * 2 and kv["kv_bytes_per_token_quantized"] == 2 * 192


class _Killed(Exception):
    pass


def test_resume_after_kill(fp8_checkpoint, default_model_dir, golden_file, tmp_path):
    kinds = ["attention.qkv", "mlp.proj"]
    kw = dict(checkpoint_dir=fp8_checkpoint, layers=LAYERS, kinds=kinds, verify=False)
    options = SensitivityOptions(golden_path=golden_file)
    quiet = SensitivityRuntime(threads=1, progress=False)
    seen: list[str] = []

    def die_after_3(jid, rec):
        seen.append(jid)
        if len(seen) == 3:
            raise _Killed()

    with pytest.raises(_Killed):
        run_sensitivity(_profile(), default_model_dir, tmp_path, options,
                        quiet.model_copy(update={"on_measured": die_after_3}), **kw)
    state = tmp_path / "sensitivity" / "cells.jsonl"
    assert [json.loads(x)["id"] for x in state.read_text().splitlines()] == seen
    with open(state, "a") as f:
        f.write('{"key": "torn')  # killed mid-write
    res = run_sensitivity(_profile(), default_model_dir, tmp_path, options, quiet, **kw)
    every = [f"cell:{Cell(i, k).name}" for i in LAYERS for k in kinds] + [f"kind:{k}" for k in kinds] + ["full"]
    assert res.reused == seen
    assert res.computed == [j for j in every if j not in seen]
    lines = state.read_text().splitlines()
    assert [json.loads(x)["id"] for x in lines] == every  # the torn line is gone
    d = res.data
    assert set(d["cells"]) == {Cell(i, k).name for i in LAYERS for k in kinds}
    assert np.array(d["matrix_kl_mean"]).shape == (2, 2)
    # per-token KL of the pooled full run is what the summary says
    full = json.loads(lines[-1])
    assert full["kl_mean"] == pytest.approx(np.mean(full["kl_tokens"]), rel=1e-5)
    assert len(full["kl_tokens"]) == d["prompts"]["answer_tokens"]


def _corrupt_copy(src: Path, dst: Path, tensor: str, factor: float) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "rank0.safetensors":
            shutil.copy(f, dst / f.name)
    t = load_file(str(src / "rank0.safetensors"))
    t[tensor] = t[tensor] * factor
    save_file(t, str(dst / "rank0.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def corrupted_run(fp8_checkpoint, default_model_dir, golden_file, tmp_path_factory):
    """A run on a copy of the fp8 checkpoint whose L29 mlp.proj weight scale is x10, with a gate folder."""
    from precision_pipeline.gate.checkpoint_gate import write_gate_dir
    from precision_pipeline.gate.verdict import GateResult

    root = tmp_path_factory.mktemp("corrupt")
    _corrupt_copy(fp8_checkpoint, root / "checkpoint", "transformer.layers.29.mlp.proj.weights_scaling_factor", 10.0)
    gate_dir = root / "gate"
    try:
        from tests.gate.test_report import _synthetic  # the report tests' synthetic gate numbers
        from precision_pipeline.spec.profile import GateThresholds

        metrics, per_token = _synthetic(GateThresholds(kl_mean_max=0.1, top1_min=0.8))
        write_gate_dir(GateResult(metrics["passed"], metrics["failures"], metrics, gate_dir, per_token))
    except ImportError:  # pragma: no cover
        gate_dir = None
    prof = _profile(kl_mean_max=0.02, kl_p99_max=None)
    res = run_sensitivity(prof, default_model_dir, root, SensitivityOptions(golden_path=golden_file),
                          SensitivityRuntime(threads=1, progress=False), layers=LAYERS)
    return res, gate_dir


def test_corrupted_cell_ranks_first_and_is_excluded(corrupted_run):
    res, _ = corrupted_run
    d = res.data
    assert ck_name(d) == "checkpoint"
    assert d["ranking"][0] == "L29.mlp.proj"
    top = d["cells"]["L29.mlp.proj"]["kl_mean"]
    assert all(d["cells"][n]["kl_mean"] < top / 10 for n in d["ranking"][1:])
    assert set(d["kinds"]) == set(KINDS)  # the fp8 checkpoint quantizes the KV cache
    s = d["suggestion"]
    assert s["greedy_path"][0]["cell"] == "L29.mlp.proj"
    assert s["cells"] == ["L29.mlp.proj"]
    assert s["added_exclude_modules"] == ["transformer.layers.29.mlp.proj"]
    assert s["exclude_modules"] == ["lm_head", "transformer.layers.29.mlp.proj"]
    assert s["resolves_to"] == ["transformer.layers.29.mlp.proj"]
    assert s["reachable"] and s["predicted"]["kl_mean"] <= 0.02
    assert s["measured"]["kl_mean"] <= 0.02 and s["meets_measured"]
    assert s["measured"]["kl_mean"] < d["full"]["kl_mean"] / 10
    assert s["cost_bytes"] == d["cells"]["L29.mlp.proj"]["cost_bytes"] == 576 * 1536 - 8


def ck_name(d: dict) -> str:
    return Path(d["checkpoint_dir"]).name


def test_heatmap_png_and_gate_report(corrupted_run):
    from PIL import Image

    res, gate_dir = corrupted_run
    with Image.open(res.heatmap_path) as im:
        im.load()
        assert im.format == "PNG"
        assert im.size == heatmap_size(len(LAYERS), len(KINDS)) == tuple(res.data["heatmap"]["size_px"])
    if gate_dir is not None:
        assert (gate_dir / "sensitivity_heatmap.png").read_bytes() == res.heatmap_path.read_bytes()
        assert 'id="heatmap"' in (gate_dir / "report.html").read_text()
        assert "sensitivity_heatmap.png" in (gate_dir / "report.md").read_text()


def test_heatmap_full_size(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    m = rng.exponential(1e-3, size=(30, 5))
    m[3, 1] = np.nan  # a linear kept unquantized by the checkpoint
    size = plot_heatmap(m, list(range(30)), list(KINDS), m.mean(0, keepdims=True), tmp_path / "h.png")
    with Image.open(tmp_path / "h.png") as im:
        im.load()
        assert im.size == size == heatmap_size(30, 5)
    assert size[1] > size[0]  # 30 rows: taller than wide


def test_suggestion_greedy_per_byte():
    # two bad cells with equal KL: the cheaper one is taken; KV cells count but are never chosen
    full = np.full(100, 0.2)
    cell_kl = {"L00.mlp.fc_gate": np.full(100, 0.08), "L01.attention.dense": np.full(100, 0.08),
               "L02.kv_cache": np.full(100, 0.02), "L03.mlp.proj": np.full(100, 0.02)}
    costs = {"L00.mlp.fc_gate": 4000.0, "L01.attention.dense": 1000.0, "L03.mlp.proj": 2000.0}
    s = suggest_exclusions(full, cell_kl, costs, {"kl_mean_max": 0.15, "kl_p99_max": None})
    assert s["cells"] == ["L01.attention.dense"]
    assert s["predicted"]["kl_mean"] == pytest.approx(0.2 * 0.12 / 0.2)
    s = suggest_exclusions(full, cell_kl, costs, {"kl_mean_max": 0.01, "kl_p99_max": None})
    assert not s["reachable"] and "L02.kv_cache" not in s["cells"]
    s = suggest_exclusions(full, cell_kl, costs, {"kl_mean_max": 0.5, "kl_p99_max": 1.0})
    assert s["cells"] == [] and s["cost_bytes"] == 0


def test_prune_drops_unneeded_cells():
    # greedy by ratio takes the cheap small cell first; after the big one it is not needed any more
    full = np.full(10, 1.0)
    cell_kl = {"L00.attention.dense": np.full(10, 0.1), "L01.mlp.fc_gate": np.full(10, 0.9)}
    costs = {"L00.attention.dense": 1.0, "L01.mlp.fc_gate": 100.0}
    s = suggest_exclusions(full, cell_kl, costs, {"kl_mean_max": 0.12, "kl_p99_max": None})
    assert [p["cell"] for p in s["greedy_path"]] == ["L00.attention.dense", "L01.mlp.fc_gate"]
    assert s["cells"] == ["L01.mlp.fc_gate"]


def test_exclude_patterns_resolve():
    from precision_pipeline.spec.families import trtllm_name  # noqa: F401  (names below are what quantize.py resolves)

    hf = []
    for i in range(3):
        hf += [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkvo"]
        hf += [f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up", "down")]
    hf.append("lm_head")
    cells = ["L01.mlp.fc_gate", "L00.attention.qkv", "L02.attention.qkv", "L02.attention.dense", "L02.mlp.fc_gate",
             "L02.mlp.proj", "L01.kv_cache"]
    pats = exclude_patterns(cells)
    assert pats == ["transformer.layers.0.attention.qkv", "transformer.layers.1.mlp.fc", "transformer.layers.1.mlp.gate",
                    "transformer.layers.2.*"]
    got = resolved_trt_names(hf, pats, 3)
    assert got == ["transformer.layers.0.attention.qkv", "transformer.layers.1.mlp.fc", "transformer.layers.1.mlp.gate",
                   "transformer.layers.2.attention.dense", "transformer.layers.2.attention.qkv",
                   "transformer.layers.2.mlp.fc", "transformer.layers.2.mlp.gate", "transformer.layers.2.mlp.proj"]
    assert Cell.parse("L07.mlp.fc_gate") == Cell(7, "mlp.fc_gate") and Cell.parse("lm_head").name == "lm_head"


def test_options_key_the_measurements_and_runtime_does_not(fp8_checkpoint, default_model_dir, golden_file, tmp_path):
    kw = dict(checkpoint_dir=fp8_checkpoint, layers=[29], kinds=["mlp.proj"], verify=False)
    jobs = ["cell:L29.mlp.proj", "kind:mlp.proj", "full"]
    options = SensitivityOptions(golden_path=golden_file)
    first = run_sensitivity(_profile(), default_model_dir, tmp_path, options,
                            SensitivityRuntime(threads=1, progress=False), **kw)
    assert first.computed == jobs and first.reused == []
    again = run_sensitivity(_profile(), default_model_dir, tmp_path, options,
                            SensitivityRuntime(threads=2, progress=False, rerender_gate=False), **kw)
    assert again.computed == [] and again.reused == jobs  # how it runs is not in the key
    assert again.data["key"] == first.data["key"]
    repacked = run_sensitivity(_profile(), default_model_dir, tmp_path, options.model_copy(update={"pack_tokens": 64}),
                               SensitivityRuntime(threads=1, progress=False), **kw)
    assert repacked.computed == jobs and repacked.reused == []  # what is measured is
    assert repacked.data["key"] != first.data["key"]


def test_missing_checkpoint_is_a_user_error(default_model_dir, tmp_path):
    with pytest.raises(UserError) as ei:
        run_sensitivity(_profile(), default_model_dir, tmp_path, runtime=SensitivityRuntime(progress=False))
    assert "invoke build --profile fp8-h100" in ei.value.problems[0].fix


def test_wrong_layers_refused(fp8_checkpoint, default_model_dir, tmp_path):
    with pytest.raises(UserError):
        run_sensitivity(_profile(), default_model_dir, tmp_path, runtime=SensitivityRuntime(progress=False),
                        checkpoint_dir=fp8_checkpoint, layers=[30])


def test_write_profile_extends_the_original_with_the_verified_exclusions(corrupted_run, tmp_path):
    """--write-profile: the tuned profile extends fp8-h100 and its exclude_modules are the suggestion's."""
    from precision_pipeline.analysis.sensitivity import write_tuned_profile
    from precision_pipeline.spec.profile import load_profile

    d = corrupted_run[0].data
    path = write_tuned_profile(d, "fp8-h100", tmp_path / "fp8-h100-tuned.yaml", command="--profile fp8-h100")
    text = path.read_text()
    assert text.startswith("# Written by `invoke sensitivity --profile fp8-h100`.\n# 1 cell(s) of fp8-h100 kept in BF16")
    p = load_profile(str(path))
    base = load_profile("fp8-h100")
    assert p.name == "fp8-h100-tuned" and "extends: fp8-h100" in text
    assert p.quantization.exclude_modules == ["lm_head", "transformer.layers.29.mlp.proj"]
    # everything else is the original's
    assert p.quantization.model_dump(exclude={"exclude_modules"}) == base.quantization.model_dump(exclude={"exclude_modules"})
    assert (p.gate, p.build, p.target, p.calibration) == (base.gate, base.build, base.target, base.calibration)


def test_write_profile_refuses_a_missing_verification_and_keeps_the_old_file(corrupted_run, tmp_path):
    import copy

    from precision_pipeline.analysis.sensitivity import write_tuned_profile
    from precision_pipeline.core.errors import GateFailed

    d = copy.deepcopy(corrupted_run[0].data)
    old = tmp_path / "t.yaml"
    old.write_text("extends: fp8-h100\n")
    d["suggestion"]["meets_measured"] = False
    with pytest.raises(GateFailed, match="no profile written"):
        write_tuned_profile(d, "fp8-h100", old)
    d["suggestion"]["cells"] = []
    with pytest.raises(UserError, match="nothing to tune"):
        write_tuned_profile(d, "fp8-h100", old)
    d = copy.deepcopy(corrupted_run[0].data)
    with pytest.raises(UserError, match="does not end in .yaml"):
        write_tuned_profile(d, "fp8-h100", tmp_path / "t.txt")
    assert old.read_text() == "extends: fp8-h100\n" and not (tmp_path / "t.txt").exists()


def test_write_profile_beside_a_profile_file_extends_it_by_relative_path(corrupted_run, tmp_path):
    from precision_pipeline.analysis.sensitivity import write_tuned_profile
    from precision_pipeline.spec.profile import load_profile

    src = tmp_path / "team" / "mine.yaml"
    src.parent.mkdir()
    src.write_text("extends: fp8-h100\ndescription: ours\n")
    path = write_tuned_profile(corrupted_run[0].data, str(src), tmp_path / "mine-tuned.yaml")
    assert "extends: team/mine.yaml" in path.read_text()
    p = load_profile(str(path))
    assert p.description.startswith("fp8-h100 with 1 sensitive cell") and p.name == "mine-tuned"
    with pytest.raises(UserError, match="not in its folder tree"):
        write_tuned_profile(corrupted_run[0].data, str(src), tmp_path / "team" / "tuned" / "mine-tuned.yaml")
    assert not (tmp_path / "team" / "tuned").exists()


def test_margin_aims_below_the_thresholds_and_reuses_every_cell(corrupted_run, golden_file, default_model_dir):
    """--margin 0.3: the suggestion is verified against 0.3 x kl_mean_max; no cell is measured again."""
    res, _ = corrupted_run
    prof = _profile(kl_mean_max=0.02, kl_p99_max=None)
    again = run_sensitivity(prof, default_model_dir, res.out_dir.parent, SensitivityOptions(golden_path=golden_file),
                            SensitivityRuntime(threads=1, progress=False, margin=0.3), layers=LAYERS)
    s = again.data["suggestion"]
    thr = res.data["thresholds"]["kl_mean_max"]  # the profile's override for the default model
    assert again.data["margin"] == 0.3 and again.data["thresholds"]["kl_mean_max"] == thr
    assert all(j.startswith("verify:") for j in again.computed)
    assert s["meets_measured"] == (s["measured"]["kl_mean"] <= 0.3 * thr)
    assert s["predicted"]["kl_mean"] <= 0.3 * thr or not s["reachable"]
    assert s["rounds"][0]["target"]["kl_mean_max"] == pytest.approx(0.3 * thr)


def _verified_data() -> dict:
    """A sensitivity.json with a verified suggestion (no measuring: the writer only reads these fields)."""
    return {"profile": "fp8-h100", "model": "SmolLM2-135M-Instruct", "margin": 1.0,
            "thresholds": {"kl_mean_max": 0.25, "kl_p99_max": 2.0}, "prompts": {"ids": ["a"], "answer_tokens": 10},
            "suggestion": {"cells": ["L0.mlp.proj"], "meets_measured": True, "cost_bytes": 2**20,
                           "exclude_modules": ["lm_head", "transformer.layers.0.mlp.proj"],
                           "measured": {"kl_mean": 0.1, "kl_p99": 1.0, "top1": 0.9}}}


def test_write_profile_onto_the_analysed_profile_or_a_shipped_one_is_refused(tmp_path):
    from precision_pipeline.analysis.sensitivity import write_tuned_profile
    from precision_pipeline.spec.profile import PROFILES_DIR

    own = tmp_path / "own.yaml"
    write_tuned_profile(_verified_data(), "fp8-h100", own)  # a tool-written profile ...
    before = own.read_text()
    with pytest.raises(UserError, match="is the analysed profile itself") as e:  # ... analysed and written onto itself
        write_tuned_profile(_verified_data(), str(own), own)
    assert e.value.problems[0].field == "--write-profile" and "-tuned.yaml" in e.value.problems[0].fix
    with pytest.raises(UserError, match="is the analysed profile itself"):
        write_tuned_profile(_verified_data(), "fp8-h100", PROFILES_DIR / "fp8-h100.yaml")
    shipped = (PROFILES_DIR / "bf16-h100.yaml").read_bytes()
    with pytest.raises(UserError, match="is a shipped profile"):
        write_tuned_profile(_verified_data(), "fp8-h100", PROFILES_DIR / "bf16-h100.yaml")
    assert own.read_text() == before and (PROFILES_DIR / "bf16-h100.yaml").read_bytes() == shipped


def test_missed_suggestion_under_a_small_margin_names_the_margin_as_a_fix(tmp_path):
    from precision_pipeline.analysis.sensitivity import write_tuned_profile
    from precision_pipeline.core.errors import GateFailed

    d = _verified_data()
    d["suggestion"]["meets_measured"] = False
    with pytest.raises(GateFailed) as e:
        write_tuned_profile(d, "fp8-h100", tmp_path / "t.yaml")
    assert "--margin" not in str(e.value)  # at margin 1 the margin is no way out
    d["margin"] = 1e-9
    with pytest.raises(GateFailed, match=r"x 1e-09: no profile written.*a larger --margin \(now 1e-09\)"):
        write_tuned_profile(d, "fp8-h100", tmp_path / "t.yaml")
    assert not (tmp_path / "t.yaml").exists()
