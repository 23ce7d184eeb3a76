"""Which format runs where: one table keyed by route x TensorRT-LLM line x GPU (SM) x format, each row with its source.

``supports(route, version, kind, algo, sm)`` is the one question the resolve rules ask (``format.gemm_sm``,
``format.kv_sm``, ``route.trtllm_version``). The ``engine`` route's rows are the format registry's own SM ranges
(``spec/formats.py`` ``GemmFormat.builds_on`` / ``KvFormat.builds_on``: what trtllm-build 1.2 accepts), so those facts
keep their one home; the ``llm_api`` rows are the PyTorch backend's "Hardware Support Matrix" (below). Adding a line or
a route = rows here.

``llm_api`` rows (TensorRT-LLM ``docs/source/features/quantization.md``, "Hardware Support Matrix", read at commit
09d4c79ba941a5c2c62c878c3572c0dcc8b85efa; the PyTorch backend):

| architecture | formats |
|---|---|
| Blackwell SM 100/103 | NVFP4, MXFP4, FP8 per-tensor, FP8 block, FP8 KV |
| Blackwell SM 120 | NVFP4, MXFP4, FP8 per-tensor, FP8 KV |

MXFP4 per QuantAlgo (MoE experts; ``F.SRC_MX_MOE``): W4A16_MXFP4 SM 90 (Hopper, gpt-oss's path there),
W4A8_MXFP4_FP8 SM 100/103, W4A8_MXFP4_MXFP8 SM 100/103/120/121; MXFP8 SM 100/103 on the 1.3 line only (not a 1.2
QuantAlgo). The engine route builds none of them (``F.SRC_MX_ENGINE``).
| Hopper SM 90 | FP8 (tensor, block, row), FP8 KV, W4A8/W4A16 AWQ and GPTQ |
| Ada SM 89 | FP8, FP8 KV, W4A8/W4A16 AWQ and GPTQ |
| Ampere SM 80-87 | FP8 KV, W4A16 AWQ/GPTQ |

No INT8 recipe is listed (INT8 SmoothQuant and INT8 weight-only have no PyTorch-backend path; ModelOpt exports INT8
SmoothQuant only as a TensorRT-LLM checkpoint, ModelOpt PR #345) and ``kv_cache_config.dtype`` has no INT8
(``spec/llm_args.py`` ``KV_CACHE_DTYPES``). NVFP4 KV on Blackwell: ``kv_cache_config.dtype: nvfp4``
(``tensorrt_llm/_torch/pyexecutor/model_loader.py``). W4A16 AWQ is not listed for Blackwell.

Model families (``FAMILY_TABLE``, ``family_row``): which routes and lines run each family of the model-family
registry and with which formats (rows from ``Family.routes``; a family x route x format without a row is refused at
``invoke check``, rule ``model.family_route``, naming where it runs).

Routes and lines (``ROUTE_LINES``): the engine route needs ``trtllm-build``, which exists through the 1.2 line only
(removed on main by PR #15918/#16369, shared/reference/upstream-2026-12.md); the LLM-API route runs on 1.2.1 (Triton's
LLM-API backend) and on 1.3.0rcN (trtllm-serve).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from precision_pipeline.spec import families as FAM
from precision_pipeline.spec import formats as F
from precision_pipeline.spec.algos import KVCacheQuantAlgo, QuantAlgo
from precision_pipeline.spec.llm_args import trtllm_line

ANY = F.ANY
ROUTES = ("engine", "llm_api")
SRC_PYTORCH_MATRIX = ("tensorrt_llm docs/source/features/quantization.md (Hardware Support Matrix, PyTorch backend; "
                      "commit 09d4c79)")
SRC_NO_INT8 = (SRC_PYTORCH_MATRIX + "; no INT8 recipe on the PyTorch backend (ModelOpt PR #345: INT8 SmoothQuant exports "
               "only as a TensorRT-LLM checkpoint)")
SRC_KV_DTYPE = "tensorrt_llm/_torch/pyexecutor/model_loader.py (kv_cache_config.dtype: auto, fp8, nvfp4; no INT8, PR #18953)"
SRC_ROUTE_LINES = ("shared/reference/upstream-2026-12.md (trtllm-build removed after 1.2: PR #15918, #16369); "
                   "shared/reference/llm-api-route.md (Triton 1.2.1 LLM-API model.yaml; trtllm-serve on 1.3.0rcN)")

ROUTE_LINES: dict[str, tuple[str, ...]] = {"engine": ("1.2",), "llm_api": ("1.2", "1.3")}
"""Route -> the TensorRT-LLM lines it runs on."""

ROUTE_NEEDS = {
    "engine": "Triton's trtllm-python-py3 image with TensorRT-LLM 1.2.1 (trtllm-build and the tensorrtllm backend)",
    "llm_api": "Triton's LLM-API backend (trtllm-python-py3, TensorRT-LLM 1.2.1) or trtllm-serve (TensorRT-LLM 1.3.0rcN)",
}
"""What each route needs at serving time (README "What runs where")."""


@dataclass(frozen=True)
class Row:
    """One capability row: on ``route`` with TensorRT-LLM ``lines``, format ``algo`` (``kind`` gemm or kv) runs on
    SM ``sm`` (inclusive ranges; empty: nowhere), per ``source``; ``why`` says why not when ``sm`` is empty."""

    route: str
    lines: tuple[str, ...]
    kind: Literal["gemm", "kv"]
    algo: str
    sm: F.SmRanges
    source: str
    why: str = ""


_L = ("1.2", "1.3")
_BLACKWELL_FP4 = ((100, 100), (103, 103), (120, 121))
_Q, _K = QuantAlgo, KVCacheQuantAlgo
_LLM_API_ROWS = (
    Row("llm_api", _L, "gemm", _Q.NO_QUANT.value, ((80, ANY),), SRC_PYTORCH_MATRIX),
    Row("llm_api", _L, "gemm", _Q.FP8.value, ((89, ANY),), SRC_PYTORCH_MATRIX),
    Row("llm_api", _L, "gemm", _Q.NVFP4.value, _BLACKWELL_FP4, SRC_PYTORCH_MATRIX),
    Row("llm_api", _L, "gemm", _Q.W4A8_AWQ.value, ((89, 90),), SRC_PYTORCH_MATRIX),
    Row("llm_api", _L, "gemm", _Q.W4A16_AWQ.value, ((80, 90),), SRC_PYTORCH_MATRIX),
    Row("llm_api", _L, "gemm", _Q.W8A8_SQ_PER_CHANNEL.value, (), SRC_NO_INT8,
        why="INT8 SmoothQuant has no path on the PyTorch backend"),
    Row("llm_api", _L, "gemm", _Q.W8A16.value, (), SRC_NO_INT8, why="INT8 weight-only has no path on the PyTorch backend"),
    Row("llm_api", _L, "gemm", _Q.W4A16_NVFP4.value, (), SRC_PYTORCH_MATRIX,
        why="W4A16_NVFP4 is not in the PyTorch backend's matrix"),
    # MX formats (MoE experts; the CUTLASS MoE backend's table, spec/formats.py SRC_MX_MOE). MXFP8 is not a 1.2 name.
    Row("llm_api", _L, "gemm", _Q.W4A16_MXFP4.value, ((90, 90),), F.SRC_MX_MOE),
    Row("llm_api", _L, "gemm", _Q.W4A8_MXFP4_FP8.value, ((100, 100), (103, 103)), F.SRC_MX_MOE),
    Row("llm_api", _L, "gemm", _Q.W4A8_MXFP4_MXFP8.value, _BLACKWELL_FP4, F.SRC_MX_MOE),
    Row("llm_api", ("1.3",), "gemm", _Q.MXFP8.value, ((100, 100), (103, 103)), F.SRC_MX_MOE),
    Row("llm_api", _L, "gemm", _Q.MIXED_PRECISION.value, ((80, ANY),),
        SRC_PYTORCH_MATRIX + "; each candidate format must run (quant_cfg.json per layer)"),
    Row("llm_api", _L, "kv", _K.NONE.value, ((80, ANY),), SRC_PYTORCH_MATRIX),
    Row("llm_api", _L, "kv", _K.FP8.value, ((80, ANY),), SRC_PYTORCH_MATRIX),
    Row("llm_api", _L, "kv", _K.NVFP4.value, _BLACKWELL_FP4, SRC_KV_DTYPE),
    Row("llm_api", _L, "kv", _K.INT8.value, (), SRC_KV_DTYPE, why="the PyTorch backend has no INT8 KV cache"),
)


def _engine_rows() -> tuple[Row, ...]:
    """The engine route's rows: the format registry's trtllm-build 1.2 SM ranges and sources (one home)."""
    rows = [Row("engine", ("1.2",), "gemm", f.value, f.builds_on, f.source, why=f.refusal or f.needs) for f in F.GEMM.values()]
    rows += [Row("engine", ("1.2",), "kv", f.value, f.builds_on, f.source, why=f.needs) for f in F.KV.values()]
    return tuple(rows)


TABLE: tuple[Row, ...] = _engine_rows() + _LLM_API_ROWS
"""Every row (route x line x kind x format -> SM ranges, source)."""

_INDEX = {(r.route, line, r.kind, r.algo): r for r in TABLE for line in r.lines}


def row(route: str, version: str, kind: str, algo) -> Optional[Row]:
    """The row of (route, ``version``'s line, kind, algo) or None (no facts: the route does not run that line).
    ``version`` is a ``target.trtllm_version`` string; ``algo`` a QuantAlgo / KVCacheQuantAlgo or its value."""
    try:
        line = trtllm_line(version)
    except ValueError:
        return None
    return _INDEX.get((route, line, kind, getattr(algo, "value", algo)))


def supports(route: str, version: str, kind: str, algo, sm: int) -> bool:
    """Whether ``algo`` runs on SM ``sm`` on ``route`` with TensorRT-LLM ``version`` (False without a row)."""
    r = row(route, version, kind, algo)
    return r is not None and any(lo <= sm <= hi for lo, hi in r.sm)


def runnable(route: str, version: str, kind: str, sm: int) -> list[str]:
    """Format values of ``kind`` that run on ``sm`` on ``route`` / ``version``, in table order."""
    return [r.algo for r in TABLE if r.route == route and r.kind == kind and supports(route, version, kind, r.algo, sm)]


def where_supported(kind: str, algo) -> str:
    """Where ``algo`` runs, in words, from every row with SM ranges: e.g. 'route llm_api (TensorRT-LLM 1.2, 1.3) on
    SM 90'; '' when no row has any."""
    value = getattr(algo, "value", algo)
    parts = [f"route {r.route} (TensorRT-LLM {', '.join(r.lines)}) on {F.sm_text(r.sm)}"
             for r in TABLE if r.kind == kind and r.algo == value and r.sm]
    return F.join_or(parts)


def refusal_on_route(route: str, version: str, fmt) -> str:
    """Why GEMM format ``fmt`` (a ``GemmFormat``), which trtllm-build cannot build at all (``fmt.refusal``), is refused
    on ``route`` / ``version`` whatever the GPU; '' when the route runs it on some SM, or when ``fmt`` is an engine format
    (the SM rule ``format.gemm_sm`` then names the alternatives). The engine route: the registry's ``refusal``; another
    route: its row's ``why`` when the row runs nowhere, or that the route's line has no row for it."""
    if route == "engine" or not fmt.refusal:
        return fmt.refusal
    r = row(route, version, "gemm", fmt.algo)
    if r is not None and r.sm:
        return ""
    if r is not None:
        return r.why or fmt.refusal or f"{fmt.value} runs on no SM on the {route} route"
    return f"{fmt.value} is not taken by the {route} route with TensorRT-LLM {version} ({fmt.needs})"


def route_runs_line(route: str, version: str) -> bool:
    """Whether ``route`` runs on ``version``'s TensorRT-LLM line (``ROUTE_LINES``)."""
    try:
        return trtllm_line(version) in ROUTE_LINES.get(route, ())
    except ValueError:
        return False


# -- model families x route x line x format (issue 29)


@dataclass(frozen=True)
class FamilyRow:
    """Model family ``architecture`` runs on ``route`` with TensorRT-LLM ``lines`` in every format that route's rows
    run (``formats`` None) or only ``formats``; per ``source`` (the family's ``sources["routes"]``)."""

    architecture: str
    route: str
    lines: tuple[str, ...]
    source: str
    formats: Optional[tuple[str, ...]] = None


def _family_rows() -> tuple[FamilyRow, ...]:
    """One row per family and route it runs on: the model-family registry's ``Family.routes`` (``spec/families.py``,
    with its sources; one home) on each route's lines (``ROUTE_LINES``). A (family, route) without a row is refused."""
    return tuple(FamilyRow(f.architecture, route, ROUTE_LINES[route], f.sources.get("routes", FAM.SRC_HF))
                 for f in FAM.FAMILIES.values() for route in f.routes)


FAMILY_TABLE: tuple[FamilyRow, ...] = _family_rows()
"""Every (family, route) row: which routes and TensorRT-LLM lines run each model family, and with which formats."""


def family_row(architecture: str, route: str, version: str, algo) -> Optional[FamilyRow]:
    """The row that runs ``architecture`` on ``route`` / ``version``'s line in format ``algo`` (a QuantAlgo or its value),
    or None: TensorRT-LLM does not run that combination (``family_support`` says where it does)."""
    try:
        line = trtllm_line(version)
    except ValueError:
        return None
    value = getattr(algo, "value", algo)
    return next((r for r in FAMILY_TABLE if r.architecture == architecture and r.route == route and line in r.lines
                 and (r.formats is None or value in r.formats)), None)


def family_support(architecture: str, algo) -> list[str]:
    """Where ``architecture`` runs in format ``algo``: ``["route engine (TensorRT-LLM 1.2)", ...]`` (empty: nowhere)."""
    value = getattr(algo, "value", algo)
    return [f"route {r.route} (TensorRT-LLM {', '.join(r.lines)})" for r in FAMILY_TABLE
            if r.architecture == architecture and (r.formats is None or value in r.formats)]


__all__ = ["ROUTES", "ROUTE_LINES", "ROUTE_NEEDS", "Row", "TABLE", "row", "supports", "runnable", "route_runs_line",
           "where_supported", "refusal_on_route",
           "SRC_PYTORCH_MATRIX", "SRC_ROUTE_LINES",
           "FamilyRow", "FAMILY_TABLE", "family_row", "family_support"]
