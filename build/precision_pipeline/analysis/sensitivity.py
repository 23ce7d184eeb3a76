"""Per-layer quantization sensitivity of an exported checkpoint, and the cheapest exclusions that pass the gate.

``run_sensitivity(profile, model_dir, out_dir)`` (``invoke sensitivity``) takes the build's exported
TensorRT-LLM checkpoint (``<out>/checkpoint``; it does NOT quantize: without a checkpoint it raises
``UserError`` asking for ``invoke build --profile X`` first, or ``checkpoint_dir=`` / ``--checkpoint``),
loads the FP32 HF model once and measures, on a small stratified subset of the golden prompts
(``SensitivityOptions.prompts_per_category`` per category, default 1: 6 prompts, ~940 tokens, ~400 answer tokens),
what quantizing ONE cell costs while everything else stays FP32:

* cells: decoder layer ``i`` x kind, kinds ``attention.qkv``, ``attention.dense``, ``mlp.fc_gate``
  (``mlp.fc`` + ``mlp.gate``: TensorRT-LLM fuses them, quantize.py excludes them together),
  ``mlp.proj``, and ``kv_cache`` (that layer's K/V fake-quant) when the checkpoint quantizes the KV
  cache; plus ``lm_head`` when the checkpoint quantizes it. A cell's quantized version is exactly
  what the gate runs: ``gate.model.QuantLinear`` from the checkpoint's dequantized ``LinearSpec``
  (weights + input fake-quant), the KV fake-quant of ``checkpoint._kvq_sdpa`` with that layer's
  k/v scales. Linears the checkpoint keeps unquantized are not cells (shown as "excl").
* per-kind rows: one kind in every analysed layer at once; ``full``: every cell at once (what the
  checkpoint does, restricted to the analysed layers).
* metrics vs the FP32 reference on the answer positions: KL mean / P95 / P99 / max and top-1,
  with ``gate.token_metrics`` / ``gate.kl_summary`` (the gate's own code).

Speed (the run is ~170 forwards): prompts are packed into sequences of up to ``options.pack_tokens``
tokens (block-diagonal causal mask, positions restart per prompt; exact, since every fake-quant
here is per tensor or per token); the FP32 input of every decoder layer is cached once, so a cell
in layer ``i`` only runs layers ``i..L-1``; logits are computed only on the answer positions.

Cost model: excluding a linear cell costs ``bf16 bytes - quantized bytes`` of its checkpoint
tensors (``formats.linear_weight_bytes``; BF16 = 2 bytes/element). ``kv_cache`` cells are measured
and drawn but never suggested: TensorRT-LLM has one KV-cache dtype per engine (a row that shows
the KV cache dominates means "set kv_cache_quant_algo: NONE").

Suggestion (ASSUMPTION: the cells' damage is additive up to a common factor): each cell's
contribution to the full run's per-token KL is its isolated per-token KL, rescaled per token so
the contributions sum to the measured ``full`` KL of that token. Greedy: repeatedly exclude the
linear cell with the largest reduction of predicted KL mean per byte of cost, until the predicted
KL mean and P99 meet the profile's gate thresholds (``profile.gate.for_model_dir(model folder)``, keyed by its content;
``kl_mean_max`` and ``kl_p99_max``; top-1 / perplexity / greedy are not predicted), then drop any
chosen cell that is not needed (reverse order). The result is expressed as ``exclude_modules``
patterns quantize.py understands (``transformer.layers.3.attention.qkv``,
``transformer.layers.3.mlp.fc`` + ``.mlp.gate``, ``transformer.layers.3.*`` for a whole layer;
checked with ``spec.families.resolve_exclusions``) and verified by a real measurement with those
cells in FP32 (``verify``: predicted vs measured). When the measurement misses the thresholds
(the additive prediction was optimistic), the targets are tightened by measured/predicted and the
greedy runs again, at most ``MAX_REFINE`` more times (each round in ``suggestion.rounds``).
The subset is small: its P99 rests on ~4 tokens.

Outputs in ``<out>/sensitivity/``:

* ``cells.jsonl``: one JSON line per finished measurement (cell, per-kind row, full, verify) with
  its per-token KL; the resume state. A restarted run skips measurements whose ``key`` (checkpoint
  content hash + golden subset hash + model fingerprint + ``SensitivityOptions`` + code version) matches;
  ``SensitivityRuntime(fresh=True)``
  starts over. A torn last line (killed mid-write) is dropped.
* ``sensitivity.json``: the matrix, per-kind rows, full, bytes, ranking, suggestion, timings.
* ``heatmap.png``: layers x kinds, KL mean, log colour scale, annotated (per-kind rows underneath).
* if ``<out>/gate/metrics.json`` exists: ``gate/sensitivity_heatmap.png`` and the gate's
  report.md / report.html re-rendered with it (``report.render_dir``).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import yaml
import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from precision_pipeline.analysis.evaluator import (DEFAULT_PACK_TOKENS, HEAD_KIND, KINDS, KV_KIND, LINEAR_KINDS, Cell,
                                                   Evaluator)
from precision_pipeline.analysis.heatmap import plot_heatmap
from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import atomic_write_json, atomic_write_text, hash_dir, hash_file, hash_obj
from precision_pipeline.spec import formats as FMT

CODE_VERSION = 2  # 2: the measurement key hashes SensitivityOptions
MAX_REFINE = 2  # extra suggest+verify rounds when the verified suggestion misses the thresholds
FIELD = "sensitivity"


def _rounded(a: np.ndarray) -> list[float]:
    return [float(f"{x:.6g}") for x in np.asarray(a, dtype=np.float64)]


# ==============================================================================================
# Suggestion


def _predict(full_kl: np.ndarray, cell_kl: dict[str, np.ndarray], excluded: Iterable[str]) -> np.ndarray:
    """Per-token KL predicted with ``excluded`` cells in FP32: the full run's per-token KL times the
    share of the isolated per-token KL that the remaining cells carry."""
    total = np.sum(list(cell_kl.values()), axis=0) if cell_kl else np.zeros_like(full_kl)
    removed = np.zeros_like(full_kl)
    for c in excluded:
        removed = removed + cell_kl[c]
    share = np.where(total > 0, 1.0 - removed / np.where(total > 0, total, 1.0), 1.0)
    return full_kl * np.clip(share, 0.0, 1.0)


def _meets(kl: np.ndarray, thresholds: dict) -> bool:
    from precision_pipeline.gate.metrics import kl_summary

    s = kl_summary(kl)
    ok = True
    if thresholds.get("kl_mean_max") is not None:
        ok &= s["kl_mean"] <= thresholds["kl_mean_max"]
    if thresholds.get("kl_p99_max") is not None:
        ok &= s["kl_p99"] <= thresholds["kl_p99_max"]
    return bool(ok)


def suggest_exclusions(full_kl: np.ndarray, cell_kl: dict[str, np.ndarray], costs: dict[str, float],
                       thresholds: dict) -> dict[str, Any]:
    """Greedy KL-reduction-per-byte choice of cells to keep in high precision (see module doc).

    ``cell_kl``: per-token isolated KL of every measured cell (kv_cache included: it counts in the
    shares but is never chosen); ``costs``: cost in bytes of the excludable cells.
    """
    from precision_pipeline.gate.metrics import kl_summary

    chosen: list[str] = []
    path = []
    pred = _predict(full_kl, cell_kl, chosen)
    candidates = [c for c in costs if c in cell_kl]
    while not _meets(pred, thresholds) and len(chosen) < len(candidates):
        base = float(pred.mean())
        best, best_score = None, -math.inf
        for c in candidates:
            if c in chosen:
                continue
            red = base - float(_predict(full_kl, cell_kl, chosen + [c]).mean())
            score = red / max(costs[c], 1.0)
            if score > best_score:
                best, best_score = c, score
        chosen.append(best)
        pred = _predict(full_kl, cell_kl, chosen)
        path.append({"cell": best, "cost_bytes": costs[best], "cumulative_bytes": float(sum(costs[c] for c in chosen)),
                     **{f"predicted_{k}": v for k, v in kl_summary(pred).items() if k in ("kl_mean", "kl_p99")}})
    reachable = _meets(pred, thresholds)
    # prune: drop chosen cells that are not needed (latest-first, i.e. the lowest gain per byte)
    if reachable:
        for c in list(reversed(chosen)):
            rest = [x for x in chosen if x != c]
            if _meets(_predict(full_kl, cell_kl, rest), thresholds):
                chosen = rest
        pred = _predict(full_kl, cell_kl, chosen)
    s = kl_summary(pred)
    return {"cells": sorted(chosen, key=lambda c: Cell.parse(c)), "reachable": reachable,
            "cost_bytes": float(sum(costs[c] for c in chosen)),
            "predicted": {"kl_mean": s["kl_mean"], "kl_p99": s["kl_p99"]}, "greedy_path": path}


def exclude_patterns(cells: Iterable[str], n_kinds_per_layer: int = len(LINEAR_KINDS)) -> list[str]:
    """``exclude_modules`` patterns (TensorRT-LLM names) for cells; a layer with all its linear
    kinds excluded becomes ``transformer.layers.N.*``."""
    by_layer: dict[int, list[Cell]] = {}
    pats: list[str] = []
    for name in cells:
        c = Cell.parse(name)
        if c.kind == HEAD_KIND:
            pats.append("lm_head")
        elif c.excludable:
            by_layer.setdefault(c.layer, []).append(c)
    for layer in sorted(by_layer):
        cs = by_layer[layer]
        if len({c.kind for c in cs}) == n_kinds_per_layer:
            pats.append(f"transformer.layers.{layer}.*")
        else:
            for c in sorted(cs):
                pats.extend(c.trt_linears)
    return pats


def resolved_trt_names(hf_linear_names: list[str], patterns: list[str], n_layers: int) -> list[str]:
    """TensorRT-LLM names of the linears quantize.py would exclude for ``patterns``."""
    from precision_pipeline.spec.families import resolve_exclusions, trtllm_name

    hf, _ = resolve_exclusions(hf_linear_names, patterns, 0, 0, n_layers)
    return sorted({trtllm_name(n) for n in hf})


# ==============================================================================================
# Resume state


def _load_state(path: Path, key: str) -> dict[str, dict]:
    """Finished measurements in cells.jsonl whose key matches; drops a torn last line."""
    if not path.is_file():
        return {}
    text = path.read_text()
    good_lines, out = [], {}
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        good_lines.append(line)
        if rec.get("key") == key:
            out[rec["id"]] = rec
    if text and not text.endswith("\n") or len(good_lines) != len(text.splitlines()):
        atomic_write_text(path, "".join(g + "\n" for g in good_lines))
    return out


def _append(path: Path, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec, separators=(",", ":")) + "\n")
        f.flush()
        os.fsync(f.fileno())


# ==============================================================================================
# Entry point


@dataclass
class SensitivityResult:
    """What ``run_sensitivity`` did: the JSON it wrote, and which measurements were computed now."""

    out_dir: Path
    data: dict
    computed: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)

    @property
    def json_path(self) -> Path:
        return self.out_dir / "sensitivity.json"

    @property
    def heatmap_path(self) -> Path:
        return self.out_dir / "heatmap.png"

    @property
    def cells_path(self) -> Path:
        return self.out_dir / "cells.jsonl"


def _progress(enabled: bool):
    """The run's progress (``core.progress.StageProgress``): rich bars in a terminal, a line at least
    every 10 s in a log."""
    from precision_pipeline.core.progress import StageProgress

    return StageProgress("sensitivity", enabled=enabled)


def checkpoint_dir_for(out_dir: Path, profile_name: str, checkpoint_dir: Optional[Path]) -> Path:
    """The checkpoint to analyse: ``checkpoint_dir`` or ``<out>/checkpoint``; UserError if absent."""
    ck = Path(checkpoint_dir) if checkpoint_dir else Path(out_dir) / "checkpoint"
    if not (ck / "config.json").is_file() or not list(ck.glob("rank*.safetensors")):
        raise UserError("--profile" if checkpoint_dir is None else "--checkpoint",
                        f"{ck} holds no exported TensorRT-LLM checkpoint (config.json + rank*.safetensors).",
                        f"run `invoke build --profile {profile_name}` first (its quantize stage writes it), "
                        "or pass --checkpoint DIR.")
    return ck.resolve()


class SensitivityOptions(BaseModel):
    """How each measurement is made. Every field can change a number, so every field is in each measurement's key."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompts_per_category: PositiveInt = 1
    """Golden prompts per category in the subset (first N in file order; 1 = 6 prompts)."""
    golden_path: Optional[Path] = None
    """Golden prompt file (JSON lines); None = the shipped ``gate/data/golden_prompts.jsonl``."""
    pack_tokens: PositiveInt = DEFAULT_PACK_TOKENS
    """Tokens per packed sequence (block-diagonal mask; exact up to float summation order)."""

    def key_fields(self) -> dict[str, Any]:
        """All fields as JSON values (what the measurement key hashes)."""
        return self.model_dump(mode="json")


