"""The performance model (``resolve/perf.py``) held against published TensorRT-LLM measurements.

The project's own table of public measurements (``ROWS``), every row with its source (document,
version, settings), against the model's estimate for the same model config, GPU, format, tp and
workload. Prints one line per row, the median and spread of estimate/measured per (model, GPU, flow)
group and overall, whether formats and tp sizes come out in the measured order, and a last line of
``key=value`` pairs, e.g. ``rows=... median=... groups=... worst_group=... tp_pairs_in_order=... ...``.

Usage: ``python benchmarks/planner.py [--rows]`` (``invoke bench planner``). Exit 1 when the overall
median leaves 0.8-1.3, a group median leaves 0.6-1.6, or an order disagrees (issue 30's bar).

What could not be found (so it is not in the table): Llama-3.1-8B on B200 and any B200 FP8 row
(the perf-overview tables found list B200 only with FP4, for Llama 3.3 70B), so NVFP4 over FP8 on B200
is not checked against a measurement; Triton serving latency rows of these models.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "build") not in sys.path:
    sys.path.insert(0, str(ROOT / "build"))

MODELS = {"8B": ROOT / "tests" / "data" / "models" / "Llama-3.1-8B", "70B": ROOT / "tests" / "data" / "models" / "Llama-3.1-70B"}

# --- sources -------------------------------------------------------------------------------------
SOURCES = {
    "engine-v0.17": ("NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md at commit 258c754 "
                     "('All data in the table below was generated using version 0.17'): trtllm-bench build "
                     "--quantization FP8 (FP8 KV cache) + trtllm-bench throughput, infinite request rate, "
                     "kv_cache_free_gpu_mem_fraction 0.95, Llama v3.1 8B / 70B, H100 80GB HBM3 and H200 141GB, "
                     "total output tokens/s of the tp GPUs"),
    "pytorch-v1.0": ("NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md at commit 00f3768 (the v1.0 "
                     "tables, '(NEW for v1.0)'): trtllm-bench throughput --backend pytorch, nvidia/Llama-3.1-8B-"
                     "Instruct-FP8, nvidia/Llama-3.3-70B-Instruct-FP8 / -FP4 (Llama 3.3 70B has Llama 3.1 70B's "
                     "shapes), kv_cache_free_gpu_mem_fraction 0.95, 'Total Output Throughput (tokens/sec)'"),
    "modelopt-v0.15": ("NVIDIA/TensorRT-Model-Optimizer benchmark.md at commit 45cb1ab, section 1.1: H200, "
                       "nvidia-modelopt v0.21.1, TensorRT-LLM v0.15, trtllm-bench, input 2048 / output 128, batch "
                       "size 1/8/64; BF16 at 8B:TP1 and 70B:TP2, FP8 / INT4 AWQ / W4A8 AWQ at TP1; tokens/s of the "
                       "engine (speedups in the source are per GPU)"),
}
FLOW_SETTINGS = {
    # max_batch_size / max_num_tokens each flow ran with; kv_cache_free_gpu_mem_fraction 0.95 as the sources say
    "engine-v0.17": {"max_batch_size": 4096, "max_num_tokens": 8192},  # perf-overview's example run: "Max Runtime
    # Batch Size: 4096, Max Runtime Tokens: 8192" (trtllm-bench build picks them from the dataset; not printed per row)
    "pytorch-v1.0": {"max_batch_size": 2048, "max_num_tokens": 8192},  # LLM API defaults, tensorrt_llm/llmapi/llm_args.py
    "modelopt-v0.15": {"max_batch_size": None, "max_num_tokens": 8192},  # batch = the row's batch size
}
KV_FOR = {"NO_QUANT": "NONE", "FP8": "FP8", "NVFP4": "FP8", "W4A16_AWQ": "FP8", "W4A8_AWQ": "FP8"}
"""KV cache of each row's format: FP8 for quantized checkpoints (trtllm-bench: 'If you specify FP8 quantization,
the KV cache will automatically be set to FP8'; NVIDIA's FP4 checkpoints and ModelOpt's export default to an FP8
KV cache), BF16 unquantized. For the ModelOpt INT4/W4A8 rows this is an assumption (the page does not say)."""


@dataclass(frozen=True)
class Row:
    model: str
    gpu: str
    flow: str
    quant_algo: str
    tp: int
    isl: int
    osl: int
    measured: float  # output tokens/s of the whole engine (tp GPUs)
    batch: Optional[int] = None  # fixed batch (ModelOpt rows); None = as many as fit (throughput scenario)

    @property
    def group(self) -> str:
        return f"{self.model}/{self.gpu}/{self.flow}"

    @property
    def source(self) -> str:
        return SOURCES[self.flow]


def _rows(model, gpu, flow, algo, tp, text) -> list[Row]:
    out = []
    for item in text.split(","):
        lens, val = item.split()
        i, o = lens.split("/")
        out.append(Row(model, gpu, flow, algo, tp, int(i), int(o), float(val)))
    return out


_E, _P = "engine-v0.17", "pytorch-v1.0"
ROWS: list[Row] = [
    # perf-overview v0.17 (engine flow), FP8, transcribed from the table (empty cells left out)
    *_rows("8B", "h200", _E, "FP8", 1, "128/128 29526.04, 128/2048 25398.86, 128/4096 17370.8, 500/2000 21020.81, "
           "1000/1000 17537.96, 2048/128 3794.14, 2048/2048 11968.5, 5000/500 3987.79, 20000/2000 1804.1"),
    *_rows("8B", "h100-sxm", _E, "FP8", 1, "128/128 28836.77, 128/2048 21109.38, 128/4096 13593.65, 500/2000 16500.69, "
           "1000/1000 15244.78, 2048/128 3556.73, 2048/2048 9488.42, 5000/500 3559.36, 20000/2000 1401.31"),
    *_rows("70B", "h200", _E, "FP8", 1, "128/128 4020.75, 128/2048 4165.68, 128/4096 2651.75, 500/2000 3018.39, "
           "1000/1000 2823.45, 2048/128 465.99, 2048/2048 1913.8, 5000/500 560.16, 20000/2000 279.52"),
    *_rows("70B", "h100-sxm", _E, "FP8", 1, "128/128 3378.03, 128/2048 911.62, 128/4096 426.32, 500/2000 775.57, "
           "1000/1000 839.97, 2048/128 343.29, 5000/500 245.34"),
    *_rows("70B", "h200", _E, "FP8", 2, "128/128 6823.01, 128/2048 8290.35, 128/4096 6526.67, 500/2000 6848.02, "
           "1000/1000 5164.76, 2048/128 809, 2048/2048 4183.88, 5000/500 1025.38, 20000/2000 640.62"),
    *_rows("70B", "h100-sxm", _E, "FP8", 2, "128/128 6645.12, 128/2048 6169.58, 128/4096 3897.06, 500/2000 4972.57, "
           "1000/1000 4390.53, 2048/128 772.66, 2048/2048 2898.16, 5000/500 919.73, 20000/2000 443.01"),
    *_rows("70B", "h200", _E, "FP8", 4, "128/128 11098.63, 128/2048 14156, 128/4096 10574.06, 500/2000 12452.79, "
           "1000/1000 8911.29, 2048/128 1358.06, 2048/2048 7130.44, 5000/500 1811.55, 20000/2000 1199.68"),
    *_rows("70B", "h100-sxm", _E, "FP8", 4, "128/128 11127.53, 128/2048 11511.93, 128/4096 7439.41, 500/2000 9836.7, "
           "1000/1000 7430.99, 2048/128 1302.6, 2048/2048 5480.03, 5000/500 1602.78, 20000/2000 920.19"),
    *_rows("70B", "h200", _E, "FP8", 8, "128/128 15355.84, 128/2048 21195.88, 128/4096 16941.52, 500/2000 17278.4, "
           "1000/1000 13181.24, 2048/128 1983.03, 2048/2048 11142.47, 5000/500 2717.83, 20000/2000 1920.45"),
    *_rows("70B", "h100-sxm", _E, "FP8", 8, "128/128 14730.69, 128/2048 17061.82, 128/4096 14171.43, 500/2000 14679.33, "
           "1000/1000 11451.16, 2048/128 1923.41, 2048/2048 8801.95, 5000/500 2457.42, 20000/2000 1512.6"),
    # perf-overview v1.0 (PyTorch flow)
    *_rows("8B", "h200", _P, "FP8", 1, "128/128 27911, 128/2048 26221, 128/4096 18027, 500/2000 20770, 1000/1000 17744, "
           "1000/2000 16828, 2048/128 3538, 2048/2048 12194, 5000/500 3902, 20000/2000 1804"),
    *_rows("8B", "h100-sxm", _P, "FP8", 1, "128/128 28312, 128/2048 22714, 128/4096 14325, 500/2000 17660, 1000/1000 15220, "
           "1000/2000 13899, 2048/128 3450, 2048/2048 9305, 5000/500 3459, 20000/2000 1351"),
    *_rows("70B", "b200", _P, "NVFP4", 1, "128/128 11147, 128/2048 9922, 128/4096 6831, 500/2000 7762, 1000/1000 7007, "
           "1000/2000 6271, 2048/128 1339, 2048/2048 4783, 5000/500 1459, 20000/2000 665"),
    *_rows("70B", "h200", _P, "FP8", 1, "128/128 3803, 128/2048 4336, 128/4096 2872, 500/2000 3666, 1000/1000 2909, "
           "1000/2000 2994, 2048/128 442, 2048/2048 2003, 5000/500 566, 20000/2000 283"),
    *_rows("70B", "h100-sxm", _P, "FP8", 2, "128/128 6378, 128/2048 6651, 128/4096 4199, 500/2000 5222, 1000/1000 4205, "
           "1000/2000 4146, 2048/128 762, 2048/2048 3082, 5000/500 898, 20000/2000 437"),
    # ModelOpt benchmark reference (H200, input 2048 / output 128, fixed batch)
    *[Row(m, "h200", "modelopt-v0.15", algo, tp, 2048, 128, v, batch=b) for m, algo, tp, b, v in (
        ("8B", "NO_QUANT", 1, 1, 173.80), ("8B", "NO_QUANT", 1, 8, 803.11), ("8B", "NO_QUANT", 1, 64, 1679.74),
        ("8B", "FP8", 1, 1, 245.03), ("8B", "FP8", 1, 8, 1051.17), ("8B", "FP8", 1, 64, 2190.93),
        ("8B", "W4A16_AWQ", 1, 1, 231.75), ("8B", "W4A16_AWQ", 1, 8, 599.72), ("8B", "W4A16_AWQ", 1, 64, 1392.78),
        ("8B", "W4A8_AWQ", 1, 1, 239.70), ("8B", "W4A8_AWQ", 1, 8, 801.72), ("8B", "W4A8_AWQ", 1, 64, 1930.86),
        ("70B", "NO_QUANT", 2, 1, 45.81), ("70B", "NO_QUANT", 2, 8, 182.61), ("70B", "NO_QUANT", 2, 64, 401.50),
        ("70B", "FP8", 1, 1, 43.46), ("70B", "FP8", 1, 8, 182.07), ("70B", "FP8", 1, 64, 420.64),
        ("70B", "W4A16_AWQ", 1, 1, 44.10), ("70B", "W4A16_AWQ", 1, 8, 93.98), ("70B", "W4A16_AWQ", 1, 64, 176.68),
        ("70B", "W4A8_AWQ", 1, 1, 46.31), ("70B", "W4A8_AWQ", 1, 8, 140.02), ("70B", "W4A8_AWQ", 1, 64, 345.43),
    )],
]

ORDER_TIE = 0.10
"""Two measurements closer than 10 % are a tie: their order is not asserted."""
BAR = {"median": (0.8, 1.3), "group": (0.6, 1.6)}


@lru_cache(maxsize=None)
def _arch(model: str):
    from precision_pipeline.spec.model_arch import read_model_arch

    return read_model_arch(MODELS[model])


def estimate(row: Row) -> dict:
    """The model's performance dict (``resolve.perf.performance``) for ``row``'s settings."""
    from precision_pipeline.resolve import perf
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile

    fs = FLOW_SETTINGS[row.flow]
    msl = row.isl + row.osl
    over = {"target": {"gpu": row.gpu}, "parallel": {"tp_size": row.tp},
            "quantization": {"quant_algo": row.quant_algo, "kv_cache_quant_algo": KV_FOR[row.quant_algo]},
            "deployment": {"gpus_per_replica": row.tp, "fallback": None, "warm_fallback": False},
            "build": {"max_batch_size": row.batch or fs["max_batch_size"], "max_input_len": row.isl, "max_seq_len": msl,
                      "max_num_tokens": fs["max_num_tokens"]},
            "runtime": {"kv_cache_free_gpu_mem_fraction": 0.95, "batch_scheduler_policy": "guaranteed_no_evict",
                        "enable_kv_cache_reuse": False}}
    base = {"NO_QUANT": "bf16-h100", "FP8": "fp8-h100", "NVFP4": "nvfp4-b200", "W4A16_AWQ": "int4-awq-a100",
            "W4A8_AWQ": "int4-awq-a100"}[row.quant_algo]
    raw = load_raw(base)
    raw.pop("gate", None)
    raw["quantization"].pop("exclude_modules", None)
    raw.pop("context_phase", None)
    prof = validate_profile(deep_merge(raw, over), f"planner row {row.group}")
    plan = P.evaluate(prof, _arch(row.model))
    if plan.memory is None or not plan.memory.fits:
        return {"fits_workload": False, "output_tokens_per_s_per_replica": 0.0,
                "problems": [p.reason for p in plan.problems]}
    return perf.of_plan(plan, perf.Workload(row.isl, row.osl, concurrency=row.batch))


def evaluate() -> list[tuple[Row, float, float]]:
    """(row, estimate, estimate/measured) for every row; estimate = output tokens/s of the engine."""
    out = []
    for r in ROWS:
        e = estimate(r)["output_tokens_per_s_per_replica"]
        out.append((r, e, e / r.measured))
    return out


def _geo_spread(ratios: list[float]) -> tuple[float, float, float]:
    return statistics.median(ratios), min(ratios), max(ratios)


def groups(results) -> dict[str, tuple[float, float, float, int]]:
    """group -> (median, min, max of estimate/measured, rows)."""
    by: dict[str, list[float]] = {}
    for r, _, q in results:
        by.setdefault(r.group, []).append(q)
    return {g: (*_geo_spread(v), len(v)) for g, v in by.items()}


def _pairs(items: list[tuple[str, float, float]]) -> tuple[int, int, list[str]]:
    """Pairs (a, b) whose measurements differ by more than ORDER_TIE: (in order, total, the ones out of order)."""
    ok = tot = 0
    bad = []
    for i in range(len(items)):
        for j in range(i + 1, len(items)):
            (na, ma, ea), (nb, mb, eb) = items[i], items[j]
            if abs(ma - mb) <= ORDER_TIE * max(ma, mb):
                continue
            tot += 1
            if (ma > mb) == (ea > eb):
                ok += 1
            else:
                bad.append(f"{na} vs {nb}")
    return ok, tot, bad


def order_checks(results) -> dict[str, tuple[int, int, list[str]]]:
    """tp: per-GPU throughput across tp at one (model, GPU, flow, workload); formats: per-GPU throughput across
    formats at one (model, GPU, flow, workload, batch)."""
    tp_sets: dict[tuple, list] = {}
    fmt_sets: dict[tuple, list] = {}
    for r, e, _ in results:
        tp_sets.setdefault((r.model, r.gpu, r.flow, r.quant_algo, r.isl, r.osl, r.batch), []).append(
            (f"{r.model} {r.gpu} {r.isl}/{r.osl} tp{r.tp}", r.measured / r.tp, e / r.tp))
        fmt_sets.setdefault((r.model, r.gpu, r.flow, r.isl, r.osl, r.batch), []).append(
            (f"{r.model} {r.gpu} b{r.batch} {r.quant_algo}", r.measured / r.tp, e / r.tp))
    out = {}
    for name, sets, key in (("tp", tp_sets, lambda it: len({x[0].rsplit(' ', 1)[1] for x in it}) > 1),
                            ("formats", fmt_sets, lambda it: len({x[0].rsplit(' ', 1)[1] for x in it}) > 1)):
        ok = tot = 0
        bad: list[str] = []
        for items in sets.values():
            if not key(items):
                continue
            a, b, c = _pairs(items)
            ok, tot, bad = ok + a, tot + b, bad + c
        out[name] = (ok, tot, bad)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="store_true", help="print every row, not only the groups")
    args = ap.parse_args(argv)
    results = evaluate()
    if args.rows:
        print(f"{'group':28} {'format':10} {'tp':>2} {'in/out':>11} {'batch':>5} {'measured':>10} {'estimate':>10} {'est/meas':>8}")
        for r, e, q in results:
            print(f"{r.group:28} {r.quant_algo:10} {r.tp:>2} {f'{r.isl}/{r.osl}':>11} {r.batch or 'max':>5} "
                  f"{r.measured:>10,.0f} {e:>10,.0f} {q:>8.2f}")
    g = groups(results)
    print(f"{'group (model/GPU/flow)':32} {'rows':>4} {'median':>7} {'min':>6} {'max':>6}")
    for name, (med, lo, hi, n) in g.items():
        print(f"{name:32} {n:>4} {med:>7.2f} {lo:>6.2f} {hi:>6.2f}")
    ratios = [q for _, _, q in results]
    med, lo, hi = _geo_spread(ratios)
    print(f"{'all':32} {len(ratios):>4} {med:>7.2f} {lo:>6.2f} {hi:>6.2f}")
    orders = order_checks(results)
    for name, (ok, tot, bad) in orders.items():
        print(f"{name} order: {ok}/{tot} pairs as measured (ties within {ORDER_TIE:.0%} not counted)"
              + (f"; out of order: {', '.join(bad[:6])}" + (" ..." if len(bad) > 6 else "") if bad else ""))
    gmeds = [v[0] for v in g.values()]
    worst = max(g.items(), key=lambda kv: abs(kv[1][0] - 1.0) if kv[1][0] >= 1 else abs(1 / kv[1][0] - 1.0))
    in_bar = (BAR["median"][0] <= med <= BAR["median"][1]
              and all(BAR["group"][0] <= m <= BAR["group"][1] for m in gmeds)
              and all(ok == tot for ok, tot, _ in orders.values()))
    print(f"rows={len(ratios)} groups={len(g)} median={med:.3f} min={lo:.3f} max={hi:.3f} "
          f"group_median_min={min(gmeds):.3f} group_median_max={max(gmeds):.3f} worst_group={worst[0]} "
          f"tp_pairs_in_order={orders['tp'][0]}/{orders['tp'][1]} formats_pairs_in_order={orders['formats'][0]}/"
          f"{orders['formats'][1]} within_bar={int(in_bar)}")
    return 0 if in_bar else 1


if __name__ == "__main__":
    sys.exit(main())
