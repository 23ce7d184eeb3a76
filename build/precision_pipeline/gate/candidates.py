"""The models the gate runs: candidates (anything that gives next-token logits), HF model loading, and the
teacher-forced + greedy passes (one forward per prompt keeps the generation prompt's KV cache; greedy answers
are decoded from those caches in batches of prompts of similar length).

The candidate kinds and the measured work per model are in ``gate.checkpoint_gate``'s module doc. Logits
always come back to the CPU as ``[T, V]`` float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from precision_pipeline.core.errors import UserError
from precision_pipeline.gate.golden import EncodedPrompt


class Candidate(Protocol):
    """What the gate needs from a model under test."""

    name: str

    def logits(self, ids: Sequence[int]) -> torch.Tensor:  # [T, V] float32 on CPU
        ...

    def greedy(self, ids: Sequence[int], max_new_tokens: int, stop_id: int) -> list[int]:
        ...


def _logits_of(out: Any) -> torch.Tensor:
    t = getattr(out, "logits", out)
    if isinstance(t, (tuple, list)):
        t = t[0]
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"the candidate returned {type(out).__name__}, not logits")
    if t.dim() == 3:
        if t.shape[0] != 1:
            raise TypeError(f"the candidate returned logits of shape {tuple(t.shape)}; expected batch 1")
        t = t[0]
    if t.dim() != 2:
        raise TypeError(f"the candidate returned logits of shape {tuple(t.shape)}; expected [T, V]")
    return t.detach().to("cpu", torch.float32)


def _trim_after_stop(tokens: list[int], stop_id: int) -> list[int]:
    if stop_id in tokens:
        return tokens[: tokens.index(stop_id) + 1]
    return tokens


def _naive_greedy(logits_fn: Callable[[Sequence[int]], torch.Tensor], ids: Sequence[int], max_new_tokens: int,
                  stop_id: int) -> list[int]:
    seq = list(ids)
    out: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(torch.argmax(logits_fn(seq)[-1]).item())
        out.append(nxt)
        seq.append(nxt)
        if nxt == stop_id:
            break
    return out


class HFCandidate:
    """An HF causal LM (any dtype/device). Greedy generation via ``generate`` (KV cache)."""

    def __init__(self, model: torch.nn.Module, name: str = ""):
        self.model = model.eval()
        self.name = name or type(model).__name__
        try:
            self.device = next(model.parameters()).device
        except StopIteration:  # pragma: no cover
            self.device = torch.device("cpu")

    @torch.inference_mode()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        return _logits_of(self.model(input_ids=x, use_cache=False))

    @torch.inference_mode()
    def greedy(self, ids: Sequence[int], max_new_tokens: int, stop_id: int) -> list[int]:
        if not hasattr(self.model, "generate"):
            return _naive_greedy(self.logits, ids, max_new_tokens, stop_id)
        x = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                                  do_sample=False, num_beams=1, eos_token_id=stop_id, pad_token_id=stop_id,
                                  temperature=None, top_p=None, top_k=None)
        return _trim_after_stop(out[0, x.shape[1]:].tolist(), stop_id)

    @torch.inference_mode()
    def greedy_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_id: int) -> list[list[int]]:
        """Greedy generations of several prompts in one left-padded ``generate`` call.

        A decode step of many rows costs far less per row than one of a single prompt (the
        weights are read once per step; ``invoke bench build`` has the numbers). Padding positions are masked (``attention_mask``) and HF
        derives position ids from the mask, so each row computes what it would alone up to
        float rounding (a near-tie could flip; the reference and the candidate are batched alike).
        """
        if len(prompts) == 1 or not hasattr(self.model, "generate"):
            return [self.greedy(p, max_new_tokens, stop_id) for p in prompts]
        width = max(len(p) for p in prompts)
        x = torch.full((len(prompts), width), stop_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            x[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        out = self.model.generate(input_ids=x.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, eos_token_id=stop_id,
                                  pad_token_id=stop_id, temperature=None, top_p=None, top_k=None)
        return [_trim_after_stop(out[i, width:].tolist(), stop_id) for i in range(len(prompts))]


class CallableCandidate:
    """A plain callable ``f(input_ids[1, T]) -> logits``; greedy re-runs the full sequence."""

    def __init__(self, fn: Callable[[torch.Tensor], Any], name: str = "",
                 greedy_fn: Optional[Callable[[Sequence[int], int, int], list[int]]] = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self._greedy_fn = greedy_fn

    @torch.inference_mode()
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        return _logits_of(self.fn(torch.tensor([list(ids)], dtype=torch.long)))

    def greedy(self, ids: Sequence[int], max_new_tokens: int, stop_id: int) -> list[int]:
        if self._greedy_fn is not None:
            return _trim_after_stop(list(self._greedy_fn(ids, max_new_tokens, stop_id)), stop_id)
        return _naive_greedy(self.logits, ids, max_new_tokens, stop_id)


def as_candidate(obj: Any, name: str = "") -> Candidate:
    """Wrap an HF model, a callable or a ``Candidate`` for the gate."""
    if hasattr(obj, "logits") and hasattr(obj, "greedy") and callable(getattr(obj, "logits")):
        return obj
    if isinstance(obj, torch.nn.Module):
        return HFCandidate(obj, name)
    if callable(obj):
        return CallableCandidate(obj, name)
    raise UserError("candidate", f"a {type(obj).__name__} gives no logits.",
                    "pass an HF causal LM, a callable returning logits, or an object with logits()/greedy().")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``GateOptions`` dtype names -> torch dtypes."""


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """The HF model of ``model_dir`` in ``dtype``: on the CPU, or with ``device="cuda"`` over the
    visible GPUs (``device_map="auto"``: GPU 0 first, whole decoder layers)."""
    from transformers import AutoModelForCausalLM

    extra = {"device_map": "auto"} if device == "cuda" else {}
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **extra)
    return m.eval()