class SensitivityRuntime(BaseModel):
    """How the analysis runs. Never hashed: the measurements are the same whatever is set here."""

    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True)

    threads: Optional[PositiveInt] = None
    """Torch CPU threads; None = the cores not already busy (``gate.threads.auto_threads``)."""
    progress: bool = True
    """Rich progress bar on stderr."""
    fresh: bool = False
    """Delete ``cells.jsonl`` first and measure every cell again."""
    rerender_gate: bool = True
    """Copy the heatmap into ``<out>/gate`` and re-render its reports when a gate result is there."""
    on_measured: Optional[Callable[[str, dict], None]] = None
    """Called as ``on_measured(id, record)`` after each measurement is saved (tests raise from it to simulate a kill)."""
    prepare: Optional[Callable[[Any], None]] = None
    """Called as ``prepare(evaluator)`` before any measurement (tests alter ``evaluator.ck``)."""
    margin: float = Field(1.0, gt=0.0, le=1.0)
    """The suggestion aims at ``margin`` x the gate's KL mean / P99 thresholds and is verified against
    those (0.8: 20 % headroom for the full golden set and perplexity, which the subset does not
    measure). Changes only the suggestion, never a measurement."""


@dataclass
class _Scope:
    """What one run analyses: the checkpoint, its quantization, and the layers x kinds asked for."""

    ck_dir: Path
    cfg: dict
    algo: str
    n_layers: int
    layers: list[int]
    kinds: list[str]

    @property
    def q(self) -> dict:
        return self.cfg.get("quantization") or {}


