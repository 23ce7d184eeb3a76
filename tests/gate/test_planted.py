"""The gate scores exactly the answer positions (planted-bug tests).

Position ``t`` predicts ``input_ids[t + 1]``, so the gated positions are
``answer_start - 1 .. answer_end - 2`` (targets: the answer tokens and the closing <|im_end|>).
A candidate that is the FP32 reference everywhere except on one set of rows tells which rows the
gate read: corrupt every row OUTSIDE the answer positions and the gate must see a perfect model;
corrupt only the answer positions and it must see top-1 = 0 on every gated token. A shift by one
token in either direction brings one wrong row per prompt into the score.

Runs the real ``run_gate`` on the first prompt of each category (6 prompts), no greedy tokens,
128 held-out tokens; the FP32 reference comes from the gate's reference cache (``<cache>/gate-ref``).
"""

from __future__ import annotations

import pytest
import torch

from precision_pipeline.gate.candidates import load_hf_model
from precision_pipeline.gate.checkpoint_gate import run_gate
from precision_pipeline.gate.golden import encode_golden, load_golden, select
from precision_pipeline.gate.options import GateOptions, GateRuntime
from precision_pipeline.spec.profile import GateThresholds

OPTIONS = GateOptions(prompts_per_category=1, heldout_tokens=128, greedy_new_tokens=0, bootstrap_resamples=50)


@pytest.fixture(scope="module")
def encoded(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    return encode_golden(tok, select(load_golden(), 1))


def test_answer_positions_predict_the_answer_tokens(encoded):
    for e in encoded:
        a = range(len(e.input_ids))[e.answer_positions]
        assert [e.input_ids[t + 1] for t in a] == e.answer_ids and len(a) == e.n_answer_tokens
        assert a[0] == e.answer_start - 1 and a[-1] == e.answer_end - 2
        p = range(len(e.input_ids))[e.prompt_positions]
        assert [e.input_ids[t + 1] for t in p] == e.input_ids[e.user_start:e.answer_start]
        assert p[-1] + 1 == a[0]  # the segments touch and do not overlap


@pytest.fixture(scope="module")
def marked_gate(default_model_dir, encoded, tmp_path_factory):
    """run_gate on two candidates: ``outside`` (non-answer rows negated) and ``answer`` (answer rows negated)."""
    ref = load_hf_model(default_model_dir, torch.float32)
    by_ids = {tuple(e.input_ids): e for e in encoded}
    plain: dict[tuple, torch.Tensor] = {}  # the FP32 logits of each sequence, computed once for both candidates

    @torch.inference_mode()
    def ref_logits(ids) -> torch.Tensor:
        key = tuple(ids[0].tolist())
        if key not in plain:
            plain[key] = ref(input_ids=ids, use_cache=False).logits
        return plain[key].clone()

    def make(mode):
        @torch.inference_mode()
        def fn(ids):
            logits = ref_logits(ids)
            e = by_ids.get(tuple(ids[0].tolist()))
            if e is not None:
                mask = torch.zeros(logits.shape[1], dtype=torch.bool)
                mask[e.answer_positions] = True
                rows = ~mask if mode == "outside" else mask
                logits[0, rows] = -logits[0, rows]
            return logits
        return fn

    thr = GateThresholds(kl_mean_max=1.0, top1_min=0.0)
    out = {}
    for mode in ("outside", "answer"):
        res = run_gate(make(mode), default_model_dir, thr, tmp_path_factory.mktemp(mode) / "gate", OPTIONS,
                       GateRuntime(progress=False, write_report=False), candidate_name=mode)
        out[mode] = res.metrics
    return out


@pytest.mark.slow
def test_rows_outside_the_answer_are_not_scored(marked_gate, encoded):
    m = marked_gate["outside"]
    assert m["tokens"]["answer_tokens"] == sum(e.n_answer_tokens for e in encoded)
    assert m["metrics"]["kl_max"]["value"] == pytest.approx(0.0, abs=1e-6)
    assert m["metrics"]["top1"]["value"] == 1.0


@pytest.mark.slow
def test_every_answer_row_is_scored(marked_gate):
    m = marked_gate["answer"]["metrics"]
    assert m["top1"]["value"] == 0.0
    assert m["kl_mean"]["value"] > 1.0
