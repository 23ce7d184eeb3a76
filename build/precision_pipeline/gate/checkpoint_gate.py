"""The accuracy gate: compare a quantized model with the unquantized FP32 reference.

``run_gate(candidate, reference_model_dir, thresholds, out_dir, options, runtime)`` scores ``candidate`` on the
golden prompt set (``build/precision_pipeline/gate/golden.py``: chat template applied by the tokenizer, teacher-forced
on hand-written reference answers; gated positions are the answer tokens) and on held-out news
text, against the FP32 reference it loads itself from ``reference_model_dir``. It writes
``out_dir/metrics.json``, ``out_dir/report.md``, ``out_dir/report.html`` and
``out_dir/per_token.npz`` (``out_dir`` is the gate's own folder, e.g. ``artifacts/<profile>/gate``).
What is measured is a ``gate.options.GateOptions`` (hashed); how it runs is a ``GateRuntime`` (not hashed).

Candidate: anything that gives next-token logits (``as_candidate``):

* an HF causal LM (``torch.nn.Module`` whose output has ``.logits``, e.g. what
  ``precision_pipeline.gate.model.load_checkpoint_model`` returns): one forward pass per prompt
  (``forward_with_prefix``) gives its teacher-forced logits and the KV cache of its generation prompt
  (a strict prefix), and the greedy answers are decoded from those caches in batches of prompts of
  similar length (``decode_greedy``; the same tokens as ``model.generate`` on a left-padded batch,
  without re-running the prompts);
* a callable ``f(input_ids: LongTensor[1, T]) -> logits`` (``[1, T, V]``, ``[T, V]`` or an object
  with ``.logits``): greedy generation then re-runs the whole sequence per new token;
* an object with ``logits(ids: list[int]) -> Tensor[T, V]`` and
  ``greedy(ids, max_new_tokens, stop_id) -> list[int]`` (the ``Candidate`` protocol; the engine
  gate uses it).

Metrics (all on the answer positions unless noted; per-token values are computed per prompt,
streaming, so at most two ``[T, vocab]`` logit tensors exist at any time):

* ``kl_mean``, ``kl_p95``, ``kl_p99``, ``kl_max``: KL(P_ref || P_cand) of the next-token
  distribution, in nats, per token, pooled over all answer tokens of all prompts.
* ``top1``: fraction of answer positions where the candidate's argmax equals the reference's.
* ``ppl_delta_pct``: perplexity change on held-out news (``calibrate.heldout_news_texts()``,
  disjoint from calibration), raw text without BOS, first ``options.heldout_tokens`` tokens cut into
  windows of ``options.heldout_window`` tokens: ``(ppl_cand / ppl_ref - 1) * 100``.
* ``greedy_same``: fraction of prompts whose greedy answer (``options.greedy_new_tokens`` new tokens, or
  up to ``<|im_end|>``) is token-identical to the reference's; first divergence per prompt.
* Informational: answer NLL/perplexity of both models on the golden answers, the prompt segment
  (user-turn positions), per-category breakdown, worst prompts with both generations.

95% confidence intervals: percentile bootstrap over prompts (the prompts are resampled with
replacement and their tokens pooled; ``options.bootstrap_resamples`` resamples, fixed ``options.seed``).

Noise floor: the same folder loaded in BF16 (``torch.bfloat16`` weights and compute), scored with
the same code on the same tokens. It is what "no quantization, just BF16 inference" costs; a
threshold below the floor cannot be met even by a BF16 engine (the report flags it).

Device and dtypes (``GateOptions.device`` / ``reference_dtype`` / ``candidate_dtype``, chosen by
``invoke build --device`` / ``--reference-dtype``): on the CPU everything runs as described here
(FP32 reference, FP32 candidate); on CUDA the models are spread over the visible GPUs
(``device_map="auto"``) and the candidate runs in the profile's dtype. A BF16 reference (when FP32
does not fit) has no noise floor (metrics.json ``reference`` says so); its cached hidden states are
still turned into logits by the FP32 lm_head. Logits always come back to the CPU as FP32, where
every metric is computed. The reference cache key includes the device and the reference dtype.

Pass/fail: each metric's point estimate against its threshold (``None`` = not checked):
``kl_mean <= kl_mean_max``, ``kl_p99 <= kl_p99_max``, ``top1 >= top1_min``,
``ppl_delta_pct <= ppl_delta_pct_max``, ``greedy_same >= greedy_same_min``. A checked metric
that was not measured (``heldout_tokens=0``, ``greedy_new_tokens=0``) fails. ``passed`` is the
AND of the checked metrics and of every golden-set category's checks: each category's KL mean, KL P99,
top-1 and greedy share against its bar (``GateBar.for_category``: the model's bar with the profile's
``gate.categories`` entry winning), failing only when the category's whole bootstrap 95% interval lies
past the bar; a one-prompt category is not judged (``judge_metrics``, the one rule; ``invoke promote``
re-judges stored metrics.json with it). ``promotable`` is False below ``GateBar.min_prompts`` prompts.
``GateResult.raise_if_failed()`` raises ``GateFailed`` (exit 3) naming the failing metrics and categories.

Reference cache: the FP32 reference's final hidden states (after the last norm; logits are
``lm_head(h)``, recomputed per prompt in FP32), its greedy generations and held-out NLL, and all
noise-floor results are cached under ``precision_pipeline.spec.default_model.cache_dir()/gate-ref/<key>/``, keyed by a
fingerprint of the model folder, the golden token ids, the held-out token ids, the stop id,
``GateOptions.reference_key_fields()`` (every option but the bootstrap's and the golden file's path) and
the library versions (``reference_key``). The first gate of a model pays the FP32 + BF16 passes; later
gates only run the candidate.


Measured on SmolLM2-135M-Instruct, full golden set (65 prompts, 5,436 answer tokens; 2,044
held-out tokens; 32 greedy tokens), 2 shared CPU cores, torch 2.13, transformers 4.57.6:

- KL mean (nats): BF16 floor 0.00114 [0.00103, 0.00127]; FP8+FP8-KV checkpoint (8x64 calibration)
  0.0554 [0.0488, 0.0628]
- KL P95 / P99 / max: floor 0.00367 / 0.00816 [0.0070, 0.0096] / 0.058; FP8 0.191 / 0.468
  [0.376, 0.530] / 4.12
- top-1 agreement: floor 0.9818 [0.978, 0.985]; FP8 0.891 [0.876, 0.907]
- held-out perplexity change: floor +0.08 % (33.70 -> 33.73); FP8 +4.09 % (-> 35.08)
- greedy answers unchanged: floor 0.57 [0.45, 0.69]; FP8 0.06

``greedy_same`` is noisy: BF16 alone changes 43 % of the 32-token greedy answers (0.982^32 ~ 0.56),
so a ``greedy_same_min`` above ~0.4 would fail BF16 itself.

Work per model scored (full set): one teacher-forced forward per prompt (11,564 tokens; it also
yields the generation prompt's KV cache), at most ``2 x 31`` batched decode steps (two batches,
33 and 32 prompts, at ``greedy_batch`` 48; the first greedy token comes from the teacher-forced logits) and 4 held-out windows of 512 tokens: about
15,600 tokens, where a separate ``generate`` prefill made it about 22,000. Threads: the cores other
processes leave free (``thread_choice``; the log says how many and why). Times: ``invoke bench
build`` (README, Measured times).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from precision_pipeline.core.errors import GateFailed, UserError
from precision_pipeline.core.progress import StageProgress
from precision_pipeline.core.store import atomic_dir, atomic_write_json, hash_obj, locked, read_json
from precision_pipeline.gate.golden import EncodedPrompt, encode_golden, end_of_turn_id, golden_hash, load_golden, summarize
from precision_pipeline.gate.options import DEFAULT_BOOTSTRAP, DEFAULT_HELDOUT_WINDOW, GateOptions, GateRuntime
from precision_pipeline.spec.families import family_of_model_type
from precision_pipeline.spec.profile import GateBar, GateThresholds

CACHE_VERSION = 3  # 2: the key hashes GateOptions.reference_key_fields(); 3: greedy decoded from the teacher-forced KV cache
WORST_PROMPTS = 5
KL_CHUNK_ROWS = 256

# metric name -> (threshold field, comparison)
CHECKS: dict[str, tuple[str, str]] = {
    "kl_mean": ("kl_mean_max", "<="),
    "kl_p99": ("kl_p99_max", "<="),
    "top1": ("top1_min", ">="),
    "ppl_delta_pct": ("ppl_delta_pct_max", "<="),
    "greedy_same": ("greedy_same_min", ">="),
}
METRIC_ORDER = ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1", "ppl_delta_pct", "greedy_same")
METRIC_LABELS = {
    "kl_mean": "KL mean (nats)", "kl_p95": "KL P95 (nats)", "kl_p99": "KL P99 (nats)", "kl_max": "KL max (nats)",
    "top1": "Top-1 agreement", "ppl_delta_pct": "Held-out perplexity change (%)",
    "greedy_same": "Greedy answers unchanged",
}


# ==============================================================================================
# Candidates


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


# ==============================================================================================
# Metric core (shared with engine_gate)


@dataclass
class TokenMetrics:
    """Per-position numbers for one prompt segment (numpy arrays of equal length)."""

    kl: np.ndarray        # KL(P_ref || P_cand), nats, float64
    top1: np.ndarray      # bool: argmax equal
    ref_nll: np.ndarray   # -log P_ref(target), nats (NaN without targets)
    cand_nll: np.ndarray  # -log P_cand(target)


def token_metrics(ref_logits: torch.Tensor, cand_logits: torch.Tensor, targets: Optional[torch.Tensor] = None,
                  chunk_rows: int = KL_CHUNK_ROWS) -> TokenMetrics:
    """Per-row KL(P_ref || P_cand), top-1 agreement and target NLLs of two ``[T, V]`` logit tensors.

    Computed in FP32 in chunks of ``chunk_rows`` rows (bounded memory); KL is clamped at 0 (it
    can come out at -1e-7 from rounding). A candidate with a padded vocabulary (engines pad to
    a multiple of the tensor-parallel size) is cut to the reference's vocabulary.
    """
    if ref_logits.dim() != 2 or cand_logits.dim() != 2:
        raise ValueError("logits must be [T, V]")
    if cand_logits.shape[0] != ref_logits.shape[0]:
        raise ValueError(f"row mismatch: reference {ref_logits.shape[0]}, candidate {cand_logits.shape[0]}")
    v = ref_logits.shape[1]
    if cand_logits.shape[1] < v:
        raise ValueError(f"candidate vocabulary {cand_logits.shape[1]} is smaller than the reference's {v}")
    cand_logits = cand_logits[:, :v]
    n = ref_logits.shape[0]
    kl = np.empty(n, dtype=np.float64)
    top1 = np.empty(n, dtype=bool)
    ref_nll = np.full(n, np.nan)
    cand_nll = np.full(n, np.nan)
    for s in range(0, n, chunk_rows):
        e = min(n, s + chunk_rows)
        lr = F.log_softmax(ref_logits[s:e].float(), dim=-1)
        lc = F.log_softmax(cand_logits[s:e].float(), dim=-1)
        klc = (lr.exp() * (lr - lc)).sum(-1)
        kl[s:e] = klc.clamp_min(0.0).double().numpy()
        top1[s:e] = (lr.argmax(-1) == lc.argmax(-1)).numpy()
        if targets is not None:
            tg = targets[s:e].long().view(-1, 1)
            ref_nll[s:e] = (-lr.gather(1, tg).squeeze(1)).double().numpy()
            cand_nll[s:e] = (-lc.gather(1, tg).squeeze(1)).double().numpy()
        del lr, lc, klc
    return TokenMetrics(kl, top1, ref_nll, cand_nll)


def kl_summary(kl: np.ndarray) -> dict[str, float]:
    """mean, P95, P99, max of pooled per-token KL (percentiles: numpy 'linear')."""
    if kl.size == 0:
        return {"kl_mean": float("nan"), "kl_p95": float("nan"), "kl_p99": float("nan"), "kl_max": float("nan")}
    return {"kl_mean": float(kl.mean()), "kl_p95": float(np.percentile(kl, 95)),
            "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max())}


def bootstrap_ci(groups: Sequence[np.ndarray], stat: Callable[[np.ndarray], float], n_boot: int = DEFAULT_BOOTSTRAP,
                 seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of ``stat(pooled values)``, resampling whole groups (prompts).

    Deterministic for a given ``seed``. Returns (nan, nan) when there are no groups.
    """
    groups = [np.asarray(g, dtype=np.float64) for g in groups]
    if not groups or n_boot <= 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    k = len(groups)
    vals = np.empty(n_boot)
    for b in range(n_boot):
        idx = rng.integers(0, k, size=k)
        pooled = np.concatenate([groups[i] for i in idx])
        vals[b] = stat(pooled) if pooled.size else np.nan
    a = (1.0 - level) / 2.0
    return (float(np.nanpercentile(vals, 100 * a)), float(np.nanpercentile(vals, 100 * (1 - a))))


