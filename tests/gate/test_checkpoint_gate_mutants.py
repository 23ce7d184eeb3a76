"""gate/checkpoint_gate.py's scoring, timings and gate folder on a tiny random Llama that reads SmolLM2's tokenizer
(vocab 49,152, 1 layer of width 16: a whole gate run over one golden prompt a category in seconds) -- issue 26: its
seed-2 sample scored 1/10, every survivor a timing, a phase name, a file mode or a rounding no test read."""

from __future__ import annotations

import json
import math
import shutil
import time

import pytest
import torch

from precision_pipeline.gate import checkpoint_gate as CG
from precision_pipeline.gate import reference as R
from precision_pipeline.gate.candidates import CallableCandidate, HFCandidate
from precision_pipeline.gate.options import GateOptions, GateRuntime
from precision_pipeline.spec.profile import GateThresholds
from tests.gate.test_reference_mutants import Prog, prompts, tiny  # noqa: F401  (tiny: module fixture)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory, default_model_dir):
    """A tiny random Llama with SmolLM2's vocabulary and tokenizer files (the golden set encodes with them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=8192, tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("tiny-chat") / "model"
    LlamaForCausalLM(cfg).save_pretrained(str(d), safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (default_model_dir / f).is_file():
            shutil.copy(default_model_dir / f, d / f)
    return d


def _scoring(tiny, greedy_new: int, prog) -> CG._Scoring:  # noqa: F811
    enc, windows = prompts(), [[1, 2, 3, 4]]
    opts = GateOptions(greedy_new_tokens=greedy_new, greedy_batch=2, noise_floor=False)
    ref = R._compute_reference(tiny, enc, windows, 0, opts, Prog())
    return CG._Scoring(enc, windows, 0, ref, R.lm_head_weight(tiny), opts, prog, {})


@pytest.mark.parametrize("greedy_new", [1, 3])
def test_an_hf_candidate_scored_in_fused_passes(tiny, greedy_new):  # noqa: F811
    from transformers import AutoModelForCausalLM

    prog = Prog()
    sc = _scoring(tiny, greedy_new, prog)
    t = time.perf_counter()
    m = sc.run(HFCandidate(AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)))
    wall = time.perf_counter() - t
    assert [p["name"] for p in prog.phases] == [f"candidate, teacher-forced + greedy ({greedy_new} tokens)",
                                                "candidate, held-out perplexity"]
    assert all(p["done"] == p["total"] and p["finished"] for p in prog.phases)
    assert set(sc.timings) == {"candidate_teacher_forced", "candidate_greedy", "candidate_heldout"}
    assert all(0.0 <= v <= wall for v in sc.timings.values()), (sc.timings, wall)
    assert all(float(a.kl.max()) < 1e-6 for a, _ in m.per_prompt)  # the reference model against itself
    assert [len(g) for g in m.cand_greedy] == [len(g) for g in sc.ref.ref_greedy]


@pytest.mark.parametrize("greedy_new", [0, 2])
def test_another_candidate_scored_prompt_by_prompt(tiny, greedy_new):  # noqa: F811
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    prog = Prog()
    sc = _scoring(tiny, greedy_new, prog)
    t = time.perf_counter()
    m = sc.run(CallableCandidate(lambda ids: model(ids).logits, "callable"))
    wall = time.perf_counter() - t
    names = ["candidate, teacher-forced"] + ([f"candidate, greedy ({greedy_new} tokens)"] if greedy_new else []) + [
        "candidate, held-out perplexity"]
    assert [p["name"] for p in prog.phases] == names
    assert m.cand_greedy == [] if not greedy_new else len(m.cand_greedy) == 2
    assert all(0.0 <= v <= wall for v in sc.timings.values()), (sc.timings, wall)


def test_a_whole_gate_run_and_its_folder(tiny_chat, tmp_path, monkeypatch):
    """``gate_checkpoint`` with the loader replaced by the tiny model itself: timings rounded to 1 ms and within the
    run, the checkpoint's load time recorded, the gate folder readable by all (0755, files 0644)."""
    from transformers import AutoModelForCausalLM

    from precision_pipeline.checkpoint import reader
    from precision_pipeline.gate import moe_model

    monkeypatch.setattr(reader, "checkpoint_layout", lambda d: "stand-in")  # no scales to read from the stand-in folder
    model = AutoModelForCausalLM.from_pretrained(str(tiny_chat), dtype=torch.float32)
    monkeypatch.setattr(moe_model, "load_gate_model", lambda *a, **k: (time.sleep(0.0123), model)[1])
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    out = tmp_path / "gate"
    opts = GateOptions(prompts_per_category=1, heldout_tokens=32, greedy_new_tokens=2, bootstrap_resamples=10)
    t = time.perf_counter()
    res = CG.gate_checkpoint(ck, tiny_chat, GateThresholds(kl_mean_max=1.0), out, opts,
                             GateRuntime(progress=False, reference_cache=tmp_path / "ref", write_report=False))
    wall = time.perf_counter() - t
    m = json.loads((out / "metrics.json").read_text())
    assert res.passed is True and m["passed"] is True
    ts = m["timings_s"]
    assert {"metrics", "total_before_report", "total"} <= set(ts)
    assert all(v == round(v, 3) and 0.0 <= v <= wall for v in ts.values()), (ts, wall)
    assert ts["total_before_report"] <= ts["total"]
    assert m["checkpoint_load_s"] == round(m["checkpoint_load_s"], 3) and 0.012 <= m["checkpoint_load_s"] <= wall
    assert m["checkpoint_dir"] == str(ck) and math.isfinite(m["metrics"]["kl_mean"]["value"])
    assert (out.stat().st_mode & 0o777) == 0o755
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == {"metrics.json": 0o644, "per_token.npz": 0o644}
    # the serving probe's set from this gate run: the stored reference, the model's lm_head and tokenizer
    from precision_pipeline.serving import probe

    ps = probe.load_probe_set(out, 3, cache_root=tmp_path / "ref")
    assert [p.category for p in ps.prompts] == [r["category"] for r in m["prompts"]][:3]
    tok = __import__("transformers").AutoTokenizer.from_pretrained(str(tiny_chat))
    for p in ps.prompts:
        top = p.ref_logits.argmax(-1).tolist()
        assert p.ref_logits.shape == (p.answer.stop - p.answer.start, 49152)
        assert all(want == tok.decode([top[k]], skip_special_tokens=True) for k, _ctx, want in p.text_rows)
    assert sum(len(p.text_rows) for p in ps.prompts) > 0
