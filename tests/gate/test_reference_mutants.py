"""gate/reference.py on a tiny random Llama (4 layers of width 32, vocab 64: milliseconds a forward) and hand-made
arrays (issue 26: its fast tests scored 0/10; the reference was computed only inside whole gate runs): the cache
entry's round trip, where the cache lives, the lm_head read from safetensors, the held-out windows, and the
reference / BF16-floor pass with its progress."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from precision_pipeline.gate import reference as R
from precision_pipeline.gate.golden import EncodedPrompt
from precision_pipeline.gate.options import GateOptions

VOCAB = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("tiny") / "model"
    LlamaForCausalLM(cfg).save_pretrained(str(d), safe_serialization=True)
    return d


def prompts() -> list[EncodedPrompt]:
    return [EncodedPrompt("p0", "facts", "q", "a", [1, 5, 6, 7, 8, 9, 10], 1, 3, 6),
            EncodedPrompt("p1", "code", "q", "a", [1, 11, 12, 13, 14], 1, 2, 4)]


class Prog:
    """A StageProgress stand-in: phases with their totals and the units advanced."""

    def __init__(self):
        self.phases = []

    def phase(self, name, total, unit):
        rec = {"name": name, "total": total, "unit": unit, "done": 0, "finished": False}
        self.phases.append(rec)

        class Ph:
            def advance(self, n=1):
                rec["done"] += n

            def finish(self):
                rec["finished"] = True
        return Ph()


@pytest.mark.parametrize("floor", [True, False])
def test_reference_pass_and_its_progress(tiny, floor):
    enc, windows = prompts(), [[1, 2, 3, 4], [5, 6]]
    prog = Prog()
    opts = GateOptions(greedy_new_tokens=3, greedy_batch=2, noise_floor=floor)
    d = R._compute_reference(tiny, enc, windows, 0, opts, prog)
    models = 2 if floor else 1
    what = "reference FP32" + (" + BF16 floor" if floor else "")
    assert [(p["name"], p["total"], p["unit"]) for p in prog.phases] == [
        (what + ", teacher-forced + greedy (3 tokens)", (7 + 5 + 2 * 2) * models, "tokens"),
        (what + ", held-out perplexity", 2 * models, "windows")]
    assert all(p["done"] == p["total"] and p["finished"] for p in prog.phases)
    assert [h.shape for h in d.hidden] == [(7, 32), (5, 32)]
    assert [a.shape for a in d.ref_answer_nll] == [(3,), (2,)] and d.ref_heldout_nll.shape == (4,)
    assert len(d.ref_greedy) == 2 and all(1 <= len(g) <= 3 for g in d.ref_greedy)
    if floor:
        assert d.floor["heldout_nll"].shape == (4,)
        assert [r["kl"].shape for r in d.floor["answer"]] == [(3,), (2,)]
        assert [r["kl"].shape for r in d.floor["prompt"]] == [(2,), (1,)]
    else:
        assert d.floor is None
    # the answer NLL is the model's own cross-entropy at the answer positions
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    with torch.inference_mode():
        lg = m(torch.tensor([enc[0].input_ids])).logits[0]
    want = torch.nn.functional.cross_entropy(lg[2:5], torch.tensor(enc[0].input_ids[3:6]), reduction="none")
    np.testing.assert_allclose(d.ref_answer_nll[0], want.double().numpy(), rtol=1e-5, atol=1e-6)


def test_teacher_forced_only_phase_name(tiny):
    prog = Prog()
    d = R._compute_reference(tiny, prompts(), [], 0, GateOptions(greedy_new_tokens=0, noise_floor=False), prog)
    assert prog.phases[0]["name"] == "reference FP32, teacher-forced" and prog.phases[0]["total"] == 12
    assert d.ref_greedy == [] and d.ref_heldout_nll.size == 0


def _hand_made(floor: bool) -> R.ReferenceData:
    fl = None
    if floor:
        fl = {"answer": [{"kl": np.array([0.1, 0.2]), "top1": np.array([1.0, 0.0]), "nll": np.array([2.0, 3.0])},
                         {"kl": np.array([0.3]), "top1": np.array([1.0]), "nll": np.array([1.5])}],
              "prompt": [{"kl": np.array([0.01]), "top1": np.array([1.0])}, {"kl": np.array([0.02, 0.03]), "top1": np.array([0.0, 1.0])}],
              "greedy": [[4, 5], [6]], "heldout_nll": np.array([2.5, 2.6])}
    return R.ReferenceData([np.ones((3, 2), np.float32), np.full((1, 2), 2.0, np.float32)], [[4, 5], [7]],
                           np.array([2.0, 2.1]), [np.array([1.0, 1.1]), np.array([0.9])], fl, {"load": 1.5})


@pytest.mark.parametrize("floor", [True, False])
def test_cache_entry_round_trip(tmp_path, floor):
    d = _hand_made(floor)
    R._save_reference(d, tmp_path, {"key": "k"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arrays.npz", "greedy.json", "hidden.npy", "meta.json"]
    back = R._load_reference(tmp_path)
    assert back.cache_hit is True and back.seconds == {"load": 1.5}
    assert [h.tolist() for h in back.hidden] == [h.tolist() for h in d.hidden]
    assert back.ref_greedy == [[4, 5], [7]] and back.ref_heldout_nll.tolist() == [2.0, 2.1]
    assert [a.tolist() for a in back.ref_answer_nll] == [[1.0, 1.1], [0.9]]
    if floor:
        assert back.floor["greedy"] == [[4, 5], [6]] and back.floor["heldout_nll"].tolist() == [2.5, 2.6]
        for seg in ("answer", "prompt"):
            assert [{k: v.tolist() for k, v in r.items()} for r in back.floor[seg]] == \
                   [{k: v.tolist() for k, v in r.items()} for r in d.floor[seg]]
    else:
        assert back.floor is None


def test_cache_root_and_cached_reference(tmp_path, monkeypatch):
    from precision_pipeline.spec import default_model

    monkeypatch.setattr(default_model, "cache_dir", lambda: tmp_path / "cache")
    assert R._cache_root(None) == tmp_path / "cache" / "gate-ref"
    assert R._cache_root(tmp_path / "x") == tmp_path / "x"
    key = "ab" * 32
    assert R.cached_reference(key) is None
    entry = tmp_path / "cache" / "gate-ref" / key[:32]
    entry.mkdir(parents=True)
    R._save_reference(_hand_made(False), entry, {"key": key})
    got = R.cached_reference(key)
    assert got is not None and got.key == key and got.ref_greedy == [[4, 5], [7]]
    (entry / "meta.json").unlink()  # an entry without its meta.json is not one
    assert R.cached_reference(key) is None


def test_lm_head_read_from_safetensors_without_loading_the_model(tiny, monkeypatch):
    from safetensors import safe_open

    with safe_open(str(tiny / "model.safetensors"), framework="pt") as f:
        want = f.get_tensor("lm_head.weight")
    monkeypatch.setattr(R, "load_hf_model", lambda *a, **k: pytest.fail("the safetensors hold lm_head.weight"))
    got = R.lm_head_weight(tiny)
    assert got.dtype == torch.float32 and torch.equal(got, want.float())


def test_heldout_windows(monkeypatch):
    class Tok:
        def __call__(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return {"input_ids": [ord(c) for c in text]}

    monkeypatch.setattr(R, "heldout_texts", lambda: ["abc", "defg", "never read"])
    assert R.heldout_windows(Tok(), 9, window=4) == [[97, 98, 99, 10], [10, 100, 101, 102]]  # the 9th token, alone, dropped
    assert R.heldout_windows(Tok(), 10, window=4)[-1] == [103, 10]
    monkeypatch.setattr(R, "heldout_texts", lambda: pytest.fail("0 tokens: the held-out text is not read"))
    assert R.heldout_windows(Tok(), 0) == []


def test_one_greedy_token(tiny):
    """``greedy_new_tokens`` 1: one token decoded per prompt, for the reference and the floor."""
    d = R._compute_reference(tiny, prompts(), [], 0, GateOptions(greedy_new_tokens=1, greedy_batch=2), Prog())
    assert [len(g) for g in d.ref_greedy] == [1, 1] and [len(g) for g in d.floor["greedy"]] == [1, 1]


def test_reference_data_is_cached_by_key(tiny, tmp_path):
    from precision_pipeline.gate.options import GateRuntime

    rt = GateRuntime(reference_cache=tmp_path / "ref", progress=False)
    opts = GateOptions(greedy_new_tokens=2, noise_floor=False)
    first = R.reference_data(tiny, prompts(), [[1, 2, 3]], 0, opts, rt)
    entry = tmp_path / "ref" / first.key[:32]
    assert first.cache_hit is False and (entry / "meta.json").is_file() and len(first.key) == 64
    again = R.reference_data(tiny, prompts(), [[1, 2, 3]], 0, opts, rt)
    assert again.cache_hit is True and again.key == first.key
    assert [h.tolist() for h in again.hidden] == [h.tolist() for h in first.hidden] and again.ref_greedy == first.ref_greedy
    off = R.reference_data(tiny, prompts(), [[1, 2, 3]], 0, opts, rt.model_copy(update={"use_reference_cache": False}))
    assert off.cache_hit is False and off.key == first.key
    other = R.reference_data(tiny, prompts(), [[1, 2, 3]], 0, GateOptions(greedy_new_tokens=3, noise_floor=False), rt)
    assert other.key != first.key and len(list((tmp_path / "ref").glob("*/meta.json"))) == 2


def test_heldout_texts_are_the_calibration_readers():
    from precision_pipeline.quantize.calibration import heldout_news_texts

    texts = R.heldout_texts()
    assert texts == heldout_news_texts() and len(texts) == 50


def test_progress_is_met_when_the_answers_stop_early(tiny):
    """An answer that stops before its last decode step still counts the steps it skips, so the phase ends at its
    total: the stop id is chosen as the 3rd token this model generates (2 decode steps, 1 skipped of 3)."""
    one = prompts()[:1]
    free = R._compute_reference(tiny, one, [], VOCAB - 1, GateOptions(greedy_new_tokens=6, noise_floor=False), Prog())
    g = free.ref_greedy[0]
    assert len(g) == 6 and g[2] not in g[:2], g  # the tiny model's greedy tokens (seed 0) allow the choice
    prog = Prog()
    d = R._compute_reference(tiny, one, [], g[2], GateOptions(greedy_new_tokens=4, noise_floor=False), prog)
    assert d.ref_greedy == [g[:3]]
    assert prog.phases[0]["total"] == 7 + 3 and prog.phases[0]["done"] == prog.phases[0]["total"]


def test_reference_data_with_the_callers_progress_and_its_seconds(tiny, tmp_path):
    from precision_pipeline.gate.options import GateRuntime

    prog = Prog()
    t = __import__("time").perf_counter()
    d = R.reference_data(tiny, prompts(), [[1, 2, 3]], 0, GateOptions(greedy_new_tokens=2, noise_floor=False),
                         GateRuntime(use_reference_cache=False), prog)
    wall = __import__("time").perf_counter() - t
    assert [p["name"] for p in prog.phases][0].startswith("reference FP32, teacher-forced")
    assert set(d.seconds) == {"load", "teacher_forced", "greedy", "heldout"}
    assert all(0.0 <= v <= wall for v in d.seconds.values()), (d.seconds, wall)


def test_a_model_whose_logits_are_not_its_lm_head_of_the_hidden_state_is_refused(tiny, monkeypatch):
    """The cache stores hidden states and recomputes logits with lm_head: a model that scales its logits (soft-capping,
    a logit scale) by 1 % is refused, not cached wrongly."""
    real = R.forward_with_prefix

    def scaled(model, e, hidden=False):
        rp = real(model, e, hidden=hidden)
        rp.logits = rp.logits * 1.01
        return rp

    monkeypatch.setattr(R, "forward_with_prefix", scaled)
    with pytest.raises(RuntimeError, match="does not reproduce the model's logits"):
        R._compute_reference(tiny, prompts(), [], 0, GateOptions(greedy_new_tokens=0, noise_floor=False), Prog())
