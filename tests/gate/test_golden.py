"""Golden prompt set: content, validation, chat-template encoding, subsets."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from precision_pipeline.core.errors import EXIT_INVALID, UserError
from precision_pipeline.gate.golden import (CATEGORIES, GOLDEN_PATH, MIN_ANSWER_TOKENS, MIN_PER_CATEGORY, encode_golden,
                          encode_prompt, end_of_turn_id, golden_hash, load_golden, select, summarize)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


@pytest.fixture(scope="module")
def encoded(tokenizer):
    return encode_golden(tokenizer, load_golden())


def test_set_size_and_categories():
    ps = load_golden()
    assert len(ps) >= 60
    counts = Counter(p.category for p in ps)
    assert set(counts) == set(CATEGORIES)
    assert all(counts[c] >= MIN_PER_CATEGORY for c in CATEGORIES), counts
    assert len({p.id for p in ps}) == len(ps)
    # real content: answers are substantive, long_context prompts hold several paragraphs
    assert all(len(p.answer) >= 30 for p in ps)
    assert all(p.prompt.count("\n\n") >= 3 for p in ps if p.category == "long_context")


def test_token_count_at_least_5000(encoded):
    assert MIN_ANSWER_TOKENS == 5000  # the golden set's documented size (gate/golden.py module doc)
    s = summarize(encoded)
    assert s.answer_tokens >= MIN_ANSWER_TOKENS
    assert s.prompts == len(encoded)
    assert sum(d["answer_tokens"] for d in s.per_category.values()) == s.answer_tokens
    assert s.per_category["long_context"]["prompt_tokens"] > 2000


def test_encoding_is_the_chat_template(tokenizer, encoded):
    ps = load_golden()
    eot = end_of_turn_id(tokenizer)
    assert tokenizer.convert_ids_to_tokens(eot) == "<|im_end|>"
    for p, e in zip(ps[:: 7], encoded[:: 7]):
        msgs = [{"role": "user", "content": p.prompt}, {"role": "assistant", "content": p.answer}]
        assert e.input_ids == list(tokenizer.apply_chat_template(msgs, tokenize=True))
        # one <|im_start|> at the start: no extra BOS
        assert e.input_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert e.input_ids[1] != e.input_ids[0]
        gen = tokenizer.apply_chat_template(msgs[:1], tokenize=True, add_generation_prompt=True)
        assert e.generation_prompt == list(gen)
        assert tokenizer.decode(e.answer_ids) == p.answer + "<|im_end|>"
        assert e.answer_ids[-1] == eot
        assert tokenizer.decode(e.input_ids[e.user_start:e.answer_start]).startswith(p.prompt[:20])
        assert e.n_answer_tokens == e.answer_positions.stop - e.answer_positions.start
        # system header is not evaluated: the user segment starts after it
        assert "system" in tokenizer.decode(e.input_ids[: e.user_start])


def test_select_is_stratified_first_k():
    ps = load_golden()
    sub = load_golden(per_category=2)
    assert len(sub) == 2 * len(CATEGORIES)
    assert Counter(p.category for p in sub) == {c: 2 for c in CATEGORIES}
    for c in CATEGORIES:
        assert [p.id for p in sub if p.category == c] == [p.id for p in ps if p.category == c][:2]
    assert select(ps, None) == ps
    with pytest.raises(UserError):
        select(ps, 0)


def test_golden_hash_deterministic(tokenizer):
    a = encode_golden(tokenizer, load_golden(per_category=1))
    b = encode_golden(tokenizer, load_golden(per_category=1))
    c = encode_golden(tokenizer, load_golden(per_category=2))
    assert golden_hash(a) == golden_hash(b) != golden_hash(c)


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "golden.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


GOOD = json.dumps({"id": "a", "category": "facts", "prompt": "Q?", "answer": "A."})


@pytest.mark.parametrize("bad, needle", [
    ('{"id": "b", "category": "facts", "prompt": "Q?"', "not valid JSON"),
    ('["x"]', "not an object"),
    (json.dumps({"id": "b", "category": "facts", "prompt": "Q?"}), "lacks key"),
    (json.dumps({"id": "b", "category": "poetry", "prompt": "Q?", "answer": "A"}), "category 'poetry'"),
    (json.dumps({"id": "a", "category": "facts", "prompt": "Q?", "answer": "A"}), "already used on line 1"),
    (json.dumps({"id": "b", "category": "facts", "prompt": "", "answer": "A"}), "non-empty string"),
    (json.dumps({"id": "b", "category": "facts", "prompt": "Q", "answer": "A", "x": 1}), "unknown key"),
])
def test_malformed_file_names_the_line(tmp_path, bad, needle):
    p = _write(tmp_path, [GOOD, "", bad])
    with pytest.raises(UserError) as ei:
        load_golden(p)
    msg = str(ei.value)
    assert f"{p.name}:3" in msg and needle in msg
    assert ei.value.exit_code == EXIT_INVALID


def test_min_per_category_enforced(tmp_path):
    p = _write(tmp_path, [GOOD])
    assert len(load_golden(p)) == 1  # user files: no minimum unless asked
    with pytest.raises(UserError, match="fewer than 8"):
        load_golden(p, min_per_category=8)
    with pytest.raises(UserError, match="cannot read"):
        load_golden(tmp_path / "missing.jsonl")


def test_shipped_file_is_valid_jsonl():
    for i, line in enumerate(GOLDEN_PATH.read_text(encoding="utf-8").splitlines(), 1):
        rec = json.loads(line)
        assert set(rec) == {"id", "category", "prompt", "answer"}, i


def test_encode_single_prompt_fields(tokenizer):
    p = load_golden(per_category=1)[0]
    e = encode_prompt(tokenizer, p)
    assert 0 < e.user_start < e.answer_start < e.answer_end <= len(e.input_ids)
    assert e.input_ids[e.answer_end:] == tokenizer("\n", add_special_tokens=False)["input_ids"]


def test_a_tokenizer_without_a_chat_template_is_a_user_error(default_model_dir):
    """A model folder whose tokenizer has no chat template (a base model's files): the gate says so with a fix,
    instead of transformers' bare ValueError from apply_chat_template (found building a tiny MoE model, session 11)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_model_dir))
    tok.chat_template = None
    with pytest.raises(UserError) as e:
        encode_golden(tok, load_golden(per_category=1))
    assert e.value.exit_code == EXIT_INVALID
    assert "has no chat template" in str(e.value) and "chat_template.jinja" in str(e.value)


def test_field_and_file_limits_at_their_boundaries(tmp_path, monkeypatch):
    """A field of exactly ``MAX_FIELD_CHARS`` (20,000) characters loads, one more is refused naming the field and its
    length; a file of exactly ``MAX_FILE_BYTES`` loads, one byte more is refused before it is read."""
    from precision_pipeline.gate import golden as G

    assert (G.MAX_FIELD_CHARS, G.MAX_FILE_BYTES) == (20_000, 4 * 1024 * 1024)
    rec = json.loads(GOOD)
    (tmp_path / "ok").mkdir()
    (tmp_path / "bad").mkdir()
    ok = _write(tmp_path / "ok", [json.dumps({**rec, "answer": "a" * 20_000})])
    assert len(load_golden(ok)[0].answer) == 20_000
    bad = _write(tmp_path / "bad", [json.dumps({**rec, "answer": "a" * 20_001})])
    with pytest.raises(UserError, match="'answer' is 20001 characters; at most 20000."):
        load_golden(bad)
    monkeypatch.setattr(G, "MAX_FILE_BYTES", ok.stat().st_size)
    assert len(load_golden(ok)) == 1
    monkeypatch.setattr(G, "MAX_FILE_BYTES", ok.stat().st_size - 1)
    with pytest.raises(UserError, match=f"is {ok.stat().st_size} bytes; at most {ok.stat().st_size - 1}."):
        load_golden(ok)


def test_positions_by_hand():
    """Position t predicts token t + 1: the answer's targets ``input_ids[answer_start:answer_end]`` sit at positions
    ``answer_start - 1 .. answer_end - 2``, the prompt segment's ``input_ids[user_start:answer_start]`` at
    ``user_start - 1 .. answer_start - 2``."""
    from precision_pipeline.gate.golden import EncodedPrompt

    e = EncodedPrompt("i", "facts", "p", "a", list(range(100, 112)), user_start=3, answer_start=7, answer_end=11)
    assert (e.answer_positions, e.prompt_positions) == (slice(6, 10), slice(2, 6))
    assert (e.n_answer_tokens, e.n_prompt_tokens) == (4, 4)
    assert e.generation_prompt == list(range(100, 107))
    assert e.answer_ids == [107, 108, 109, 110]


def test_minimum_per_category_message_counts(tmp_path):
    """The shipped set needs ``MIN_PER_CATEGORY`` (8) prompts a category; the refusal lists each short category with
    its count, 0 for a category with none."""
    from precision_pipeline.gate import golden as G

    assert G.MIN_PER_CATEGORY == 8
    lines = [json.dumps({"id": f"f{i}", "category": "facts", "prompt": "Q?", "answer": "A."}) for i in range(8)]
    lines.append(json.dumps({"id": "c0", "category": "code", "prompt": "Q?", "answer": "A."}))
    p = _write(tmp_path, lines)
    with pytest.raises(UserError) as e:
        load_golden(p, min_per_category=G.MIN_PER_CATEGORY)
    others = ", ".join(f"{c} ({1 if c == 'code' else 0})" for c in CATEGORIES if c != "facts")
    assert e.value.problems[0].reason == f"golden.jsonl: categories with fewer than 8 prompts: {others}."


class _TemplateWithoutContent:
    """A chat template that drops the user's text (every user message renders alike): the user segment cannot be
    found by comparison, so it is taken as the last token before the answer (``encode_prompt``'s cap)."""

    chat_template = "x"
    unk_token_id = None
    eos_token_id = 3

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "SU"
        for m in messages[1:]:
            text += "A" + m["content"] + "E"
        return text + ("A" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [{"S": 1, "U": 2, "E": 3, "A": 4}.get(c, 10 + ord(c) % 50) for c in text]}

    def convert_tokens_to_ids(self, tok):
        return None


def test_user_start_is_capped_before_the_answer():
    from precision_pipeline.gate.golden import GoldenPrompt

    e = encode_prompt(_TemplateWithoutContent(), GoldenPrompt("p", "facts", "What?", "xy"))
    assert e.input_ids[: e.answer_start] == [1, 2, 4] and (e.user_start, e.answer_start) == (2, 3)
    assert e.answer_ids == e.input_ids[3:6] and e.n_prompt_tokens == 1
