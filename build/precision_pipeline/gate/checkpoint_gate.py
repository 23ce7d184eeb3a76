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

Modules: ``gate.candidates`` (candidates, model loading, the teacher-forced + greedy passes),
``gate.threads`` (torch threads on a shared machine), ``gate.metrics`` (per-token metrics, summaries,
bootstrap), ``gate.reference`` (the FP32 reference and its cache, held-out text), ``gate.verdict``
(``judge_metrics``, ``rejudge``, ``GateResult``), ``gate.assemble`` (metrics.json's sections); this module
runs them (``run_gate``, ``gate_checkpoint``) and writes the gate's folder (``write_gate_dir``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.progress import StageProgress
from precision_pipeline.core.store import atomic_dir, atomic_write_json, read_json
from precision_pipeline.gate.assemble import Measured, Settings, assemble
from precision_pipeline.gate.candidates import (TORCH_DTYPES, Candidate, as_candidate, batches_by_length, decode_greedy,
                                                forward_with_prefix, greedy_all, greedy_units, heldout_nll, hf_model)
from precision_pipeline.gate.golden import EncodedPrompt, encode_golden, end_of_turn_id, load_golden
from precision_pipeline.gate.metrics import CHECKS, token_metrics
from precision_pipeline.gate.options import GateOptions, GateRuntime
from precision_pipeline.gate.reference import ReferenceData, heldout_windows, lm_head_weight, reference_data, reference_label
from precision_pipeline.gate.threads import thread_choice, torch_threads
from precision_pipeline.gate.verdict import GateResult, check_min_prompts, golden_set_size, judge_metrics, verdict_failures, verdict_reasons
from precision_pipeline.spec.profile import GateThresholds


def _load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@dataclass
class _Scoring:
    """One candidate scored against the reference on the prepared tokens (the state ``run_gate`` threads
    through its phases): per-prompt token metrics, greedy answers, held-out NLL, phase timings."""

    encoded: list[EncodedPrompt]
    windows: list[list[int]]
    stop_id: int
    ref: ReferenceData
    lm_w: torch.Tensor        # FP32 lm_head [vocab, hidden]: reference logits = lm_w @ cached hidden state
    options: GateOptions
    prog: StageProgress
    timings: dict[str, float]
    per_prompt: list[Any] = field(default_factory=list)
    cand_greedy: list[list[int]] = field(default_factory=list)

    def score(self, i: int, cl: torch.Tensor) -> None:
        """Token metrics of prompt ``i`` from the candidate's ``[T, V]`` logits ``cl``."""
        e = self.encoded[i]
        if cl.shape[0] != len(e.input_ids):
            raise UserError("candidate", f"returned {cl.shape[0]} logit rows for {len(e.input_ids)} tokens.",
                            "return one row of logits per input token.")
        ref_logits = F.linear(torch.from_numpy(self.ref.hidden[i]), self.lm_w)
        tg = torch.tensor(e.input_ids[1:] + [0], dtype=torch.long)
        a, p = e.answer_positions, e.prompt_positions
        self.per_prompt[i] = (token_metrics(ref_logits[a], cl[a], tg[a]), token_metrics(ref_logits[p], cl[p]))

    def hf_passes(self, model: torch.nn.Module) -> None:
        """HF model: one forward per prompt gives its teacher-forced logits and the KV cache its greedy
        answer continues from (batches of prompts of similar length)."""
        greedy_new, stop_id = self.options.greedy_new_tokens, self.stop_id
        tf_s = greedy_s = 0.0
        self.cand_greedy = [[] for _ in self.encoded] if greedy_new > 0 else []
        ph = self.prog.phase("candidate, teacher-forced" + (f" + greedy ({greedy_new} tokens)" if greedy_new > 0 else ""),
                             total=greedy_units(self.encoded, greedy_new), unit="tokens")
        for idx in batches_by_length(self.encoded, self.options.greedy_batch):
            t0 = time.perf_counter()
            passes = []
            for i in idx:
                pp = forward_with_prefix(model, self.encoded[i])
                self.score(i, pp.logits)
                pp.logits = None  # type: ignore[assignment]
                passes.append(pp)
                ph.advance(len(self.encoded[i].input_ids))
            tf_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            if greedy_new > 0:
                for i, g in zip(idx, decode_greedy(model, passes, greedy_new, stop_id, ph.advance)):
                    self.cand_greedy[i] = g
            del passes
            greedy_s += time.perf_counter() - t0
        ph.finish()
        self.timings["candidate_teacher_forced"] = tf_s
        self.timings["candidate_greedy"] = greedy_s

    def candidate_passes(self, cand: Candidate) -> None:
        """Any other candidate: its logits per prompt, then its greedy answers (``greedy_all``)."""
        greedy_new = self.options.greedy_new_tokens
        t0 = time.perf_counter()
        ph = self.prog.phase("candidate, teacher-forced", total=len(self.encoded), unit="prompts")
        for i, e in enumerate(self.encoded):
            self.score(i, cand.logits(e.input_ids))
            ph.advance()
        ph.finish()
        self.timings["candidate_teacher_forced"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if greedy_new > 0:
            ph = self.prog.phase(f"candidate, greedy ({greedy_new} tokens)", total=len(self.encoded), unit="prompts")
            self.cand_greedy = greedy_all(cand, self.encoded, greedy_new, self.stop_id, self.options.greedy_batch,
                                          ph.advance)
            ph.finish()
        self.timings["candidate_greedy"] = time.perf_counter() - t0

    def run(self, cand: Candidate) -> Measured:
        """Score ``cand`` on every prompt and held-out window."""
        self.per_prompt = [None] * len(self.encoded)
        self.cand_greedy = []
        with torch.inference_mode():
            model = hf_model(cand)
            if model is not None:
                self.hf_passes(model)
            else:
                self.candidate_passes(cand)
            t0 = time.perf_counter()
            ph = self.prog.phase("candidate, held-out perplexity", total=len(self.windows), unit="windows")
            cand_heldout = heldout_nll(cand.logits, self.windows, ph.advance)
            ph.finish()
            self.timings["candidate_heldout"] = time.perf_counter() - t0
        return Measured(self.encoded, self.per_prompt, self.ref, self.cand_greedy, cand_heldout, self.windows)


def _prepare(reference_model_dir: Path, options: GateOptions, runtime: GateRuntime, prog: StageProgress,
             timings: dict[str, float]) -> tuple[Any, _Scoring]:
    """(tokenizer, the scoring state): golden prompts and held-out windows encoded, the reference loaded
    or computed, the FP32 lm_head read."""
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
    lm_w = lm_head_weight(reference_model_dir)
    timings["lm_head"] = time.perf_counter() - t0
    return tok, _Scoring(encoded, windows, stop_id, ref, lm_w, options, prog, timings)


def _run_facts(options: GateOptions, ref: ReferenceData, used_threads: int) -> dict[str, Any]:
    """metrics.json's keys about how the run was made (reference, its cache, threads)."""
    return {
        "reference_cache": {"hit": ref.cache_hit, "key": ref.key, "seconds_when_computed": ref.seconds},
        "reference": {"dtype": options.reference_dtype, "device": options.device,
                      "candidate_dtype": options.candidate_dtype,
                      "noise_floor": ("BF16 copy of the FP32 reference" if ref.floor is not None else
                                      "not measured: a BF16 reference has no BF16-vs-FP32 floor"
                                      if options.reference_dtype != "float32" else "not measured (noise_floor off)")},
        "torch_threads": used_threads,
    }


def run_gate(candidate: Any, reference_model_dir: Path, thresholds: GateThresholds, out_dir: Path,
             options: GateOptions = GateOptions(), runtime: GateRuntime = GateRuntime(), *,
             candidate_name: str = "", extra: Optional[dict] = None) -> GateResult:
    """Score ``candidate`` against the FP32 reference in ``reference_model_dir`` (see module doc).

    ``options``: what is measured (prompts per category, held-out tokens, greedy length, bootstrap,
    ...; every field can change a number). ``runtime``: threads, progress, reference cache, reports
    (never changes a number). ``candidate_name`` labels metrics.json (``model`` is the reference folder's
    name); ``extra`` is merged into it. ``out_dir``: the gate's folder; metrics.json, report.md, report.html and
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
    timings: dict[str, float] = {}
    choice = None if runtime.threads else thread_choice()
    with torch_threads(runtime.threads or choice.threads), StageProgress("gate", enabled=runtime.progress) as prog:
        used_threads = torch.get_num_threads()
        prog.say(choice.reason if choice is not None else f"{used_threads} torch threads (set by the caller)")
        prog.say(f"candidate {cand.name} against the {reference_label(options)} reference {reference_model_dir}")
        tok, scoring = _prepare(reference_model_dir, options, runtime, prog, timings)
        measured = scoring.run(cand)

        t0 = time.perf_counter()
        ph = prog.phase("metrics, bootstrap intervals" + (" and reports" if runtime.write_report else ""))
        metrics, per_token = assemble(measured, tok, thresholds, Settings.of(options),
                                      golden={"set_prompts": golden_set_size(options.golden_path),
                                              "prompts_per_category": options.prompts_per_category})
        timings["metrics"] = time.perf_counter() - t0
        metrics.update({"schema": 1, "model": reference_model_dir.name, "candidate": cand.name,
                        "reference_model_dir": str(reference_model_dir),
                        **_run_facts(options, measured.ref, used_threads)})
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
                    options: GateOptions = GateOptions(), runtime: GateRuntime = GateRuntime(), *,
                    candidate_name: Optional[str] = None, extra: Optional[dict] = None) -> GateResult:
    """The pipeline's gate stage: dequantize the exported checkpoint (``precision_pipeline.gate.moe_model.load_gate_model``:
    ``gate.model.load_checkpoint_model``, or the MoE reader for a Qwen3-MoE HF checkpoint) and ``run_gate`` it against
    ``model_dir``.

    The pipeline's ``--golden-limit`` is ``options.prompts_per_category``. ``candidate_name`` defaults to ``checkpoint <folder name>``; ``extra`` is merged into metrics.json
    (the gate stage's ``record``).
    """
    from precision_pipeline.gate.moe_model import load_gate_model
    from precision_pipeline.checkpoint.reader import HF_QUANT_CONFIG, checkpoint_layout
    from precision_pipeline.checkpoint.scales import scale_report
    from precision_pipeline.quantize.ptq import read_quantize_warnings

    t0 = time.perf_counter()
    label = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}[options.candidate_dtype]
    where = " on CUDA" if options.device == "cuda" else ""
    with StageProgress("gate", enabled=runtime.progress) as prog, prog.phase(f"load the checkpoint (dequantized to {label}){where}"):
        model = load_gate_model(Path(ckpt_dir), Path(model_dir), dtype=TORCH_DTYPES[options.candidate_dtype],
                                device=options.device)  # a MoE family's HF checkpoint: gate/moe_model.py
    load_s = time.perf_counter() - t0
    extra = {**(extra or {}), "checkpoint_dir": str(ckpt_dir), "checkpoint_load_s": round(load_s, 3),
             "scales": scale_report(Path(ckpt_dir)) if checkpoint_layout(Path(ckpt_dir)) == "trtllm_checkpoint" else None,
             "quantize_warnings": read_quantize_warnings(Path(ckpt_dir))}
    cfg = read_json(Path(ckpt_dir) / "config.json", {}) or {}
    if checkpoint_layout(Path(ckpt_dir)) == "hf_unified":  # the formats the LLM API serves: hf_quant_config.json's
        cfg = read_json(Path(ckpt_dir) / HF_QUANT_CONFIG, {}) or {}
    if cfg.get("quantization"):
        extra["checkpoint_quantization"] = cfg["quantization"]
    return run_gate(model, Path(model_dir), thresholds, Path(gate_dir), options, runtime,
                    candidate_name=candidate_name or f"{Path(ckpt_dir).parent.name}/{Path(ckpt_dir).name}", extra=extra)


__all__ = [
    "GateOptions", "GateRuntime", "GateResult", "run_gate", "gate_checkpoint", "write_gate_dir",
    # re-exported for callers not yet moved to their homes (serving/acceptance.py, nightly.py): drop at merge
    "CHECKS", "judge_metrics", "verdict_failures", "verdict_reasons", "check_min_prompts",
]
