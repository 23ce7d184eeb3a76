"""The golden prompt set of the accuracy gate: load, validate, select, format and tokenize.

File: ``build/precision_pipeline/gate/data/golden_prompts.jsonl`` -- one JSON object per line::

    {"id": "facts-01", "category": "facts", "prompt": "<user message>", "answer": "<reference answer>"}

Categories (each at least ``MIN_PER_CATEGORY`` prompts): facts, reasoning, code, instructions,
long_context (a few paragraphs followed by a question), non_english. The reference answers are
written by hand: plausible, good assistant answers. They are *not* the model's own output; the gate
is teacher-forced on them, so every model is scored on exactly the same token sequence.

Encoding (the same in the gate, the engine gate and -- for chat traffic -- serving):

* The conversation is ``[{"role": "user", ...}, {"role": "assistant", ...}]`` with no system
  message, rendered by the tokenizer's own chat template (``tokenizer.apply_chat_template(...,
  tokenize=False)``); the template inserts its default system message. For SmolLM2 the text is
  ``<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n{answer}<|im_end|>\\n``.
* The rendered text is tokenized with ``add_special_tokens=False``: the template already starts
  with ``<|im_start|>``, and the SmolLM2 tokenizer would otherwise prepend a second one as BOS.
  (This is exactly what ``apply_chat_template(tokenize=True)`` produces; a test checks it.)
* The greedy-generation prompt is the same conversation without the answer, rendered with
  ``add_generation_prompt=True`` -- a strict token prefix of the full sequence (checked).

Evaluated tokens (decided once, used everywhere): the **answer positions**, i.e. every position
whose next-token target is a token of the assistant's answer or the ``<|im_end|>`` that closes it.
These are the positions a served model actually samples from. The trailing ``\\n`` after
``<|im_end|>`` is not evaluated, and neither is the shared system header (identical for every
prompt, so it would only add duplicate samples). The user-turn positions (targets inside the
user message, e.g. the long_context passages) are scored too, but reported separately as the
"prompt segment" and never gated. The full set has >= 5,000 answer tokens.

Subsets for fast runs: ``select(prompts, per_category=k)`` keeps the first ``k`` prompts of each
category in file order (stratified, deterministic).

Malformed files raise ``precision_pipeline.core.errors.UserError`` (exit 2) naming the file and line.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from precision_pipeline.core.errors import UserError

GOLDEN_PATH = Path(__file__).resolve().parent / "data" / "golden_prompts.jsonl"
from precision_pipeline.spec.profile import GOLDEN_CATEGORIES as CATEGORIES  # noqa: E402 (one home: spec, which profiles validate against)
MIN_PER_CATEGORY = 8
MIN_ANSWER_TOKENS = 5000  # what the full set must give (checked by tests, not at load time)
REQUIRED_KEYS = ("id", "category", "prompt", "answer")
MAX_FIELD_CHARS = 20_000
MAX_FILE_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class GoldenPrompt:
    """One entry of the golden set."""

    id: str
    category: str
    prompt: str
    answer: str


@dataclass
class EncodedPrompt:
    """A golden prompt formatted with the chat template and tokenized.

    ``input_ids`` is the whole conversation. Position ``t`` predicts ``input_ids[t + 1]``.
    Answer positions (gated): ``range(answer_start - 1, answer_end - 1)`` -- their targets are
    ``input_ids[answer_start:answer_end]`` (answer tokens + the closing ``<|im_end|>``).
    Prompt-segment positions (reported only): ``range(user_start - 1, answer_start - 1)`` --
    targets are the user's message and the template tokens up to the assistant header.
    ``input_ids[:answer_start]`` is the greedy-generation prompt.
    """

    id: str
    category: str
    prompt: str
    answer: str
    input_ids: list[int]
    user_start: int
    answer_start: int
    answer_end: int

    @property
    def answer_positions(self) -> slice:
        return slice(self.answer_start - 1, self.answer_end - 1)

    @property
    def prompt_positions(self) -> slice:
        return slice(self.user_start - 1, self.answer_start - 1)

    @property
    def n_answer_tokens(self) -> int:
        return self.answer_end - self.answer_start

    @property
    def n_prompt_tokens(self) -> int:
        return self.answer_start - self.user_start

    @property
    def generation_prompt(self) -> list[int]:
        return self.input_ids[: self.answer_start]

    @property
    def answer_ids(self) -> list[int]:
        return self.input_ids[self.answer_start: self.answer_end]


# ----------------------------------------------------------------------------------------------
# Loading and validation


def _bad(path: Path, line: int, reason: str, fix: str) -> UserError:
    return UserError(f"{path.name}:{line}", reason, fix, source=str(path))


def load_golden(path: Path | str | None = None, per_category: int | None = None,
                min_per_category: int | None = None) -> list[GoldenPrompt]:
    """Load and validate the golden set (file order kept); optionally keep a stratified subset.

    Validation: every non-blank line is a JSON object with exactly the keys id, category, prompt
    and answer (non-empty strings); the category is one of ``CATEGORIES``; ids are unique. For
    the shipped file (or when ``min_per_category`` is given) each category must have at least
    that many prompts. Raises UserError naming the line.
    """
    path = Path(path) if path is not None else GOLDEN_PATH
    try:
        size = path.stat().st_size
    except OSError as e:
        raise UserError("golden set", f"cannot read {path}: {e.strerror}.", "give an existing JSONL file.", source=str(path))
    if size > MAX_FILE_BYTES:
        raise UserError("golden set", f"{path} is {size} bytes; at most {MAX_FILE_BYTES}.", "trim the file.", source=str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError("golden set", f"{path} is not UTF-8 ({e.reason} at byte {e.start}).", "save it as UTF-8.", source=str(path))
    prompts: list[GoldenPrompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise _bad(path, lineno, f"is not valid JSON ({e.msg}, column {e.colno}).",
                       "write one JSON object per line, e.g. {\"id\": \"facts-01\", \"category\": \"facts\", \"prompt\": \"...\", \"answer\": \"...\"}.")
        if not isinstance(rec, dict):
            raise _bad(path, lineno, f"holds a JSON {type(rec).__name__}, not an object.", "write one JSON object per line.")
        missing = [k for k in REQUIRED_KEYS if k not in rec]
        if missing:
            raise _bad(path, lineno, f"lacks key(s) {', '.join(missing)}.", f"every line needs {', '.join(REQUIRED_KEYS)}.")
        extra = sorted(set(rec) - set(REQUIRED_KEYS))
        if extra:
            raise _bad(path, lineno, f"has unknown key(s) {', '.join(extra)}.", f"allowed keys: {', '.join(REQUIRED_KEYS)}.")
        for k in REQUIRED_KEYS:
            v = rec[k]
            if not isinstance(v, str) or not v.strip():
                raise _bad(path, lineno, f"'{k}' must be a non-empty string (got {v!r:.40}).", "fill it in.")
            if len(v) > MAX_FIELD_CHARS:
                raise _bad(path, lineno, f"'{k}' is {len(v)} characters; at most {MAX_FIELD_CHARS}.", "shorten it.")
        if rec["category"] not in CATEGORIES:
            raise _bad(path, lineno, f"category {rec['category']!r} is not known.", f"use one of: {', '.join(CATEGORIES)}.")
        if rec["id"] in seen:
            raise _bad(path, lineno, f"id {rec['id']!r} already used on line {seen[rec['id']]}.", "give every prompt a unique id.")
        seen[rec["id"]] = lineno
        prompts.append(GoldenPrompt(rec["id"], rec["category"], rec["prompt"], rec["answer"]))
    if not prompts:
        raise UserError("golden set", f"{path} holds no prompts.", "add at least one JSON line.", source=str(path))
    need = min_per_category if min_per_category is not None else (MIN_PER_CATEGORY if path == GOLDEN_PATH else 0)
    if need:
        counts = Counter(p.category for p in prompts)
        short = [f"{c} ({counts.get(c, 0)})" for c in CATEGORIES if counts.get(c, 0) < need]
        if short:
            raise UserError("golden set", f"{path.name}: categories with fewer than {need} prompts: {', '.join(short)}.",
                            "add prompts to those categories.", source=str(path))
    return select(prompts, per_category) if per_category is not None else prompts


def select(prompts: Sequence[GoldenPrompt], per_category: int | None) -> list[GoldenPrompt]:
    """The first ``per_category`` prompts of each category, in file order (None = all)."""
    if per_category is None:
        return list(prompts)
    if per_category < 1:
        raise UserError("golden_limit", f"must be >= 1 prompts per category (got {per_category}).", "pass a positive number or None.")
    taken: Counter = Counter()
    out = []
    for p in prompts:
        if taken[p.category] < per_category:
            taken[p.category] += 1
            out.append(p)
    return out


# ----------------------------------------------------------------------------------------------
# Formatting and tokenization


def conversation(p: GoldenPrompt, with_answer: bool = True) -> list[dict[str, str]]:
    msgs = [{"role": "user", "content": p.prompt}]
    if with_answer:
        msgs.append({"role": "assistant", "content": p.answer})
    return msgs


def render(tokenizer: Any, p: GoldenPrompt) -> tuple[str, str]:
    """(full conversation text, generation-prompt text), both rendered by the chat template. UserError when the
    tokenizer has no chat template (transformers would raise a bare ValueError)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("model tokenizer", "has no chat template (no chat_template in tokenizer_config.json, no "
                        "chat_template.jinja): the golden prompts are chat conversations rendered by it.",
                        "use the model's instruct/chat tokenizer files, or add its chat template to the model folder.")
    full = tokenizer.apply_chat_template(conversation(p, True), tokenize=False)
    gen = tokenizer.apply_chat_template(conversation(p, False), tokenize=False, add_generation_prompt=True)
    return full, gen