@torch.inference_mode()
def heldout_nll(logits_fn: Callable[[Sequence[int]], torch.Tensor], windows: list[list[int]],
                on_done: Optional[Callable[[int], None]] = None) -> np.ndarray:
    """Per-token NLL (nats, float64) of every held-out window: each token predicted from the ones before it."""
    out = []
    for w in windows:
        lg = logits_fn(w)[:-1]
        tg = torch.tensor(w[1:], dtype=torch.long)
        out.append((F.cross_entropy(lg.float(), tg, reduction="none")).double().numpy())
        if on_done:
            on_done(1)
    return np.concatenate(out) if out else np.zeros(0)

def greedy_all(cand: Any, encoded: Sequence[EncodedPrompt], max_new_tokens: int, stop_id: int, batch: int = 8,
               on_done: Optional[Callable[[int], None]] = None) -> list[list[int]]:
    """Greedy generations of every prompt, in prompt order. Candidates with ``greedy_batch`` get
    batches of ``batch`` prompts of similar length (sorted by length: little padding)."""
    out: list[Optional[list[int]]] = [None] * len(encoded)
    batched = hasattr(cand, "greedy_batch") and batch > 1
    for idx in batches_by_length(encoded, batch if batched else 1):
        if batched and len(idx) > 1:
            res = cand.greedy_batch([encoded[i].generation_prompt for i in idx], max_new_tokens, stop_id)
        else:
            res = [cand.greedy(encoded[i].generation_prompt, max_new_tokens, stop_id) for i in idx]
        for i, r in zip(idx, res):
            out[i] = list(r)
        if on_done:
            on_done(len(idx))
    return [o or [] for o in out]


