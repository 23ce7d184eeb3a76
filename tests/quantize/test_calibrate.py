"""Calibration set: real text, stratified, deterministic; user JSONL refused with line numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from precision_pipeline.quantize.calibration import (
    KINDS,
    LENGTHS,
    build_calibration_set,
    encode_raw,
    heldout_news_texts,
    length_stratum,
    news_texts,
    stratum_lengths,
    token_sha256,
)
from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.profile import Calibration


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from precision_pipeline.quantize.calibration import load_tokenizer

    return load_tokenizer(default_model_dir)


def test_encode_raw_has_no_bos(tok):
    # the converted GGUF tokenizer prepends <|im_start|> (id 1) by default; raw encoding does not
    assert tok("Hello world").input_ids == [1, 19556, 905]
    assert encode_raw(tok, "Hello world") == [19556, 905]


def test_stratum_lengths():
    assert stratum_lengths(256) == {"short": 64, "medium": 128, "long": 256}
    assert stratum_lengths(16) == {"short": 8, "medium": 8, "long": 16}
    assert [length_stratum(n, 256) for n in (1, 64, 65, 128, 129, 256)] == ["short", "short", "medium", "medium", "long", "long"]


def test_builtin_strata_and_lengths(tok):
    cs = build_calibration_set(Calibration(num_samples=20, seq_len=64, seed=3), tok)
    comp = cs.composition
    assert len(cs.samples) == 20 == comp["num_samples"]
    strata = comp["strata"]
    assert set(strata) == {f"{k}/{l}" for k in KINDS for l in LENGTHS}
    assert sum(strata.values()) == 20
    assert sorted(strata.values()) == [2] * 7 + [3] * 2  # 20 = 9 x 2 + 2 spread one each
    lens = {"short": 16, "medium": 32, "long": 64}
    for kind, s in zip(cs.kinds, cs.samples):
        assert len(s) == lens[kind.split("/")[1]]
    assert comp["total_tokens"] == sum(len(s) for s in cs.samples) == sum(comp["stratum_tokens"].values())
    assert comp["min_len"] == 16 and comp["max_len"] == 64
    assert all(0 <= t < tok.vocab_size + 100 for s in cs.samples for t in s)
    assert all(s[0] != tok.bos_token_id for s in cs.samples)
    assert comp["sha256"] == token_sha256(cs.samples)
    # the three kinds are what they claim: news prose, docs prose, Python source
    text = {k: tok.decode(s) for k, s in zip(cs.kinds, cs.samples)}
    assert any(w in " ".join(v for k, v in text.items() if k.startswith("code/")) for w in ("def ", "import ", "self", "return"))


def test_builtin_deterministic_for_seed(tok):
    a = build_calibration_set(Calibration(num_samples=9, seq_len=32, seed=7), tok)
    b = build_calibration_set(Calibration(num_samples=9, seq_len=32, seed=7), tok)
    c = build_calibration_set(Calibration(num_samples=9, seq_len=32, seed=8), tok)
    assert a.samples == b.samples
    assert a.composition["sha256"] == b.composition["sha256"]
    assert a.composition["sha256"] != c.composition["sha256"]
    assert all(v == 1 for v in a.composition["strata"].values())


def test_heldout_news_never_used_for_calibration(tok):
    held = heldout_news_texts()
    train = news_texts()
    assert len(held) == 50 and len(train) == 300
    assert not set(held) & set(train)
    assert "£3,000" in " ".join(held)  # lee.cor is cp1252; decoded, not dropped
    cs = build_calibration_set(Calibration(num_samples=18, seq_len=64, seed=0), tok)
    assert cs.composition["sources"]["heldout_excluded"].endswith("lee.cor")
    news = [tok.decode(s) for k, s in zip(cs.kinds, cs.samples) if k.startswith("news/")]
    assert len(news) == 6
    for text in news:
        head = text[:40]
        assert any(head in art for art in train)
        assert not any(head in art for art in held)


def _write(tmp_path: Path, lines: list[str]) -> str:
    p = tmp_path / "calib.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(p)


def test_user_jsonl_ok(tok, tmp_path):
    texts = ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x + 1", "Short.",
             "Python is a programming language that lets you work quickly.", "One more line of text."]
    path = _write(tmp_path, [json.dumps({"text": t}) for t in texts])
    cs = build_calibration_set(Calibration(dataset=path, num_samples=3, seq_len=64, seed=0), tok)
    assert len(cs.samples) == 3
    used = cs.composition["sources"]["user"]["lines_used"]
    assert used == sorted(used) and len(set(used)) == 3 and all(1 <= n <= 5 for n in used)
    for n, s in zip(used, cs.samples):
        assert s == encode_raw(tok, texts[n - 1])  # never truncated, never altered
    assert all(k.startswith("user/") for k in cs.kinds)
    again = build_calibration_set(Calibration(dataset=path, num_samples=3, seq_len=64, seed=0), tok)
    assert again.samples == cs.samples


def test_user_jsonl_too_few(tok, tmp_path):
    path = _write(tmp_path, [json.dumps({"text": "a sentence"}), json.dumps({"text": "another sentence"})])
    with pytest.raises(UserError) as e:
        build_calibration_set(Calibration(dataset=path, num_samples=5, seq_len=64), tok)
    msg = e.value.message
    assert e.value.problems[0].field == "calibration.dataset"
    assert "2 usable samples" in msg and "num_samples = 5" in msg


def test_user_jsonl_empty_lines_and_blank_text(tok, tmp_path):
    lines = [json.dumps({"text": "fine"}), "", json.dumps({"text": "   "}), json.dumps({"text": "ok"}), "  "]
    path = _write(tmp_path, lines)
    with pytest.raises(UserError) as e:
        build_calibration_set(Calibration(dataset=path, num_samples=1, seq_len=64), tok)
    assert "lines 2, 3, 5 are empty or blank" in e.value.message


def test_user_jsonl_invalid_json_and_missing_text(tok, tmp_path):
    lines = [json.dumps({"text": "fine"}), "{not json", json.dumps({"txt": "x"}), json.dumps(["text"])]
    path = _write(tmp_path, lines)
    with pytest.raises(UserError) as e:
        build_calibration_set(Calibration(dataset=path, num_samples=1, seq_len=64), tok)
    msg = e.value.message
    assert "line 2 is not valid JSON" in msg
    assert "lines 3, 4 have no string \"text\"" in msg


def test_user_jsonl_too_long_is_refused_not_truncated(tok, tmp_path):
    long_text = "word " * 100  # 100 tokens > 32
    lines = [json.dumps({"text": "short one"}), json.dumps({"text": long_text}), json.dumps({"text": "also short"})]
    path = _write(tmp_path, lines)
    assert len(encode_raw(tok, long_text)) > 32
    with pytest.raises(UserError) as e:
        build_calibration_set(Calibration(dataset=path, num_samples=1, seq_len=32), tok)
    assert "line 2 (101 tokens) is longer than calibration.seq_len = 32 tokens" in e.value.message


def test_a_huge_jsonl_is_read_only_as_far_as_the_samples_need(tok, tmp_path, monkeypatch):
    """Issue 25 item 16: 3 million lines with num_samples 16 were all read and tokenized, silently (140 s+)."""
    import time

    from precision_pipeline.resolve import dataset as D

    n = 300_000
    p = tmp_path / "big.jsonl"
    with open(p, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps({"text": f"Sentence number {i} of a long calibration file."}) + "\n")
        f.write("{not json at the very end\n")
    t0 = time.perf_counter()
    data, problems = D.scan_user_dataset(str(p), stop_after=D.sample_pool(16), seq_len=64)
    assert time.perf_counter() - t0 < 2.0
    assert (data.lines, len(data.texts), problems) == (64, 64, [])  # 4 x 16 usable lines, the rest never read
    assert D.dataset_problems(str(p), 16, 64) == []  # the bad last line is past what a build reads
    cs = build_calibration_set(Calibration(dataset=str(p), num_samples=16, seq_len=64, seed=0), tok)
    used = cs.composition["sources"]["user"]["lines_used"]
    assert len(used) == 16 and max(used) <= 64 and cs.composition["sources"]["user"]["lines"] == 64
    said = []
    monkeypatch.setattr(D, "PROGRESS_EVERY_S", 0.0)
    D.scan_user_dataset(str(p), stop_after=3, seq_len=64, say=said.append)
    assert said and said[-1].startswith(f"[calibration] reading {p}: line 3, ") and "usable texts of the 3 needed" in said[-1]


def test_a_300_mb_sample_is_refused_by_its_size_before_any_tokenizer(tmp_path):
    """Issue 25 item 16: one 300 MB text passed ``check``, then the build's tokenizer reached 5.5 GB. Refused by byte
    size (more bytes than seq_len tokens can have), with the numbers, read in bounded memory."""
    import tracemalloc

    from precision_pipeline.resolve import dataset as D

    p = tmp_path / "one-huge.jsonl"
    big = 50_000_000
    with open(p, "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "fine"}) + "\n")
        f.write('{"text": "' + "a" * big + '"}\n')
        f.write(json.dumps({"text": "also fine"}) + "\n")
    tracemalloc.start()
    try:
        probs = D.dataset_problems(str(p), 2, 256)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8_000_000, peak  # the 50 MB line is never held whole
    assert len(probs) == 1
    msg = probs[0].reason
    assert f"line 2 ({big + 12:,} bytes): more than 65,536 bytes, so more than calibration.seq_len = 256 tokens" in msg
    assert D.max_text_bytes(256) == 65_536 and D.MAX_TOKEN_BYTES == 256


def test_user_jsonl_missing_file(tok, tmp_path):
    with pytest.raises(UserError) as e:
        build_calibration_set(Calibration(dataset=str(tmp_path / "nope.jsonl"), num_samples=1, seq_len=32), tok)
    assert e.value.problems[0].field == "calibration.dataset"
    assert "no file at" in e.value.message


def test_batches_equal_length(tok):
    cs = build_calibration_set(Calibration(num_samples=12, seq_len=32, seed=1), tok)
    batches = cs.batches(4)
    assert sum(len(b) for b in batches) == 12
    for b in batches:
        assert 1 <= len(b) <= 4 and len({len(s) for s in b}) == 1


def test_a_utf8_bom_in_a_calibration_jsonl_is_read(tmp_path):
    """Hostile s12 F-H: a JSONL saved with a UTF-8 byte order mark (Notepad) was refused as "line 1 is not valid
    JSON". The BOM starts the file only: read as UTF-8 with it; a BOM-like character later in a line is no BOM."""
    from precision_pipeline.resolve import dataset as D

    p = tmp_path / "bom.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"text": "bom line here and more words"}\n{"text": "second line"}\n')
    data, problems = D.scan_user_dataset(str(p), seq_len=64)
    assert problems == [] and [t for _n, t in data.texts] == ["bom line here and more words", "second line"]
    p.write_bytes(b'{"text": "first"}\n\xef\xbb\xbf{"text": "second"}\n')
    _data, problems = D.scan_user_dataset(str(p), seq_len=64)
    assert len(problems) == 1 and "line 2 is not valid JSON" in problems[0].reason, problems