def _encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def end_of_turn_id(tokenizer: Any) -> int:
    """Token id that ends an assistant turn (``<|im_end|>`` for ChatML templates, else EOS)."""
    tid = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
        return tid
    if tokenizer.eos_token_id is None:
        raise UserError("tokenizer", "has neither <|im_end|> nor an EOS token.", "use a chat model's tokenizer.")
    return int(tokenizer.eos_token_id)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _user_content_start(tokenizer: Any, full: list[int]) -> int:
    """Index of the first token of the user's message: where conversations with other user
    messages stop sharing tokens with this one (system block + user header come before it)."""
    starts = []
    for probe in ("A", "7"):
        text = tokenizer.apply_chat_template([{"role": "user", "content": probe}], tokenize=False,
                                             add_generation_prompt=True)
        starts.append(_common_prefix(full, _encode_text(tokenizer, text)))
    return max(1, min(starts))


def encode_prompt(tokenizer: Any, p: GoldenPrompt) -> EncodedPrompt:
    """Format one prompt with the chat template and tokenize it (see the module docstring)."""
    full_text, gen_text = render(tokenizer, p)
    full = _encode_text(tokenizer, full_text)
    gen = _encode_text(tokenizer, gen_text)
    if full[: len(gen)] != gen:
        raise UserError(f"golden prompt {p.id}", "the generation prompt does not tokenize as a prefix of the full conversation.",
                        "check the chat template (the answer must follow the assistant header directly).")
    user_start = min(_user_content_start(tokenizer, full), len(gen) - 1)
    eot = end_of_turn_id(tokenizer)
    answer_start = len(gen)
    try:
        answer_end = full.index(eot, answer_start) + 1  # answer tokens + the closing end-of-turn
    except ValueError:
        answer_end = len(full)
    if answer_end - answer_start < 2:
        raise UserError(f"golden prompt {p.id}", "its answer encodes to no tokens.", "write a non-empty answer.")
    return EncodedPrompt(p.id, p.category, p.prompt, p.answer, full, user_start, answer_start, answer_end)