def batches_by_length(encoded: Sequence[EncodedPrompt], batch: int) -> list[list[int]]:
    """Prompt indices sorted by generation-prompt length, cut into ``ceil(n / batch)`` consecutive
    groups of near-equal size (sizes differ by at most one; none larger than ``batch``).

    Equal sizes, not ``batch, batch, ..., rest``: 65 prompts at ``batch=48`` are 33 + 32, not
    48 + 17, so no short last batch pays a full run of decode steps for a few rows.
    """
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].generation_prompt))
    if not order:
        return []
    groups = -(-len(order) // max(1, batch))
    size, extra = divmod(len(order), groups)
    out, s = [], 0
    for g in range(groups):
        n = size + (1 if g < extra else 0)
        out.append(order[s:s + n])
        s += n
    return out


def hf_model(cand: Any) -> Optional[torch.nn.Module]:
    """The HF causal LM behind ``cand`` when the fused teacher-forced + greedy path applies, else None."""
    if isinstance(cand, HFCandidate) and hasattr(cand.model, "generate"):
        return cand.model
    return None


@dataclass
class PromptPass:
    """One teacher-forced forward of a prompt with its generation-prompt KV cache kept for greedy decoding."""

    logits: torch.Tensor                      # [T, V] float32
    hidden: Optional[torch.Tensor]            # [T, H] float32 final hidden states (when asked)
    prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer ([1, kv_heads, P, d] keys, values), P = prompt length
    first_token: int                          # argmax of the logits at the last generation-prompt position


@torch.inference_mode()
def forward_with_prefix(model: torch.nn.Module, e: EncodedPrompt, hidden: bool = False) -> PromptPass:
    """Teacher-forced forward of ``e.input_ids`` that also keeps the KV cache of the generation prompt.

    The generation prompt is a strict token prefix of the full sequence (``gate.golden``), and
    attention is causal, so the keys/values of its ``P`` positions and the logits at position
    ``P - 1`` are what a separate prefill of the prompt computes (up to float rounding of the
    larger matrix product): greedy decoding continues from them (``decode_greedy``) instead of
    re-running the prompt. One forward pass per prompt instead of two. The cache is a plain ``DynamicCache`` (every
    layer keeps every position): a sliding-window layer's own cache (transformers 4.57 ``DynamicCache(config=...)``
    for gpt-oss's ``layer_types``, Mistral's ``sliding_window``) keeps only the last window of the *whole* sequence,
    not the prompt's; the window itself is the model's attention mask (``create_sliding_window_causal_mask``), which
    applies over a full cache too.
    """
    from transformers import DynamicCache

    ids = list(e.input_ids)
    plen = len(e.generation_prompt)
    x = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    out = model(input_ids=x, use_cache=True, output_hidden_states=hidden, past_key_values=DynamicCache())
    logits = out.logits[0].to("cpu", torch.float32)
    h = out.hidden_states[-1][0].to("cpu", torch.float32) if hidden else None
    cache = out.past_key_values
    kv = [(cache[i][0][:, :, :plen].clone(), cache[i][1][:, :, :plen].clone()) for i in range(len(cache.layers))]
    del out, cache
    return PromptPass(logits, h, kv, int(torch.argmax(logits[plen - 1]).item()))


@torch.inference_mode()
def decode_greedy(model: torch.nn.Module, passes: Sequence[PromptPass], max_new_tokens: int,
                  stop_id: int, on_step: Optional[Callable[[int], None]] = None) -> list[list[int]]:
    """Greedy continuations of several prompts from their kept KV caches, decoded as one batch.

    The caches are left-padded to the longest prompt (padding masked by ``attention_mask``;
    position ids are each row's own ``prompt_length + step``, as ``generate`` derives them from the
    mask). A finished row is fed ``stop_id`` (``generate``'s pad) and decoding stops when every row
    has produced ``stop_id`` or ``max_new_tokens`` tokens exist. Returns per prompt the new tokens,
    up to and including ``stop_id``; ``max_new_tokens`` forward passes less one (the first token
    comes from the teacher-forced logits). ``on_step(n)`` (progress) is told ``len(passes)`` after
    each step, and once more the rows times the steps an early stop saved: ``len(passes) *
    (max_new_tokens - 1)`` in all (``greedy_units``).
    """
    from transformers import DynamicCache

    if max_new_tokens <= 0 or not passes:
        return [[] for _ in passes]
    lens = [p.prefix_kv[0][0].shape[2] for p in passes]
    width = max(lens)
    n_layers = len(passes[0].prefix_kv)
    data = []
    for li in range(n_layers):
        ks = [F.pad(p.prefix_kv[li][0], (0, 0, width - n, 0)) for p, n in zip(passes, lens)]
        vs = [F.pad(p.prefix_kv[li][1], (0, 0, width - n, 0)) for p, n in zip(passes, lens)]
        data.append((torch.cat(ks), torch.cat(vs)))
    cache = DynamicCache(ddp_cache_data=data)
    del data
    b = len(passes)
    device = passes[0].prefix_kv[0][0].device
    mask = torch.zeros((b, width + max_new_tokens), dtype=torch.long, device=device)
    for i, n in enumerate(lens):
        mask[i, width - n:width] = 1
    out_tokens = [[p.first_token] for p in passes]
    done = [p.first_token == stop_id for p in passes]
    cur = torch.tensor([p.first_token for p in passes], dtype=torch.long, device=device)
    base = torch.tensor(lens, dtype=torch.long, device=device)
    steps = 0
    for step in range(max_new_tokens - 1):
        if all(done):
            break
        mask[:, width + step] = 1
        out = model(input_ids=cur.view(b, 1), attention_mask=mask[:, :width + step + 1],
                    position_ids=(base + step).view(b, 1), past_key_values=cache,
                    cache_position=torch.tensor([width + step], dtype=torch.long, device=device), use_cache=True)
        nxt = out.logits[:, -1].float().argmax(-1)
        for i in range(b):
            if done[i]:
                nxt[i] = stop_id
            else:
                t = int(nxt[i].item())
                out_tokens[i].append(t)
                done[i] = t == stop_id
        cur = nxt
        del out
        steps += 1
        if on_step is not None:
            on_step(b)
    if on_step is not None and steps < max_new_tokens - 1:
        on_step(b * (max_new_tokens - 1 - steps))
    return [_trim_after_stop(t, stop_id) for t in out_tokens]


def greedy_units(encoded: Sequence[EncodedPrompt], max_new_tokens: int) -> int:
    """Progress units of one model's fused teacher-forced + greedy pass: every prompt's tokens plus
    ``max_new_tokens - 1`` decode steps per prompt (``decode_greedy``'s ``on_step`` total)."""
    return sum(len(e.input_ids) for e in encoded) + len(encoded) * max(0, max_new_tokens - 1)


__all__ = ["Candidate", "HFCandidate", "CallableCandidate", "as_candidate", "TORCH_DTYPES",
           "load_hf_model", "heldout_nll", "greedy_all", "batches_by_length", "hf_model", "PromptPass",
           "forward_with_prefix", "decode_greedy", "greedy_units"]