def _ci_for_all(kl_groups: list[np.ndarray], top1_groups: list[np.ndarray], n_boot: int, seed: int) -> dict[str, list[float]]:
    """CIs of the KL stats and top-1 from one shared set of resamples (same prompts per replicate)."""
    if not kl_groups or n_boot <= 0:
        return {}
    rng = np.random.default_rng(seed)
    k = len(kl_groups)
    sums = np.array([g.sum() for g in kl_groups])
    cnts = np.array([g.size for g in kl_groups], dtype=np.float64)
    hits = np.array([g.sum() for g in top1_groups], dtype=np.float64)
    out = {m: np.empty(n_boot) for m in ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1")}
    for b in range(n_boot):
        idx = rng.integers(0, k, size=k)
        n = cnts[idx].sum()
        pooled = np.concatenate([kl_groups[i] for i in idx])
        out["kl_mean"][b] = sums[idx].sum() / n
        out["kl_p95"][b], out["kl_p99"][b] = np.percentile(pooled, [95, 99])
        out["kl_max"][b] = pooled.max()
        out["top1"][b] = hits[idx].sum() / n
    return {m: [float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))] for m, v in out.items()}


def compare_generations(ref: Sequence[int], cand: Sequence[int]) -> Optional[int]:
    """First index where two greedy generations differ (None when identical)."""
    for i, (a, b) in enumerate(zip(ref, cand)):
        if a != b:
            return i
    if len(ref) != len(cand):
        return min(len(ref), len(cand))
    return None


def perplexity(nll: np.ndarray) -> float:
    return float(math.exp(float(np.mean(nll)))) if nll.size else float("nan")


# ==============================================================================================
# Held-out text


def heldout_texts() -> list[str]:
    """Held-out news articles: ``precision_pipeline.quantize.calibration.heldout_news_texts()``; if that module is not
    importable, gensim's ``test/test_data/lee.cor`` read directly (gensim is never imported)."""
    try:
        from precision_pipeline.quantize.calibration import heldout_news_texts  # type: ignore

        return list(heldout_news_texts())
    except ImportError:
        import importlib.util

        spec = importlib.util.find_spec("gensim")
        if spec is None or not spec.submodule_search_locations:
            raise UserError("gate", "held-out text needs the gensim wheel's lee.cor, but gensim is not installed.",
                            "run the set-up script, or pass heldout_tokens=0.")
        path = Path(list(spec.submodule_search_locations)[0]) / "test" / "test_data" / "lee.cor"
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("cp1252", errors="replace")
        return [ln.strip() for ln in text.splitlines() if ln.strip()]


def heldout_windows(tokenizer: Any, n_tokens: int, window: int = DEFAULT_HELDOUT_WINDOW) -> list[list[int]]:
    """The first ``n_tokens`` tokens of the held-out articles (joined by blank lines, raw text,
    no BOS -- the calibration encoding), cut into windows of ``window`` tokens (last may be shorter;
    windows under 2 tokens are dropped)."""
    if n_tokens <= 0:
        return []
    ids: list[int] = []
    for art in heldout_texts():
        ids.extend(tokenizer((art + "\n\n"), add_special_tokens=False)["input_ids"])
        if len(ids) >= n_tokens:
            break
    ids = ids[:n_tokens]
    wins = [ids[i:i + window] for i in range(0, len(ids), window)]
    return [w for w in wins if len(w) >= 2]


# ==============================================================================================
# Reference (FP32) and noise floor (BF16), cached


def model_fingerprint(model_dir: Path) -> str:
    """Content fingerprint (hex sha256) of an HF folder: the one policy of
    ``precision_pipeline.core.fingerprint.model_fingerprint`` (full sha256, memoized by path, size, mtime)."""
    from precision_pipeline.core.fingerprint import model_fingerprint as _fp

    return _fp(model_dir).sha256


@dataclass
class ReferenceData:
    """Everything the gate needs from the reference and the BF16 floor (cacheable)."""

    hidden: list[np.ndarray]                 # per prompt [T, H] float32, final hidden states
    ref_greedy: list[list[int]]
    ref_heldout_nll: np.ndarray
    ref_answer_nll: list[np.ndarray]
    floor: Optional[dict[str, Any]]          # per-prompt arrays + greedy + heldout nll, or None
    seconds: dict[str, float]
    cache_hit: bool = False
    key: str = ""


TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``GateOptions`` dtype names -> torch dtypes."""


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: str = "cpu") -> torch.nn.Module:
    """The HF model of ``model_dir`` in ``dtype``: on the CPU, or with ``device="cuda"`` over the
    visible GPUs (``device_map="auto"``: GPU 0 first, whole decoder layers)."""
    from transformers import AutoModelForCausalLM

    extra = {"device_map": "auto"} if device == "cuda" else {}
    m = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **extra)
    return m.eval()


def reference_label(options: GateOptions) -> str:
    """``FP32`` / ``BF16`` (+ `` on CUDA``): what the report and the log call the reference."""
    return ("FP32" if options.reference_dtype == "float32" else "BF16") + (" on CUDA" if options.device == "cuda" else "")


THREAD_SAMPLE_S = 0.5
"""Seconds ``thread_choice`` watches /proc/stat to see how busy the other processes keep the cores."""


def _proc_jiffies() -> Optional[tuple[float, float]]:
    """(busy jiffies of all CPUs, this process's own user+system jiffies, threads included), or None."""
    try:
        with open("/proc/stat") as f:
            cpu = [float(x) for x in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0.0)  # idle + iowait
    busy = sum(cpu[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is inside user)
    return busy, float(own[11]) + float(own[12])  # utime, stime (fields 14, 15)


@dataclass(frozen=True)
class ThreadChoice:
    """How many torch threads the gate uses and why (``reason`` is printed in the build log)."""

    threads: int
    cores: int
    others_busy: Optional[float]   # cores kept busy by other processes while sampled (None: not measurable)
    load1: Optional[float]         # 1-minute load average (all processes, ours included)
    reason: str


def thread_choice(sample_s: float = THREAD_SAMPLE_S, cores: Optional[int] = None) -> ThreadChoice:
    """Torch threads for CPU inference on a machine that may be shared: the cores that *other*
    processes leave free, ``round(cores - others_busy + 0.5)``, at least 1, at most ``cores``.

    ``others_busy``: from /proc/stat over ``sample_s`` seconds, all CPUs' busy time minus this
    process's own CPU time (so a build that just calibrated on every core does not count itself
    as load, which the load average would). Where /proc is unreadable: the 1-minute load average
    minus this process's own average CPU use since it started. More threads than free cores makes
    PyTorch CPU inference several times *slower* (2 cores with 3 other jobs: a 256-token forward
    2.4 s with 1 thread, 4.6-17 s with 2), so the gate does not oversubscribe.
    """
    n = cores or os.cpu_count() or 1
    try:
        load1: Optional[float] = os.getloadavg()[0]
    except (OSError, AttributeError):  # pragma: no cover - not on Linux
        load1 = None
    others: Optional[float] = None
    how = ""
    a = _proc_jiffies()
    if a is not None and sample_s > 0:
        t0 = time.monotonic()
        time.sleep(sample_s)
        b = _proc_jiffies()
        dt = time.monotonic() - t0
        if b is not None and dt > 0:
            hz = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
            others = max(0.0, ((b[0] - a[0]) - (b[1] - a[1])) / hz / dt)
            how = f"other processes kept {others:.1f} of {n} cores busy over {dt:.1f} s (/proc/stat minus this process)"
    if others is None and load1 is not None:
        import resource

        ru = resource.getrusage(resource.RUSAGE_SELF)
        own_rate = 0.0
        try:
            age = time.time() - _process_start_time()
            own_rate = (ru.ru_utime + ru.ru_stime) / age if age > 0 else 0.0
        except (OSError, ValueError):
            pass
        others = max(0.0, load1 - own_rate)
        how = f"load average {load1:.2f} minus this process's own {own_rate:.2f}"
    busy = others or 0.0
    threads = max(1, min(n, int(round(n - busy + 0.5))))
    if others is None:
        how = "load unknown"
    load_s = f"; load average {load1:.2f}" if load1 is not None else ""
    return ThreadChoice(threads, n, others, load1, f"{threads} torch thread{'s' if threads != 1 else ''}: {how}{load_s}")


def _process_start_time() -> float:
    """This process's start (epoch seconds), from /proc/self/stat and /proc/stat btime."""
    with open("/proc/self/stat") as f:
        start_ticks = float(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        btime = next(float(ln.split()[1]) for ln in f if ln.startswith("btime"))
    return btime + start_ticks / float(os.sysconf("SC_CLK_TCK"))


def auto_threads() -> int:
    """Torch threads for the gate: ``thread_choice().threads`` (the cores other processes leave free)."""
    return thread_choice().threads


@contextlib.contextmanager
def torch_threads(n: Optional[int]) -> Iterator[None]:
    """Run the block with ``n`` torch CPU threads (None: ``auto_threads()``); the old count is restored after.

    Shared by the gate and the sensitivity analysis (both are CPU inference on a shared machine).
    """
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, n or auto_threads()))
    try:
        yield
    finally:
        torch.set_num_threads(old)


@torch.inference_mode()
def _heldout_nll(logits_fn: Callable[[Sequence[int]], torch.Tensor], windows: list[list[int]],
                 on_done: Optional[Callable[[int], None]] = None) -> np.ndarray:
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
    for idx in _batches_by_length(encoded, batch if batched else 1):
        if batched and len(idx) > 1:
            res = cand.greedy_batch([encoded[i].generation_prompt for i in idx], max_new_tokens, stop_id)
        else:
            res = [cand.greedy(encoded[i].generation_prompt, max_new_tokens, stop_id) for i in idx]
        for i, r in zip(idx, res):
            out[i] = list(r)
        if on_done:
            on_done(len(idx))
    return [o or [] for o in out]


def _batches_by_length(encoded: Sequence[EncodedPrompt], batch: int) -> list[list[int]]:
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


def _hf_model(cand: Any) -> Optional[torch.nn.Module]:
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
    re-running the prompt. One forward pass per prompt instead of two.
    """
    ids = list(e.input_ids)
    plen = len(e.generation_prompt)
    x = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    out = model(input_ids=x, use_cache=True, output_hidden_states=hidden)
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


def _compute_reference(model_dir: Path, encoded: list[EncodedPrompt], windows: list[list[int]], stop_id: int,
                       options: GateOptions, prog: Optional[StageProgress] = None) -> ReferenceData:
    """FP32 reference (and BF16 floor) results. Per batch of prompts of similar length: one
    teacher-forced forward per prompt and model (hidden states, answer NLL, floor metrics; the
    prompt's KV cache kept), then the batch's greedy answers decoded from those caches."""
    greedy_new, greedy_batch, with_floor = options.greedy_new_tokens, options.greedy_batch, options.measures_floor
    prog = prog or StageProgress("gate", enabled=False)
    seconds: dict[str, float] = {"teacher_forced": 0.0, "greedy": 0.0}
    t0 = time.perf_counter()
    ref = load_hf_model(model_dir, TORCH_DTYPES[options.reference_dtype], options.device)
    lm_head = ref.get_output_embeddings()
    floor_model = load_hf_model(model_dir, torch.bfloat16, options.device) if with_floor else None
    seconds["load"] = time.perf_counter() - t0
    ref_c = HFCandidate(ref, "fp32")
    floor_c = HFCandidate(floor_model, "bf16") if floor_model is not None else None
    n = len(encoded)
    hidden: list[Optional[np.ndarray]] = [None] * n
    ref_answer_nll: list[Optional[np.ndarray]] = [None] * n
    ref_greedy: list[list[int]] = [[] for _ in range(n)] if greedy_new > 0 else []
    fl: dict[str, Any] = {"answer": [None] * n, "prompt": [None] * n,
                          "greedy": [[] for _ in range(n)] if greedy_new > 0 else [], "heldout_nll": None}
    checked = False
    what = f"reference {reference_label(options)}" + (" + BF16 floor" if with_floor else "")
    with torch.inference_mode():
        ph = prog.phase(what + (f", teacher-forced + greedy ({greedy_new} tokens)" if greedy_new > 0 else
                                ", teacher-forced"),
                        total=greedy_units(encoded, greedy_new) * (2 if floor_model is not None else 1), unit="tokens")
        for idx in _batches_by_length(encoded, greedy_batch):
            t0 = time.perf_counter()
            ref_passes, floor_passes = [], []
            for i in idx:
                e = encoded[i]
                rp = forward_with_prefix(ref, e, hidden=True)
                logits, h = rp.logits, rp.hidden
                if not checked:  # the cache stores h and recomputes lm_head(h): check that this is what the model does
                    again = lm_head(h.to(lm_head.weight.device, lm_head.weight.dtype)).to("cpu", torch.float32)
                    if not torch.allclose(again, logits, atol=1e-3, rtol=1e-4):
                        raise RuntimeError("lm_head(last hidden state) does not reproduce the model's logits "
                                           "(logit soft-capping or scaling?); the gate's reference cache needs it")
                    checked = True
                hidden[i] = h.numpy().astype(np.float32)
                tg = torch.tensor(e.input_ids[1:] + [0], dtype=torch.long)
                a, p = e.answer_positions, e.prompt_positions
                ref_answer_nll[i] = F.cross_entropy(logits[a], tg[a], reduction="none").double().numpy()
                if floor_model is not None:
                    fp = forward_with_prefix(floor_model, e)
                    ma = token_metrics(logits[a], fp.logits[a], tg[a])
                    mp = token_metrics(logits[p], fp.logits[p])
                    fl["answer"][i] = {"kl": ma.kl, "top1": ma.top1, "nll": ma.cand_nll}
                    fl["prompt"][i] = {"kl": mp.kl, "top1": mp.top1}
                    fp.logits = fp.hidden = None  # type: ignore[assignment]
                    floor_passes.append(fp)
                rp.logits = rp.hidden = None  # type: ignore[assignment]
                ref_passes.append(rp)
                del logits, h
                ph.advance(len(e.input_ids) * (2 if floor_model is not None else 1))
            seconds["teacher_forced"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            if greedy_new > 0:
                for i, g in zip(idx, decode_greedy(ref, ref_passes, greedy_new, stop_id, ph.advance)):
                    ref_greedy[i] = g
                if floor_model is not None:
                    for i, g in zip(idx, decode_greedy(floor_model, floor_passes, greedy_new, stop_id, ph.advance)):
                        fl["greedy"][i] = g
            del ref_passes, floor_passes
            seconds["greedy"] += time.perf_counter() - t0
        ph.finish()
        t0 = time.perf_counter()
        ph = prog.phase(what + ", held-out perplexity", total=len(windows) * (2 if floor_c is not None else 1),
                        unit="windows")
        ref_heldout = _heldout_nll(ref_c.logits, windows, ph.advance)
        if floor_c is not None:
            fl["heldout_nll"] = _heldout_nll(floor_c.logits, windows, ph.advance)
        ph.finish()
        seconds["heldout"] = time.perf_counter() - t0
    del ref, floor_model
    return ReferenceData([h for h in hidden if h is not None], ref_greedy, ref_heldout,
                         [x for x in ref_answer_nll if x is not None], fl if with_floor else None, seconds)


def _save_reference(d: ReferenceData, path: Path, meta: dict) -> None:
    lens = np.array([h.shape[0] for h in d.hidden], dtype=np.int64)
    np.save(path / "hidden.npy", np.concatenate(d.hidden) if d.hidden else np.zeros((0, 1), np.float32))
    arrays: dict[str, np.ndarray] = {
        "hidden_lens": lens, "ref_heldout_nll": d.ref_heldout_nll,
        "ref_answer_nll": np.concatenate(d.ref_answer_nll) if d.ref_answer_nll else np.zeros(0),
        "answer_lens": np.array([a.size for a in d.ref_answer_nll], dtype=np.int64),
    }
    if d.floor is not None:
        for seg in ("answer", "prompt"):
            for k in d.floor[seg][0] if d.floor[seg] else ():
                arrays[f"floor_{seg}_{k}"] = np.concatenate([r[k] for r in d.floor[seg]])
            arrays[f"floor_{seg}_lens"] = np.array([r["kl"].size for r in d.floor[seg]], dtype=np.int64)
        arrays["floor_heldout_nll"] = d.floor["heldout_nll"]
    np.savez(path / "arrays.npz", **arrays)
    atomic_write_json(path / "greedy.json", {"reference": d.ref_greedy,
                                            "floor": d.floor["greedy"] if d.floor is not None else None})
    atomic_write_json(path / "meta.json", {**meta, "seconds": d.seconds})


def _split(flat: np.ndarray, lens: np.ndarray) -> list[np.ndarray]:
    return [a for a in np.split(flat, np.cumsum(lens)[:-1])] if lens.size else []


def _load_reference(path: Path) -> ReferenceData:
    z = np.load(path / "arrays.npz")
    hidden_flat = np.load(path / "hidden.npy")
    hidden = _split(hidden_flat, z["hidden_lens"])
    alen = z["answer_lens"]
    greedy = read_json(path / "greedy.json")
    meta = read_json(path / "meta.json", {})
    floor = None
    if "floor_answer_kl" in z.files:
        floor = {"greedy": greedy.get("floor"), "heldout_nll": z["floor_heldout_nll"]}
        for seg, keys in (("answer", ("kl", "top1", "nll")), ("prompt", ("kl", "top1"))):
            lens = z[f"floor_{seg}_lens"]
            cols = {k: _split(z[f"floor_{seg}_{k}"], lens) for k in keys}
            floor[seg] = [{k: cols[k][i] for k in keys} for i in range(len(lens))]
    return ReferenceData(hidden, greedy["reference"], z["ref_heldout_nll"], _split(z["ref_answer_nll"], alen), floor,
                         meta.get("seconds", {}), cache_hit=True)


def reference_key(model_dir: Path, encoded: list[EncodedPrompt], windows: list[list[int]], stop_id: int,
                  options: GateOptions) -> str:
    """The reference cache key (sha256 hex): ``options.reference_key_fields()``, the model folder's
    fingerprint, the golden token ids, the held-out token ids, the stop id and the torch/transformers versions."""
    import transformers

    return hash_obj({
        "v": CACHE_VERSION, "options": options.reference_key_fields(), "model": model_fingerprint(model_dir),
        "golden": golden_hash(encoded), "heldout": hashlib.sha256(json.dumps(windows).encode()).hexdigest(),
        "stop_id": stop_id, "torch": torch.__version__, "transformers": transformers.__version__,
    })


def reference_data(model_dir: Path, encoded: list[EncodedPrompt], windows: list[list[int]], stop_id: int,
                   options: GateOptions, runtime: GateRuntime = GateRuntime(),
                   prog: Optional[StageProgress] = None) -> ReferenceData:
    """Reference and floor results for these tokens: from the cache (``runtime.reference_cache``), or
    computed (and cached unless ``runtime.use_reference_cache`` is False). Keyed by ``reference_key``.
    ``prog``: where the phases report (default: a ``StageProgress("gate")`` per ``runtime.progress``)."""
    if prog is None:
        with StageProgress("gate", enabled=runtime.progress) as own:
            return reference_data(model_dir, encoded, windows, stop_id, options, runtime, own)
    key = reference_key(model_dir, encoded, windows, stop_id, options)
    progress = prog
    if not runtime.use_reference_cache:
        d = _compute_reference(model_dir, encoded, windows, stop_id, options, progress)
        d.key = key
        return d
    cache_root = runtime.reference_cache
    if cache_root is None:
        from precision_pipeline.spec.default_model import cache_dir

        cache_root = cache_dir() / "gate-ref"
    target = Path(cache_root) / key[:32]
    with locked(Path(cache_root) / f"{key[:32]}.lock"):
        if (target / "meta.json").is_file():
            try:
                d = _load_reference(target)
                d.key = key
                return d
            except Exception:  # a damaged cache entry is recomputed
                pass
        d = _compute_reference(model_dir, encoded, windows, stop_id, options, progress)
        with atomic_dir(target) as tmp:
            _save_reference(d, tmp, {"key": key, "model_dir": str(model_dir), "prompts": len(encoded),
                                     "created": time.time()})
    d.key = key
    return d


# ==============================================================================================
# The gate


@dataclass
class GateResult:
    """Outcome of ``run_gate``: verdict, failing metrics and everything written to metrics.json."""

    passed: bool
    failures: list[str]
    metrics: dict[str, Any]
    out_dir: Path
    per_token: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def metrics_path(self) -> Path:
        return self.out_dir / "metrics.json"

    @property
    def report_md(self) -> Path:
        return self.out_dir / "report.md"

    @property
    def report_html(self) -> Path:
        return self.out_dir / "report.html"

    def failed_metrics(self) -> list[str]:
        """Failing overall metrics and failing categories (``category C: metric``)."""
        return verdict_failures(self.metrics)

    def summary(self) -> dict[str, Any]:
        """Headline numbers (for the build summary)."""
        m = self.metrics["metrics"]
        out = {k: m[k]["value"] for k in METRIC_ORDER if k in m} | {
            "passed": self.passed, "eval_tokens": self.metrics["tokens"]["answer_tokens"]}
        if self.metrics.get("scales") is not None:  # checkpoint gates: tensors flagged by checkpoint/scales.py
            out["scale_outliers"] = len({o["tensor"] for o in self.metrics["scales"]["outliers"]})
        return out

    def raise_if_failed(self) -> None:
        if not self.passed:
            detail = verdict_reasons(self.metrics)
            raise GateFailed(f"accuracy gate failed: {detail}. See {self.report_md}")


def _check(value: Optional[float], threshold: Optional[float], op: str) -> tuple[Optional[bool], str]:
    if threshold is None:
        return None, "not checked"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False, "not measured but a threshold is set"
    ok = value <= threshold if op == "<=" else value >= threshold
    return ok, f"{value:.4g} {'meets' if ok else 'misses'} {op} {threshold:.4g}"


# metrics judged per category: everything but the held-out perplexity (the news text has no categories)
CATEGORY_METRICS = ("kl_mean", "kl_p99", "top1", "greedy_same")


def as_bar(thresholds: GateThresholds) -> GateBar:
    """``thresholds`` as a ``GateBar`` (a plain ``GateThresholds``: no category bars, ``min_prompts`` None)."""
    if isinstance(thresholds, GateBar):
        return thresholds
    return GateBar(**thresholds.model_dump(exclude_unset=True))


def _category_check(value: Optional[float], ci: Optional[Sequence[float]], threshold: Optional[float],
                    op: str, prompts: int = 2) -> tuple[Optional[bool], str]:
    """(ok, how): a category misses its bar when its whole 95% interval lies past it (lower end above
    a max, upper end below a min); with no resamples (``bootstrap_resamples`` 0) its point estimate.
    A category of one prompt (``--golden-limit 1``) has no interval and is not judged (ok None): one
    prompt's numbers are noise (the FP8 test checkpoint's single facts prompt has top-1 0.843 where the
    whole set has 0.894), and such a verdict is not promotable anyway."""
    if threshold is None:
        return None, "not checked"
    if prompts < 2:
        return None, "not judged"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False, "not measured"
    if ci and len(ci) == 2 and not any(c is None or math.isnan(c) for c in ci):
        edge = ci[0] if op == "<=" else ci[1]
        return (edge <= threshold if op == "<=" else edge >= threshold), "interval"
    return (value <= threshold if op == "<=" else value >= threshold), "point estimate"


def golden_set_size(golden_path: Optional[Path] = None) -> int:
    """Prompts in the whole golden set (``golden_path``; None: the shipped file)."""
    return len(load_golden(golden_path))


def judge_metrics(m: dict, thresholds: GateThresholds) -> dict:
    """Judge stored gate measurements (a metrics.json mapping) against ``thresholds`` (a ``GateBar``).

    The one verdict rule, used when the gate runs and again when ``invoke promote``/``rollout``
    re-judge a build's stored numbers against the profile's current bar:

    * overall: each checked metric's point estimate against its threshold (``CHECKS``); a checked
      metric that was not measured fails;
    * per category (``per_category``): ``CATEGORY_METRICS`` against ``bar.for_category(c)``; a
      category misses when its whole 95% interval lies past the bar (``_category_check``; a
      category of one prompt is not judged: no interval);
    * promotable: the verdict covers at least ``bar.min_prompts`` prompts (None: the whole golden
      set, ``golden.set_prompts``); fewer (``--golden-limit``) is recorded as not promotable.

    Returns the keys it decides: ``passed``, ``failures`` (overall metric names), ``category_failures``
    (rows with category, metric, value, ci95, threshold, op, reason), ``metrics`` (the overall rows
    with passed/threshold/reason set), ``categories_judged``, ``judged_against`` (the bar),
    ``promotable`` and ``not_promotable`` (the reason, "" when promotable).
    """
    bar = as_bar(thresholds)
    rows = {k: dict(v) for k, v in (m.get("metrics") or {}).items()}
    failures: list[str] = []
    for name in METRIC_ORDER:
        if name not in rows:
            continue
        thr_field, op = CHECKS.get(name, (None, None))
        thr = getattr(bar, thr_field) if thr_field else None
        v = rows[name].get("value")
        ok, _ = _check(v, thr, op) if thr_field else (None, "")
        rows[name].update({"threshold": thr, "op": op, "threshold_field": thr_field, "passed": ok,
                           "reason": _fmt_reason(name, v, thr, op or "", ok)})
        if ok is False:
            failures.append(name)
    cat_fail: list[dict] = []
    judged: dict[str, dict] = {}
    for cat, r in (m.get("per_category") or {}).items():
        cbar = bar.for_category(cat)
        checks: dict[str, dict] = {}
        for name in CATEGORY_METRICS:
            thr_field, op = CHECKS[name]
            thr = getattr(cbar, thr_field)
            if thr is None:
                continue
            v, ci = r.get(name), (r.get("ci95") or {}).get(name)
            ok, how = _category_check(v, ci, thr, op, int(r.get("prompts") or 0))
            if how == "not judged":
                reason = f"category {cat}: {name} not judged (one prompt gives no interval)"
            else:
                shown = "not measured" if how == "not measured" else (
                    f"{v:.4g}" + (f" [{ci[0]:.4g}, {ci[1]:.4g}]" if how == "interval" else ""))
                reason = (f"category {cat}: {name} = {shown} "
                          f"{'meets' if ok else 'misses'} {op} {thr:.4g}" + (" (whole interval past the bar)"
                                                                            if not ok and how == "interval" else ""))
            checks[name] = {"value": v, "ci95": ci, "threshold": thr, "op": op, "passed": ok, "judged_by": how,
                            "reason": reason}
            if ok is False:
                cat_fail.append({"category": cat, "metric": name, **checks[name]})
        judged[cat] = {"passed": None if checks and all(c["passed"] is None for c in checks.values()) else
                       all(c["passed"] is not False for c in checks.values()), "checks": checks,
                       "bar": cbar.model_dump(mode="json", exclude_none=True)}
    prompts = int((m.get("tokens") or {}).get("prompts") or 0)
    golden = m.get("golden") or {}
    need = bar.min_prompts
    if need is None:
        need = int(golden.get("set_prompts") or golden_set_size())
        what = f"the whole golden set ({need} prompts)"
    else:
        what = f"gate.min_prompts {need}"
    promotable = prompts >= need
    why = "" if promotable else (
        f"the verdict covers {prompts} golden prompt(s), fewer than {what}"
        + (f" (--golden-limit {golden['prompts_per_category']})" if golden.get("prompts_per_category") else "")
        + ": it is a quick check, not a release verdict")
    return {"passed": not failures and not cat_fail, "failures": failures, "category_failures": cat_fail,
            "metrics": rows, "categories_judged": judged, "judged_against": bar.model_dump(mode="json"),
            "promotable": promotable, "not_promotable": why}


def verdict_failures(m: dict) -> list[str]:
    """The failing checks of a judged mapping, named: overall metric names and ``category C: metric``."""
    return list(m.get("failures") or []) + [f"category {f['category']}: {f['metric']}" for f in m.get("category_failures") or []]


def verdict_reasons(m: dict) -> str:
    """Every failing check's reason, '; '-joined (overall first, then categories)."""
    rows = m.get("metrics") or {}
    return "; ".join([rows[f]["reason"] for f in m.get("failures") or [] if f in rows]
                     + [f["reason"] for f in m.get("category_failures") or []])


def _fmt_reason(name: str, value: Optional[float], threshold: Optional[float], op: str, ok: Optional[bool]) -> str:
    if ok is None:
        return f"{name}: not checked"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{name}: not measured (threshold {op} {threshold})"
    return f"{name} = {value:.4g} ({'within' if ok else 'outside'} {op} {threshold:.4g})"


def rejudge(metrics: dict[str, Any], thresholds: GateThresholds) -> dict[str, Any]:
    """``metrics`` (a gate's metrics.json content) judged against ``thresholds`` instead of the ones it was
    measured with, by the one verdict rule (``judge_metrics``: overall rows, categories, promotable), plus each
    row's ``floor_exceeds_threshold`` and the top-level ``thresholds``. The measured values, intervals and the
    rest are kept. Returns a new dict."""
    import copy

    out = copy.deepcopy(metrics)
    out.update(judge_metrics(out, thresholds))
    for m in out.get("metrics", {}).values():
        thr, op, fv = m.get("threshold"), m.get("op"), m.get("noise_floor")
        m["floor_exceeds_threshold"] = None if thr is None or fv is None else ((fv > thr) if op == "<=" else (fv < thr))
    out["thresholds"] = thresholds.model_dump(mode="json")
    return out


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def run_gate(candidate: Any, reference_model_dir: Path, thresholds: GateThresholds, out_dir: Path,
             options: GateOptions = GateOptions(), runtime: GateRuntime = GateRuntime(), *,
             candidate_name: str = "", model_name: Optional[str] = None, extra: Optional[dict] = None) -> GateResult:
    """Score ``candidate`` against the FP32 reference in ``reference_model_dir`` (see module doc).

    ``options``: what is measured (prompts per category, held-out tokens, greedy length, bootstrap,
    ...; every field can change a number). ``runtime``: threads, progress, reference cache, reports
    (never changes a number). ``candidate_name`` / ``model_name`` label metrics.json; ``extra`` is
    merged into it. ``out_dir``: the gate's folder; metrics.json, report.md, report.html and
    per_token.npz are written into it atomically (the folder is replaced as a whole).
    Returns a ``GateResult``; it does not raise on failure (call ``raise_if_failed()``). Raises
    ``UserError`` when ``reference_model_dir`` is not an HF folder or the candidate gives no logits.
    """
    t_start = time.perf_counter()
    reference_model_dir = Path(reference_model_dir)
    if not (reference_model_dir / "config.json").is_file():
        raise UserError("reference model", f"{reference_model_dir} is not an HF model folder (no config.json).",
                        "pass the unquantized HF folder the checkpoint was made from.")
    cand = as_candidate(candidate, candidate_name)
    model_name = model_name or reference_model_dir.name
    timings: dict[str, float] = {}
    choice = None if runtime.threads else thread_choice()
    with torch_threads(runtime.threads or choice.threads), StageProgress("gate", enabled=runtime.progress) as prog:
        used_threads = torch.get_num_threads()
        prog.say(choice.reason if choice is not None else f"{used_threads} torch threads (set by the caller)")
        prog.say(f"candidate {cand.name} against the {reference_label(options)} reference {reference_model_dir}")
        t0 = time.perf_counter()
        tok = _load_tokenizer(reference_model_dir)
        prompts = load_golden(options.golden_path, per_category=options.prompts_per_category)
        encoded = encode_golden(tok, prompts)
        stop_id = end_of_turn_id(tok)
        windows = heldout_windows(tok, options.heldout_tokens, options.heldout_window)
        timings["prepare"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        ref = reference_data(reference_model_dir, encoded, windows, stop_id, options, runtime, prog)
        timings["reference"] = time.perf_counter() - t0
        if ref.cache_hit:
            prog.say(f"reference {reference_label(options)}{' + BF16 floor' if ref.floor is not None else ''} from the cache "
                     f"(key {ref.key[:12]}; computed once in {sum(ref.seconds.values()):.0f} s)")

        # FP32 lm_head for recomputing reference logits from the cached hidden states
        t0 = time.perf_counter()
        lm_w = _lm_head_weight(reference_model_dir)
        timings["lm_head"] = time.perf_counter() - t0

        per_prompt: list[Any] = [None] * len(encoded)
        cand_greedy: list[list[int]] = []
        greedy_new = options.greedy_new_tokens
        model = _hf_model(cand)

        def score(i: int, cl: torch.Tensor) -> None:
            e = encoded[i]
            if cl.shape[0] != len(e.input_ids):
                raise UserError("candidate", f"returned {cl.shape[0]} logit rows for {len(e.input_ids)} tokens.",
                                "return one row of logits per input token.")
            ref_logits = F.linear(torch.from_numpy(ref.hidden[i]), lm_w)
            tg = torch.tensor(e.input_ids[1:] + [0], dtype=torch.long)
            a, p = e.answer_positions, e.prompt_positions
            per_prompt[i] = (token_metrics(ref_logits[a], cl[a], tg[a]), token_metrics(ref_logits[p], cl[p]))

        with torch.inference_mode():
            if model is not None:
                # HF model: one forward per prompt gives its teacher-forced logits and the KV cache its
                # greedy answer continues from (batches of prompts of similar length)
                tf_s = greedy_s = 0.0
                cand_greedy = [[] for _ in encoded] if greedy_new > 0 else []
                ph = prog.phase("candidate, teacher-forced"
                                + (f" + greedy ({greedy_new} tokens)" if greedy_new > 0 else ""),
                                total=greedy_units(encoded, greedy_new), unit="tokens")
                for idx in _batches_by_length(encoded, options.greedy_batch):
                    t0 = time.perf_counter()
                    passes = []
                    for i in idx:
                        pp = forward_with_prefix(model, encoded[i])
                        score(i, pp.logits)
                        pp.logits = None  # type: ignore[assignment]
                        passes.append(pp)
                        ph.advance(len(encoded[i].input_ids))
                    tf_s += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    if greedy_new > 0:
                        for i, g in zip(idx, decode_greedy(model, passes, greedy_new, stop_id, ph.advance)):
                            cand_greedy[i] = g
                    del passes
                    greedy_s += time.perf_counter() - t0
                ph.finish()
                timings["candidate_teacher_forced"] = tf_s
                timings["candidate_greedy"] = greedy_s
            else:
                t0 = time.perf_counter()
                ph = prog.phase("candidate, teacher-forced", total=len(encoded), unit="prompts")
                for i, e in enumerate(encoded):
                    score(i, cand.logits(e.input_ids))
                    ph.advance()
                ph.finish()
                timings["candidate_teacher_forced"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                if greedy_new > 0:
                    ph = prog.phase(f"candidate, greedy ({greedy_new} tokens)", total=len(encoded),
                                    unit="prompts")
                    cand_greedy = greedy_all(cand, encoded, greedy_new, stop_id, options.greedy_batch, ph.advance)
                    ph.finish()
                timings["candidate_greedy"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            ph = prog.phase("candidate, held-out perplexity", total=len(windows), unit="windows")
            cand_heldout = _heldout_nll(cand.logits, windows, ph.advance)
            ph.finish()
            timings["candidate_heldout"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        ph = prog.phase("metrics, bootstrap intervals" + (" and reports" if runtime.write_report else ""))
        metrics, per_token = _assemble(
            encoded=encoded, tok=tok, per_prompt=per_prompt, ref=ref, cand_greedy=cand_greedy,
            cand_heldout=cand_heldout, thresholds=thresholds, bootstrap=options.bootstrap_resamples,
            seed=options.seed, greedy_new_tokens=options.greedy_new_tokens, heldout_window=options.heldout_window,
            windows=windows, golden={"set_prompts": golden_set_size(options.golden_path),
                                     "prompts_per_category": options.prompts_per_category})
        timings["metrics"] = time.perf_counter() - t0
        metrics.update({
            "schema": 1, "model": model_name, "candidate": cand.name,
            "reference_model_dir": str(reference_model_dir),
            "reference_cache": {"hit": ref.cache_hit, "key": ref.key, "seconds_when_computed": ref.seconds},
            "reference": {"dtype": options.reference_dtype, "device": options.device,
                          "candidate_dtype": options.candidate_dtype,
                          "noise_floor": ("BF16 copy of the FP32 reference" if ref.floor is not None else
                                          "not measured: a BF16 reference has no BF16-vs-FP32 floor"
                                          if options.reference_dtype != "float32" else "not measured (noise_floor off)")},
            "torch_threads": used_threads,
        })
        if extra:
            metrics.update(extra)
        result = GateResult(metrics["passed"], metrics["failures"], metrics, Path(out_dir), per_token)
        timings["total_before_report"] = time.perf_counter() - t_start
        metrics["timings_s"] = {k: round(v, 3) for k, v in timings.items()}
        write_gate_dir(result, heatmap_png=runtime.heatmap_png, write_report=runtime.write_report)
        ph.finish()
    metrics["timings_s"]["total"] = round(time.perf_counter() - t_start, 3)
    atomic_write_json(result.metrics_path, metrics)
    os.chmod(result.metrics_path, 0o644)
    return result


def cached_reference(key: str, cache_root: Optional[Path] = None) -> Optional[ReferenceData]:
    """The stored reference of a gate run (``key``: its metrics.json ``reference_cache.key``) from the
    reference cache (default ``spec.default_model.cache_dir()/gate-ref``), or None when it is not there.
    ``hidden[i]`` belongs to the gate's i-th prompt (metrics.json ``prompts[i]``); logits are
    ``lm_head_weight(model_dir) @ h``."""
    if cache_root is None:
        from precision_pipeline.spec.default_model import cache_dir

        cache_root = cache_dir() / "gate-ref"
    target = Path(cache_root) / key[:32]
    if not (target / "meta.json").is_file():
        return None
    d = _load_reference(target)
    d.key = key
    return d


def lm_head_weight(model_dir: Path) -> torch.Tensor:
    """The FP32 lm_head weight ``[vocab, hidden]`` of an HF folder (what the gate's cached hidden
    states are multiplied by)."""
    return _lm_head_weight(model_dir)


def _lm_head_weight(model_dir: Path) -> torch.Tensor:
    """The FP32 lm_head weight ``[vocab, hidden]`` of the HF folder.

    Read from its safetensors (``lm_head.weight``, or ``model.embed_tokens.weight`` when the
    config ties them), cast to float32 as ``from_pretrained(dtype=float32)`` does; other layouts
    load the model once and keep only that tensor.
    """
    model_dir = Path(model_dir)
    cfg = read_json(model_dir / "config.json", {}) or {}
    name = "model.embed_tokens.weight" if cfg.get("tie_word_embeddings") else "lm_head.weight"
    index = read_json(model_dir / "model.safetensors.index.json", None)
    shard = (index or {}).get("weight_map", {}).get(name) if index else "model.safetensors"
    fam = family_of_model_type(str(cfg.get("model_type")))
    if shard and (model_dir / shard).is_file() and fam is not None and fam.gate_reader is not None:
        from safetensors import safe_open

        with safe_open(str(model_dir / shard), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name).to(torch.float32).contiguous()
    m = load_hf_model(model_dir, torch.float32)
    head = m.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise RuntimeError("lm_head with a bias is not supported by the gate's reference cache")
    w = head.weight.detach().clone()
    del m
    return w


def _nanmean(xs: Sequence[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return float(np.mean(xs)) if xs else None


def _assemble(*, encoded, tok, per_prompt, ref: ReferenceData, cand_greedy, cand_heldout, thresholds: GateBar,
              bootstrap: int, seed: int, greedy_new_tokens: int, heldout_window: int, windows,
              golden: Optional[dict] = None) -> tuple[dict, dict]:
    kl_groups = [ma.kl for ma, _ in per_prompt]
    top1_groups = [ma.top1.astype(np.float64) for ma, _ in per_prompt]
    kl_all = np.concatenate(kl_groups) if kl_groups else np.zeros(0)
    top1_all = np.concatenate(top1_groups) if top1_groups else np.zeros(0)
    values: dict[str, Optional[float]] = kl_summary(kl_all)
    values["top1"] = float(top1_all.mean()) if top1_all.size else float("nan")
    cis = _ci_for_all(kl_groups, top1_groups, bootstrap, seed)

    fl = ref.floor
    floor_vals: dict[str, Optional[float]] = {k: None for k in METRIC_ORDER}
    floor_cis: dict[str, list[float]] = {}
    if fl is not None:
        fkl_groups = [r["kl"] for r in fl["answer"]]
        ftop_groups = [r["top1"].astype(np.float64) for r in fl["answer"]]
        fkl = np.concatenate(fkl_groups) if fkl_groups else np.zeros(0)
        floor_vals.update(kl_summary(fkl))
        floor_vals["top1"] = float(np.concatenate(ftop_groups).mean()) if ftop_groups else None
        floor_cis = _ci_for_all(fkl_groups, ftop_groups, bootstrap, seed)

    # held-out perplexity
    ppl_ref = perplexity(ref.ref_heldout_nll) if windows else None
    ppl_cand = perplexity(cand_heldout) if windows else None
    values["ppl_delta_pct"] = (ppl_cand / ppl_ref - 1.0) * 100.0 if windows else None
    if fl is not None and windows:
        ppl_floor = perplexity(fl["heldout_nll"])
        floor_vals["ppl_delta_pct"] = (ppl_floor / ppl_ref - 1.0) * 100.0
    else:
        ppl_floor = None

    # greedy
    greedy_rows = []
    if greedy_new_tokens > 0:
        same = []
        for i, e in enumerate(encoded):
            r, c = ref.ref_greedy[i], cand_greedy[i]
            d = compare_generations(r, c)
            same.append(d is None)
            row = {"id": e.id, "category": e.category, "same": d is None, "first_divergence": d,
                   "reference_tokens": len(r), "candidate_tokens": len(c),
                   "reference_text": tok.decode(r, skip_special_tokens=False),
                   "candidate_text": tok.decode(c, skip_special_tokens=False)}
            if fl is not None and fl.get("greedy"):
                fd = compare_generations(r, fl["greedy"][i])
                row["floor_same"] = fd is None
                row["floor_first_divergence"] = fd
            greedy_rows.append(row)
        values["greedy_same"] = float(np.mean(same)) if same else float("nan")
        cis["greedy_same"] = list(bootstrap_ci([np.array([float(s)]) for s in same], np.mean, bootstrap, seed))
        if fl is not None and fl.get("greedy"):
            fsame = [row["floor_same"] for row in greedy_rows]
            floor_vals["greedy_same"] = float(np.mean(fsame))
            floor_cis["greedy_same"] = list(bootstrap_ci([np.array([float(s)]) for s in fsame], np.mean, bootstrap, seed))
    else:
        values["greedy_same"] = None

    # the overall rows (judged below, with the categories, by judge_metrics)
    metrics: dict[str, dict[str, Any]] = {}
    for name in METRIC_ORDER:
        thr_field, op = CHECKS.get(name, (None, None))
        thr = getattr(thresholds, thr_field) if thr_field else None
        fv = floor_vals.get(name)
        floor_blocks = None
        if thr is not None and fv is not None:
            floor_blocks = (fv > thr) if op == "<=" else (fv < thr)
        metrics[name] = {
            "label": METRIC_LABELS[name], "value": values.get(name), "ci95": cis.get(name), "noise_floor": fv,
            "noise_floor_ci95": floor_cis.get(name), "threshold": thr, "op": op, "threshold_field": thr_field,
            "passed": None, "floor_exceeds_threshold": floor_blocks, "reason": "",
        }

    # per category
    cats: dict[str, dict[str, Any]] = {}
    for i, e in enumerate(encoded):
        cats.setdefault(e.category, {"idx": []})["idx"].append(i)
    per_category = {}
    for c, d in cats.items():
        idx = d["idx"]
        kl_c = np.concatenate([kl_groups[i] for i in idx])
        t_c = np.concatenate([top1_groups[i] for i in idx])
        row = {"prompts": len(idx), "tokens": int(kl_c.size), **kl_summary(kl_c), "top1": float(t_c.mean())}
        # 95% intervals per category: the same bootstrap over the category's own prompts (none for one prompt)
        row["ci95"] = _ci_for_all([kl_groups[i] for i in idx], [top1_groups[i] for i in idx], bootstrap, seed) \
            if len(idx) > 1 else {}
        if greedy_rows:
            row["greedy_same"] = float(np.mean([greedy_rows[i]["same"] for i in idx]))
            if len(idx) > 1 and bootstrap > 0:
                row["ci95"]["greedy_same"] = list(bootstrap_ci([np.array([float(greedy_rows[i]["same"])]) for i in idx],
                                                               np.mean, bootstrap, seed))
        if fl is not None:
            fk = np.concatenate([fl["answer"][i]["kl"] for i in idx])
            ft = np.concatenate([fl["answer"][i]["top1"] for i in idx]).astype(np.float64)
            row["floor_kl_mean"] = float(fk.mean())
            row["floor_kl_p99"] = float(np.percentile(fk, 99))
            row["floor_top1"] = float(ft.mean())
            if greedy_rows and "floor_same" in greedy_rows[0]:
                row["floor_greedy_same"] = float(np.mean([greedy_rows[i]["floor_same"] for i in idx]))
        per_category[c] = row

    # prompt segment (informational)
    pkl = np.concatenate([mp.kl for _, mp in per_prompt]) if per_prompt else np.zeros(0)
    ptop = np.concatenate([mp.top1 for _, mp in per_prompt]) if per_prompt else np.zeros(0)
    prompt_segment = {"tokens": int(pkl.size), **kl_summary(pkl), "top1": float(ptop.mean()) if ptop.size else None}
    if fl is not None and fl["prompt"]:
        fpk = np.concatenate([r["kl"] for r in fl["prompt"]])
        prompt_segment["floor_kl_mean"] = float(fpk.mean()) if fpk.size else None
        prompt_segment["floor_top1"] = float(np.concatenate([r["top1"] for r in fl["prompt"]]).mean()) if fpk.size else None

    # answer NLL (teacher-forced perplexity of the golden answers)
    ref_ans = np.concatenate(ref.ref_answer_nll) if ref.ref_answer_nll else np.zeros(0)
    cand_ans = np.concatenate([ma.cand_nll for ma, _ in per_prompt]) if per_prompt else np.zeros(0)
    answer_ppl = {"reference": perplexity(ref_ans), "candidate": perplexity(cand_ans)}
    if fl is not None:
        answer_ppl["floor"] = perplexity(np.concatenate([r["nll"] for r in fl["answer"]]))

    # per-prompt table and worst prompts
    prompt_rows = []
    for i, e in enumerate(encoded):
        ma = per_prompt[i][0]
        row = {"id": e.id, "category": e.category, "tokens": int(ma.kl.size), "kl_mean": float(ma.kl.mean()),
               "kl_max": float(ma.kl.max()), "top1": float(ma.top1.mean())}
        if fl is not None:
            row["floor_kl_mean"] = float(fl["answer"][i]["kl"].mean())
        if greedy_rows:
            row["greedy_same"] = greedy_rows[i]["same"]
            row["first_divergence"] = greedy_rows[i]["first_divergence"]
        prompt_rows.append(row)
    worst = sorted(range(len(encoded)), key=lambda i: -prompt_rows[i]["kl_mean"])[:WORST_PROMPTS]
    worst_rows = []
    for i in worst:
        e = encoded[i]
        w = dict(prompt_rows[i])
        w["prompt"] = e.prompt
        if greedy_rows:
            w["reference_text"] = greedy_rows[i]["reference_text"]
            w["candidate_text"] = greedy_rows[i]["candidate_text"]
        worst_rows.append(w)

    summ = summarize(encoded)
    out = {
        "passed": None,
        "failures": [],
        "metrics": metrics,
        "thresholds": as_bar(thresholds).thresholds().model_dump(mode="json"),
        "tokens": {"prompts": summ.prompts, "answer_tokens": summ.answer_tokens, "prompt_tokens": summ.prompt_tokens,
                   "total_tokens": summ.total_tokens,
                   "heldout_tokens": int(sum(len(w) for w in windows)),
                   "heldout_predicted_tokens": int(sum(len(w) - 1 for w in windows)),
                   "heldout_windows": len(windows), "heldout_window": heldout_window,
                   "greedy_new_tokens": greedy_new_tokens},
        "perplexity": {"heldout_reference": ppl_ref, "heldout_candidate": ppl_cand, "heldout_floor": ppl_floor,
                       "golden_answers": answer_ppl},
        "per_category": per_category,
        "prompt_segment": prompt_segment,
        "prompts": prompt_rows,
        "greedy": greedy_rows,
        "worst_prompts": worst_rows,
        "noise_floor": {"measured": fl is not None, "how": "same HF folder loaded in torch.bfloat16 (weights and compute)"},
        "method": {
            "encoding": "tokenizer.apply_chat_template([user, assistant], tokenize=False) then tokenize with "
                        "add_special_tokens=False (template's default system message; no extra BOS)",
            "evaluated": "answer positions: targets are the assistant answer tokens and its closing end-of-turn token",
            "kl": "KL(P_ref || P_cand) per token, nats, FP32 log-softmax",
            "ci": f"percentile bootstrap over prompts, {bootstrap} resamples, seed {seed}",
            "heldout": "held-out news (gensim lee.cor), raw text without BOS, windows of "
                       f"{heldout_window} tokens",
            "greedy": f"greedy decoding from the generation prompt, {greedy_new_tokens} new tokens or up to end-of-turn "
                      "(HF models: batches of prompts of similar length, left-padded and masked)",
            "pass_rule": "overall: point estimate vs threshold; per category: misses its bar when its whole 95% "
                         "interval lies past the bar (the point estimate when it has no interval); None = not "
                         "checked; a checked metric not measured fails",
        },
    }
    out["golden"] = {"prompts": summ.prompts, **(golden or {})}
    out.update(judge_metrics(out, thresholds))
    per_token = {"kl": kl_all, "top1": top1_all}
    if fl is not None:
        per_token["floor_kl"] = np.concatenate([r["kl"] for r in fl["answer"]]) if fl["answer"] else np.zeros(0)
    per_token["prompt_index"] = np.concatenate([np.full(g.size, i, dtype=np.int32) for i, g in enumerate(kl_groups)]) \
        if kl_groups else np.zeros(0, np.int32)
    return out, per_token


def write_gate_dir(result: GateResult, heatmap_png: Optional[Path] = None, write_report: bool = True) -> None:
    """Write metrics.json, per_token.npz and the reports into ``result.out_dir`` (atomic swap)."""
    out_dir = result.out_dir
    if heatmap_png is None:
        for cand in (out_dir / "sensitivity_heatmap.png", out_dir.parent / "sensitivity" / "heatmap.png"):
            if cand.is_file():
                heatmap_png = cand
                break
    heatmap_bytes = Path(heatmap_png).read_bytes() if heatmap_png and Path(heatmap_png).is_file() else None
    with atomic_dir(out_dir) as tmp:
        atomic_write_json(tmp / "metrics.json", result.metrics)
        np.savez_compressed(tmp / "per_token.npz", **result.per_token)
        if heatmap_bytes is not None:
            (tmp / "sensitivity_heatmap.png").write_bytes(heatmap_bytes)
        if write_report:
            from precision_pipeline.gate.report import write_report as _write

            _write(result.metrics, tmp, per_token=result.per_token,
                   heatmap_png=(tmp / "sensitivity_heatmap.png") if heatmap_bytes is not None else None)
        os.chmod(tmp, 0o755)  # mkdtemp/mkstemp create 0700/0600; reports are meant to be read
        for f in tmp.iterdir():
            os.chmod(f, 0o644)


def gate_checkpoint(ckpt_dir: Path, model_dir: Path, thresholds: GateThresholds, gate_dir: Path,
                    options: Optional[GateOptions] = None, runtime: GateRuntime = GateRuntime(), *,
                    golden_limit: Optional[int] = None, candidate_name: Optional[str] = None,
                    extra: Optional[dict] = None) -> GateResult:
    """The pipeline's gate stage: dequantize the exported TRT-LLM checkpoint
    (``precision_pipeline.gate.model.load_checkpoint_model``) and ``run_gate`` it against ``model_dir``.

    ``golden_limit`` is shorthand for ``GateOptions(prompts_per_category=golden_limit)`` (the pipeline's
    ``--golden-limit``); passing both ``options`` and ``golden_limit`` is a ``ValueError``.
    ``candidate_name`` defaults to ``checkpoint <folder name>``; ``extra`` is merged into metrics.json
    (the gate stage's ``record``).
    """
    from precision_pipeline.gate.model import load_checkpoint_model
    from precision_pipeline.checkpoint.scales import scale_report
    from precision_pipeline.quantize.ptq import read_quantize_warnings

    if options is not None and golden_limit is not None:
        raise ValueError("pass golden_limit inside options (GateOptions.prompts_per_category), not both")
    if options is None:
        options = GateOptions(prompts_per_category=golden_limit)
    t0 = time.perf_counter()
    label = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}[options.candidate_dtype]
    where = " on CUDA" if options.device == "cuda" else ""
    with StageProgress("gate", enabled=runtime.progress) as prog, prog.phase(f"load the checkpoint (dequantized to {label}){where}"):
        model = load_checkpoint_model(Path(ckpt_dir), Path(model_dir), dtype=TORCH_DTYPES[options.candidate_dtype],
                                      device=options.device)
    load_s = time.perf_counter() - t0
    extra = {**(extra or {}), "checkpoint_dir": str(ckpt_dir), "checkpoint_load_s": round(load_s, 3),
             "scales": scale_report(Path(ckpt_dir)), "quantize_warnings": read_quantize_warnings(Path(ckpt_dir))}
    cfg = read_json(Path(ckpt_dir) / "config.json", {}) or {}
    if cfg.get("quantization"):
        extra["checkpoint_quantization"] = cfg["quantization"]
    return run_gate(model, Path(model_dir), thresholds, Path(gate_dir), options, runtime,
                    candidate_name=candidate_name or f"{Path(ckpt_dir).parent.name}/{Path(ckpt_dir).name}", extra=extra)


__all__ = [
    "Candidate", "HFCandidate", "CallableCandidate", "as_candidate", "TokenMetrics", "token_metrics", "kl_summary",
    "bootstrap_ci", "compare_generations", "greedy_all", "perplexity", "heldout_texts", "heldout_windows", "model_fingerprint",
    "ReferenceData", "reference_data", "reference_key", "torch_threads", "auto_threads", "GateOptions", "GateRuntime",
    "GateResult", "run_gate", "gate_checkpoint", "write_gate_dir", "rejudge", "CHECKS",
    "METRIC_ORDER", "METRIC_LABELS",
]