def encode_golden(tokenizer: Any, prompts: Iterable[GoldenPrompt]) -> list[EncodedPrompt]:
    return [encode_prompt(tokenizer, p) for p in prompts]


def golden_hash(encoded: Sequence[EncodedPrompt]) -> str:
    """sha256 over ids, categories and token ids (what the cached reference depends on)."""
    h = hashlib.sha256()
    for e in encoded:
        h.update(json.dumps([e.id, e.category, e.input_ids, e.user_start, e.answer_start, e.answer_end]).encode())
    return h.hexdigest()


@dataclass
class GoldenSummary:
    prompts: int
    answer_tokens: int
    prompt_tokens: int
    total_tokens: int
    per_category: dict[str, dict[str, int]] = field(default_factory=dict)


def summarize(encoded: Sequence[EncodedPrompt]) -> GoldenSummary:
    per: dict[str, dict[str, int]] = {}
    for e in encoded:
        d = per.setdefault(e.category, {"prompts": 0, "answer_tokens": 0, "prompt_tokens": 0})
        d["prompts"] += 1
        d["answer_tokens"] += e.n_answer_tokens
        d["prompt_tokens"] += e.n_prompt_tokens
    return GoldenSummary(
        prompts=len(encoded),
        answer_tokens=sum(e.n_answer_tokens for e in encoded),
        prompt_tokens=sum(e.n_prompt_tokens for e in encoded),
        total_tokens=sum(len(e.input_ids) for e in encoded),
        per_category=per,
    )


__all__ = [
    "GOLDEN_PATH", "CATEGORIES", "MIN_PER_CATEGORY", "MIN_ANSWER_TOKENS", "GoldenPrompt", "EncodedPrompt",
    "load_golden", "select", "conversation", "render", "encode_prompt", "encode_golden", "golden_hash",
    "summarize", "GoldenSummary", "end_of_turn_id",
]