def _scope(profile: Any, ck_dir: Path, layers: Optional[Sequence[int]], kinds: Optional[Sequence[str]]) -> _Scope:
    """The checkpoint's config checked against ``profile`` and the asked layers / kinds (UserError if not)."""
    from precision_pipeline.checkpoint.reader import read_config

    cfg = read_config(ck_dir)
    q = cfg.get("quantization") or {}
    algo = q.get("quant_algo") or FMT.gemm(None).value  # config.json null = NO_QUANT
    want = profile.quantization.quant_algo
    want = getattr(want, "value", want)
    if algo != want:
        raise UserError("--profile", f"{ck_dir} is quantized with {algo}, but profile {profile.name} asks for {want}.",
                        f"rebuild it: `invoke build --profile {profile.name}`.")
    if not FMT.gemm(algo).is_quantized:
        raise UserError("--profile", f"{profile.name} quantizes nothing: there is no sensitivity to measure.",
                        "use a profile with a quant_algo.")
    n_layers = int(cfg["num_hidden_layers"])
    if layers is None:
        layers = list(range(n_layers))
    layers = sorted(set(int(i) for i in layers))
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad or not layers:
        raise UserError("--layers", f"layers {bad or layers} are outside 0..{n_layers - 1}.", f"use layers 0..{n_layers - 1}.")
    kinds = list(kinds) if kinds else list(KINDS)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise UserError("kinds", f"unknown kinds {unknown}.", f"use {', '.join(KINDS)}.")
    if not q.get("kv_cache_quant_algo") and KV_KIND in kinds:
        kinds.remove(KV_KIND)
    return _Scope(ck_dir, cfg, algo, n_layers, layers, kinds)


