"""The gate's reference: the FP32 model's results on the golden set and the held-out text (and the BF16
noise floor), computed once per model and cached.

Cache layout and key: ``gate.checkpoint_gate``'s module doc (Reference cache). ``reference_data`` loads
or computes and stores an entry; ``cached_reference`` only reads one (the serving probe);
``lm_head_weight`` is the FP32 head that turns the cached hidden states into logits.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from precision_pipeline.core.progress import StageProgress
from precision_pipeline.core.store import atomic_dir, atomic_write_json, hash_obj, locked, read_json
from precision_pipeline.gate.candidates import (TORCH_DTYPES, HFCandidate, batches_by_length, decode_greedy,
                                                forward_with_prefix, greedy_units, heldout_nll, load_hf_model)
from precision_pipeline.gate.golden import EncodedPrompt, golden_hash
from precision_pipeline.gate.metrics import token_metrics
from precision_pipeline.gate.options import DEFAULT_HELDOUT_WINDOW, GateOptions, GateRuntime
from precision_pipeline.spec.families import family_of_model_type

CACHE_VERSION = 3  # 2: the key hashes GateOptions.reference_key_fields(); 3: greedy decoded from the teacher-forced KV cache

# Held-out text


def heldout_texts() -> list[str]:
    """Held-out news articles: ``precision_pipeline.quantize.calibration.heldout_news_texts()`` (the one reader of the
    gensim wheel's ``lee.cor``; UserError when it is missing)."""
    from precision_pipeline.quantize.calibration import heldout_news_texts

    return list(heldout_news_texts())


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

def reference_label(options: GateOptions) -> str:
    """``FP32`` / ``BF16`` (+ `` on CUDA``): what the report and the log call the reference."""
    return ("FP32" if options.reference_dtype == "float32" else "BF16") + (" on CUDA" if options.device == "cuda" else "")

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
        for idx in batches_by_length(encoded, greedy_batch):
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
        ref_heldout = heldout_nll(ref_c.logits, windows, ph.advance)
        if floor_c is not None:
            fl["heldout_nll"] = heldout_nll(floor_c.logits, windows, ph.advance)
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


def reference_cache_dir(cache_root: Optional[Path] = None) -> Path:
    """Where the gate's references are stored (``_cache_root``): what a refusal names as the folder to copy into."""
    return _cache_root(cache_root)


def _cache_root(cache_root: Optional[Path]) -> Path:
    """The reference cache folder: ``cache_root``, or ``spec.default_model.cache_dir()/gate-ref``."""
    if cache_root is not None:
        return Path(cache_root)
    from precision_pipeline.spec.default_model import cache_dir

    return cache_dir() / "gate-ref"


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
    cache_root = _cache_root(runtime.reference_cache)
    target = cache_root / key[:32]
    with locked(cache_root / f"{key[:32]}.lock"):
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

def cached_reference(key: str, cache_root: Optional[Path] = None) -> Optional[ReferenceData]:
    """The stored reference of a gate run (``key``: its metrics.json ``reference_cache.key``) from the
    reference cache (default ``spec.default_model.cache_dir()/gate-ref``), or None when it is not there.
    ``hidden[i]`` belongs to the gate's i-th prompt (metrics.json ``prompts[i]``); logits are
    ``lm_head_weight(model_dir) @ h``."""
    target = _cache_root(cache_root) / key[:32]
    if not (target / "meta.json").is_file():
        return None
    d = _load_reference(target)
    d.key = key
    return d


def lm_head_weight(model_dir: Path) -> torch.Tensor:
    """The FP32 lm_head weight ``[vocab, hidden]`` of an HF folder (what the gate's cached hidden
    states are multiplied by).

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


__all__ = ["CACHE_VERSION", "heldout_texts", "heldout_windows", "model_fingerprint", "ReferenceData", "reference_label", "reference_cache_dir",
           "reference_key", "reference_data", "cached_reference", "lm_head_weight"]