def _measurement_key(scope: _Scope, options: SensitivityOptions, encoded: Sequence[Any], model_dir: Path) -> str:
    """What every measurement of this run is keyed by (cells.jsonl's ``key``): module doc, Outputs."""
    from precision_pipeline.gate import golden as golden_mod
    from precision_pipeline.gate.reference import model_fingerprint

    return hash_obj({
        "v": CODE_VERSION, "options": options.key_fields(), "ckpt": hash_dir(scope.ck_dir),
        "golden": golden_mod.golden_hash(encoded), "model": model_fingerprint(model_dir), "torch": torch.__version__,
        "code": [hash_file(Path(__file__)), hash_file(Path(__file__).resolve().parent / "evaluator.py"),
                 hash_file(Path(__file__).resolve().parents[1] / "checkpoint" / "reader.py")],
    })


@dataclass
class _Jobs:
    """The run's measurements: reused from cells.jsonl when their key matches, else measured and appended."""

    ev: Evaluator
    key: str
    state_path: Path
    done: dict[str, dict]
    runtime: SensitivityRuntime
    computed: list[str] = field(default_factory=list)
    reused: list[str] = field(default_factory=list)
    results: dict[str, dict] = field(default_factory=dict)

    def run(self, phase: Any, jid: str, job_cells: list[Cell]) -> dict:
        if jid in self.done:
            self.reused.append(jid)
            return self.done[jid]
        m = self.ev.measure(job_cells)
        rec = {"key": self.key, "id": jid, "cells": [c.name for c in job_cells] if len(job_cells) <= 8 else len(job_cells),
               **m.summary(), "seconds": round(m.seconds, 3), "kl_tokens": _rounded(m.kl),
               "top1_tokens": m.top1.astype(int).tolist()}
        _append(self.state_path, rec)
        self.computed.append(jid)
        phase.advance()
        if self.runtime.on_measured is not None:
            self.runtime.on_measured(jid, rec)
        return rec


def _cells_of(scope: _Scope, ev: Evaluator) -> tuple[list[Cell], list[Cell], dict[str, list[Cell]]]:
    """(every analysed cell, the quantized ones, kind -> its quantized cells)."""
    all_cells = [Cell(i, k) for i in scope.layers for k in scope.kinds]
    if HEAD_KIND not in scope.q.get("exclude_modules", []) and ev.quantized(Cell(1 << 30, HEAD_KIND)):
        all_cells.append(Cell(1 << 30, HEAD_KIND))
    cells = [c for c in all_cells if ev.quantized(c)]
    kind_sets = {k: [c for c in cells if c.kind == k] for k in scope.kinds}
    return all_cells, cells, {k: v for k, v in kind_sets.items() if v}


def _suggestion(jobs: _Jobs, phase: Any, cells: list[Cell], scope: _Scope, existing: list[str], aim: dict,
                verify: bool) -> tuple[dict, dict[str, float]]:
    """(the suggestion with its verification rounds, exclusion cost per cell): module doc, Suggestion."""
    results, ev = jobs.results, jobs.ev
    cell_kl = {c.name: np.asarray(results[f"cell:{c.name}"]["kl_tokens"]) for c in cells}
    full_kl = np.asarray(results["full"]["kl_tokens"])
    cost = {c.name: ev.cell_bytes(c)["cost_bytes"] for c in cells if c.excludable}
    target = dict(aim)
    rounds: list[dict] = []
    for rnd in range(1 + (MAX_REFINE if verify else 0)):
        sug = suggest_exclusions(full_kl, cell_kl, cost, target)
        added = exclude_patterns(sug["cells"])
        sug["added_exclude_modules"] = added
        sug["exclude_modules"] = existing + [p for p in added if p not in existing]
        intended = sorted({t for n in sug["cells"] for t in Cell.parse(n).trt_linears})
        got = resolved_trt_names(ev.hf_linear_names, added, scope.n_layers) if added else []
        if got != intended:  # pragma: no cover - a bug in exclude_patterns
            raise RuntimeError(f"exclude patterns {added} resolve to {got}, expected {intended}")
        sug["resolves_to"] = got
        if not verify:
            break
        if sug["cells"]:
            keep = set(sug["cells"])
            vid = "verify:" + hash_obj(sorted(keep))[:12]
            if vid in jobs.done:
                phase.advance()
            if rnd:
                phase.total += 1
            vrec = jobs.run(phase, vid, [c for c in cells if c.name not in keep])
        else:
            vid, vrec = "full", results["full"]
            phase.advance()
        sug["measured"] = {k: vrec[k] for k in ("kl_mean", "kl_p99", "top1")}
        sug["measured_id"] = vid
        sug["meets_measured"] = _meets(np.asarray(vrec["kl_tokens"]), aim)
        rounds.append({"cells": len(sug["cells"]), "cost_bytes": sug["cost_bytes"], "target": dict(target),
                       "predicted": sug["predicted"], "measured": sug["measured"],
                       "meets_measured": sug["meets_measured"]})
        if sug["meets_measured"] or not sug["cells"] or not sug["reachable"]:
            break
        # the additive prediction was optimistic: tighten the target by the measured/predicted ratio
        for m, f in (("kl_mean", "kl_mean_max"), ("kl_p99", "kl_p99_max")):
            pr, me = sug["predicted"][m], sug["measured"][m]
            if target.get(f) is not None and pr > 0 and me > pr:
                target[f] = target[f] * pr / me
    sug["rounds"] = rounds
    return sug, cost


_STATS = ("kl_mean", "kl_p95", "kl_p99", "kl_max", "top1")


def _tables(scope: _Scope, ev: Evaluator, all_cells: list[Cell], kind_sets: dict[str, list[Cell]],
            results: dict[str, dict]) -> dict[str, Any]:
    """sensitivity.json's measurement tables: the layers x kinds matrix, every cell, the ranking, per kind, full."""
    layers, lin_kinds = scope.layers, list(scope.kinds)
    matrix = np.full((len(layers), len(lin_kinds)), np.nan)
    cells_json = {}
    for c in all_cells:
        row = {"layer": None if c.kind == HEAD_KIND else c.layer, "kind": c.kind, "quantized": ev.quantized(c),
               **ev.cell_bytes(c)}
        r = results.get(f"cell:{c.name}")
        if r is not None:
            row.update({k: r[k] for k in _STATS})
            if c.kind != HEAD_KIND:
                matrix[layers.index(c.layer), lin_kinds.index(c.kind)] = r["kl_mean"]
        cells_json[c.name] = row
    ranked = sorted((n for n, r in cells_json.items() if "kl_mean" in r), key=lambda n: -cells_json[n]["kl_mean"])
    per_kind = {k: {m: results[f"kind:{k}"][m] for m in _STATS}
                | {"cells": len(kind_sets[k]),
                   "sum_of_cells_kl_mean": float(sum(cells_json[c.name]["kl_mean"] for c in kind_sets[k]))}
                for k in kind_sets}
    full = {m: results["full"][m] for m in _STATS}
    full["sum_of_cells_kl_mean"] = float(sum(r["kl_mean"] for r in cells_json.values() if "kl_mean" in r))
    return {"matrix": matrix, "cells": cells_json, "ranking": ranked, "per_kind": per_kind, "full": full,
            "kind_rows": np.array([[per_kind[k]["kl_mean"] if k in per_kind else np.nan for k in lin_kinds]])}


_METHOD = {
    "cell": "one cell quantized (checkpoint weights dequantized + input fake-quant, or that layer's KV fake-quant), "
            "every other module the FP32 HF model's",
    "metrics": "gate.token_metrics on the golden answer positions of the subset: KL(P_ref || P_cand) nats, top-1",
    "cost": "excluding a linear cell costs bf16 bytes - quantized bytes (formats.linear_weight_bytes); "
            "kv_cache cells are not excludable (one KV dtype per TensorRT-LLM engine)",
    "suggestion": "assumes additivity up to a common factor: per token, full-run KL x share of the isolated KL "
                  "carried by the remaining cells; greedy by predicted KL-mean reduction per byte until "
                  "kl_mean_max and kl_p99_max are met, then unneeded cells dropped; verified by one measurement",
}


def _gate_metrics(gate_dir: Path) -> Optional[dict]:
    """KL mean / P99 / top-1 of the build's gate run, when there is one."""
    if not (gate_dir / "metrics.json").is_file():
        return None
    gm = json.loads((gate_dir / "metrics.json").read_text())
    return {k: (gm.get("metrics", {}).get(k) or {}).get("value") for k in ("kl_mean", "kl_p99", "top1")}


@dataclass
class _Outcome:
    """What the measuring part of a run produced (``_Run.measure``)."""

    encoded: list
    key: str
    ev: Evaluator
    all_cells: list[Cell]
    kind_sets: dict[str, list[Cell]]
    job_list: list[tuple[str, list[Cell]]]
    jobs: _Jobs
    sug: dict
    cost: dict[str, float]
    used_threads: int


@dataclass
class _Run:
    """One ``run_sensitivity`` call: its inputs, the checked scope and the phase timings."""

    profile: Any
    model_dir: Path
    out_dir: Path
    options: SensitivityOptions
    runtime: SensitivityRuntime
    scope: _Scope
    thresholds: dict
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def sens_dir(self) -> Path:
        return self.out_dir / "sensitivity"

    def _evaluator(self) -> tuple[list, str, dict[str, dict], Evaluator]:
        """(golden prompts, measurement key, finished measurements, evaluator with its FP32 reference)."""
        from transformers import AutoTokenizer

        from precision_pipeline.checkpoint.reader import dequantize_checkpoint
        from precision_pipeline.gate import golden as golden_mod

        t0 = time.perf_counter()
        tok = AutoTokenizer.from_pretrained(str(self.model_dir))
        options = self.options
        encoded = golden_mod.encode_golden(
            tok, golden_mod.load_golden(options.golden_path, per_category=options.prompts_per_category))
        key = _measurement_key(self.scope, options, encoded, self.model_dir)
        state_path = self.sens_dir / "cells.jsonl"
        if self.runtime.fresh and state_path.exists():
            state_path.unlink()
        done = _load_state(state_path, key)
        self.timings["prepare"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ck = dequantize_checkpoint(self.scope.ck_dir)
        ck.tensors.clear()  # embedding / norms come from the FP32 model
        ev = Evaluator(self.model_dir, ck, encoded, options.pack_tokens)
        if self.runtime.prepare is not None:
            self.runtime.prepare(ev)
        self.timings["load_and_reference"] = time.perf_counter() - t0
        return encoded, key, done, ev

    def measure(self, verify: bool) -> _Outcome:
        """Every cell, every kind, the full run, then the suggestion (and its verification)."""
        from precision_pipeline.gate.threads import torch_threads

        runtime = self.runtime
        with torch_threads(runtime.threads):
            used_threads = torch.get_num_threads()
            encoded, key, done, ev = self._evaluator()
            all_cells, cells, kind_sets = _cells_of(self.scope, ev)
            job_list: list[tuple[str, list[Cell]]] = [(f"cell:{c.name}", [c]) for c in cells]
            job_list += [(f"kind:{k}", v) for k, v in kind_sets.items()]
            job_list.append(("full", cells))
            jobs = _Jobs(ev, key, self.sens_dir / "cells.jsonl", done, runtime)
            t_jobs = time.perf_counter()
            with _progress(runtime.progress) as prog:
                phase = prog.phase("cells measured (one quantized at a time, then kinds, full, verify)",
                                   len(job_list) + (1 if verify else 0), "cells")
                phase.done = sum(1 for j, _ in job_list if j in done)
                for jid, jc in job_list:
                    jobs.results[jid] = jobs.run(phase, jid, jc)
                aim = {k: (v * runtime.margin if k in ("kl_mean_max", "kl_p99_max") and v is not None else v)
                       for k, v in self.thresholds.items()}
                sug, cost = _suggestion(jobs, phase, cells, self.scope, list(self.profile.quantization.exclude_modules),
                                        aim, verify)
            self.timings["measure"] = time.perf_counter() - t_jobs
        return _Outcome(encoded, key, ev, all_cells, kind_sets, job_list, jobs, sug, cost, used_threads)

    def data(self, o: _Outcome) -> dict:
        """sensitivity.json (the heatmap drawn on the way)."""
        scope, q, ev, sens_dir = self.scope, self.scope.q, o.ev, self.sens_dir
        tables = _tables(scope, ev, o.all_cells, o.kind_sets, o.jobs.results)
        title = f"{self.profile.name} ({scope.algo}" + (
            f", KV {q.get('kv_cache_quant_algo')}" if q.get("kv_cache_quant_algo") else "") + "): KL mean, one cell quantized, rest FP32"
        t0 = time.perf_counter()
        size = plot_heatmap(tables["matrix"], scope.layers, scope.kinds, tables["kind_rows"], sens_dir / "heatmap.png", title)
        self.timings["heatmap"] = time.perf_counter() - t0
        return {
            "schema": 1, "profile": self.profile.name, "model": self.model_dir.name, "model_dir": str(self.model_dir),
            "checkpoint_dir": str(scope.ck_dir), "quant_algo": scope.algo, "kv_cache_quant_algo": q.get("kv_cache_quant_algo"),
            "checkpoint_exclude_modules": list(q.get("exclude_modules") or []),
            "key": o.key, "layers": scope.layers, "kinds": list(scope.kinds),
            "prompts": {"per_category": self.options.prompts_per_category, "ids": [e.id for e in o.encoded],
                        "tokens": ev.tokens, "answer_tokens": ev.answer_tokens, "packs": len(ev.packs)},
            "thresholds": self.thresholds, "margin": self.runtime.margin,
            "matrix_kl_mean": [[None if not np.isfinite(v) else float(v) for v in row] for row in tables["matrix"]],
            "cells": tables["cells"], "ranking": tables["ranking"], "per_kind": tables["per_kind"], "full": tables["full"],
            "gate_metrics": _gate_metrics(self.out_dir / "gate"), "suggestion": o.sug,
            "bytes": {"quantized_cells_cost_bytes_total": float(sum(o.cost.values())),
                      "suggestion_cost_bytes": o.sug["cost_bytes"]},
            "heatmap": {"path": str(sens_dir / "heatmap.png"), "size_px": list(size)},
            "method": dict(_METHOD),
            "run": {"threads": o.used_threads, "computed": len(o.jobs.computed), "reused": len(o.jobs.reused),
                    "reference_s": round(ev.reference_seconds, 3),
                    "seconds_per_cell_mean": round(float(np.mean([o.jobs.results[j]["seconds"] for j, _ in o.job_list])), 3)},
        }


def run_sensitivity(profile: Any, model_dir: Path, out_dir: Path, options: SensitivityOptions = SensitivityOptions(),
                    runtime: SensitivityRuntime = SensitivityRuntime(), *, checkpoint_dir: Optional[Path] = None,
                    layers: Optional[Sequence[int]] = None, kinds: Optional[Sequence[str]] = None,
                    verify: bool = True) -> SensitivityResult:
    """Measure per-cell sensitivity of ``<out_dir>/checkpoint`` and suggest exclusions (module doc).

    ``profile``: a validated Profile (thresholds from ``profile.gate.for_model_dir(model_dir)``,
    existing ``quantization.exclude_modules`` kept in the suggestion). ``options``: how each cell is
    measured (hashed into each measurement's key); ``runtime``: threads, progress, resume, hooks (not
    hashed). ``checkpoint_dir``: analyse this checkpoint instead of ``<out_dir>/checkpoint``.
    ``layers`` / ``kinds``: restrict the analysed cells (default all; a measurement's id names its
    cells, so a narrower run reuses a wider one's cells). ``verify``: measure the suggestion.
    Raises UserError for a missing or mismatching checkpoint or bad ``layers`` / ``kinds``.
    """
    t_start = time.perf_counter()
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    scope = _scope(profile, checkpoint_dir_for(out_dir, profile.name, checkpoint_dir), layers, kinds)
    thresholds = profile.gate.for_model_dir(model_dir).thresholds().model_dump(mode="json")
    run = _Run(profile, model_dir, out_dir, options, runtime, scope, thresholds)
    run.sens_dir.mkdir(parents=True, exist_ok=True)
    outcome = run.measure(verify)
    data = run.data(outcome)
    run.timings["total"] = time.perf_counter() - t_start
    data["timings_s"] = {k: round(v, 3) for k, v in run.timings.items()}
    atomic_write_json(run.sens_dir / "sensitivity.json", data)
    if runtime.rerender_gate and (out_dir / "gate" / "metrics.json").is_file():
        _rerender_gate(out_dir / "gate", run.sens_dir / "heatmap.png")
    return SensitivityResult(run.sens_dir, data, outcome.jobs.computed, outcome.jobs.reused)


def extends_reference(profile_arg: str, target: Path) -> str:
    """What a profile written to ``target`` puts in ``extends:`` to reach ``profile_arg``: a shipped
    name as is; a YAML path as a path relative to ``target``'s folder. Raises UserError when that path
    would leave the folder (``extends`` refuses ``..`` escapes: see ``spec.profile``) or when ``target``
    is the analysed profile's own file."""
    from precision_pipeline.spec.profile import resolve_profile_path, shipped_profiles

    src = resolve_profile_path(profile_arg).resolve()
    if src == Path(target).expanduser().resolve():
        raise UserError("--write-profile", f"{target} is the analysed profile itself: the tuned profile extends it, so "
                        "writing there would replace the original.", f"write e.g. {src.with_name(src.stem + '-tuned.yaml')}.")
    if profile_arg in shipped_profiles():
        return profile_arg
    rel = os.path.relpath(src, Path(target).expanduser().resolve().parent)
    if rel.startswith(".."):
        raise UserError("--write-profile", f"the tuned profile would extend {src}, which is not in its folder tree "
                        "(extends may not leave it).", f"write it into {src.parent} or below.")
    return rel


def tuned_profile_yaml(data: dict, extends: str, command: str = "") -> str:
    """The profile text ``invoke sensitivity --write-profile`` writes: ``extends`` the analysed profile
    and replaces ``quantization.exclude_modules`` by the verified suggestion (the original patterns
    first). ``data``: ``sensitivity.json``'s content. The header comment carries the subset's measured
    numbers and the bytes the exclusions cost."""
    s, m = data["suggestion"], data["suggestion"].get("measured") or {}
    n_prompts, tokens = len(data["prompts"]["ids"]), data["prompts"]["answer_tokens"]
    head = ("# Written by `invoke sensitivity" + (f" {command}" if command else "") + "`.\n"
            f"# {len(s['cells'])} cell(s) of {data['profile']} kept in BF16 for {data['model']}, +{s['cost_bytes'] / 2**20:.2f} MiB "
            f"of weights; measured on {n_prompts} golden prompts ({tokens} answer tokens): KL mean {m.get('kl_mean', float('nan')):.4g}, "
            f"KL P99 {m.get('kl_p99', float('nan')):.4g}, top-1 {m.get('top1', float('nan')):.3f} (gate: KL mean <= "
            f"{data['thresholds'].get('kl_mean_max')}, P99 <= {data['thresholds'].get('kl_p99_max')}; aimed at "
            f"{data.get('margin', 1.0):g} x those).\n"
            "# Top-1, perplexity and greedy answers of the full golden set are the build's gate to judge: "
            "`invoke build --profile <this file>`.\n")
    body = {"extends": extends,
            "description": f"{data['profile']} with {len(s['cells'])} sensitive cell(s) kept in BF16 for {data['model']} "
                           "(invoke sensitivity --write-profile).",
            "quantization": {"exclude_modules": list(s["exclude_modules"])}}
    return head + yaml.safe_dump(body, sort_keys=False, width=100)


def write_tuned_profile(data: dict, profile_arg: str, path: Path, command: str = "") -> Path:
    """Write ``tuned_profile_yaml`` to ``path`` (``spec.profile.save_profile``: atomic, checked by the
    strict loader first). Raises GateFailed (exit 3, nothing written) when the verified suggestion
    misses the KL thresholds, UserError (exit 2) when there is nothing to exclude or ``path`` is unusable."""
    from precision_pipeline.core.errors import GateFailed
    from precision_pipeline.spec.profile import save_profile

    s = data["suggestion"]
    if not s["cells"]:
        raise UserError("--write-profile", f"{data['profile']} already meets the KL thresholds on this subset with "
                        "nothing excluded, so there is nothing to tune.", f"build it as it is: invoke build --profile {profile_arg}.")
    if not s.get("meets_measured"):
        m = s.get("measured") or {}
        raise GateFailed(f"--write-profile: keeping {len(s['cells'])} cell(s) in BF16 measured KL mean "
                         f"{m.get('kl_mean', float('nan')):.4g} / P99 {m.get('kl_p99', float('nan')):.4g} against "
                         f"<= {data['thresholds'].get('kl_mean_max')} / <= {data['thresholds'].get('kl_p99_max')} x "
                         f"{data.get('margin', 1.0):g}: "
                         "no profile written. Fix: measure more prompts (--prompts 2) or use a wider format"
                         + (f", or aim at a larger --margin (now {data['margin']:g})" if data.get("margin", 1.0) < 1 else "")
                         + ".")
    path = Path(path).expanduser().resolve()
    save_profile(path, tuned_profile_yaml(data, extends_reference(profile_arg, path), command), field="--write-profile")
    return path


def _rerender_gate(gate_dir: Path, heatmap: Path) -> None:
    """Put the heatmap into the gate folder and re-render its reports (report.render_dir)."""
    from precision_pipeline.gate.report import render_dir

    dst = gate_dir / "sensitivity_heatmap.png"
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    tmp.write_bytes(Path(heatmap).read_bytes())
    os.chmod(tmp, 0o644)
    os.replace(tmp, dst)
    render_dir(gate_dir)


__all__ = ["SensitivityOptions", "SensitivityRuntime", "SensitivityResult", "run_sensitivity", "suggest_exclusions",
           "tuned_profile_yaml", "write_tuned_profile", "extends_reference", "exclude_patterns", "resolved_trt_names",
           "checkpoint_dir_for"]
