"""The format registry (build/precision_pipeline/spec/formats.py): one entry per GEMM / KV format
with every fact filled, the old per-module tables reproduced from it, and no module outside the
registry (and the profile's enums) naming a format in a string literal.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from precision_pipeline.spec import formats as F
from precision_pipeline.spec.profile import KVCacheQuantAlgo, QuantAlgo

PKG = Path(__file__).resolve().parents[2] / "build" / "precision_pipeline"
REGISTRY_FILES = {"spec/formats.py", "spec/algos.py", "spec/profile.py"}  # the registry and the enums it is keyed by


def _sorted_disjoint(ranges) -> bool:
    flat = [x for lo, hi in ranges for x in (lo, hi)]
    return all(lo <= hi for lo, hi in ranges) and flat == sorted(flat) and len(set(flat)) == len(flat) - sum(
        1 for lo, hi in ranges if lo == hi)


# --------------------------------------------------------------------------------------------
# one entry per format, every fact filled


def test_one_gemm_entry_per_quant_algo():
    assert list(F.GEMM) == sorted(F.GEMM, key=list(F.GEMM).index)  # declaration order
    assert set(F.GEMM) == set(QuantAlgo) and len(F.GEMM) == len(QuantAlgo)
    for algo in QuantAlgo:
        assert F.GEMM[algo].algo is algo
        assert F.GEMM[algo.value] is F.GEMM[algo]  # by name too
    assert len({f.short for f in F.GEMM.values()}) == len(F.GEMM)


def test_one_kv_entry_per_kv_algo():
    assert set(F.KV) == set(KVCacheQuantAlgo) and len(F.KV) == len(KVCacheQuantAlgo)
    for algo in KVCacheQuantAlgo:
        assert F.KV[algo].algo is algo and F.KV[algo.value] is F.KV[algo]


def test_duplicate_entries_refused():
    with pytest.raises(ValueError, match="two entries"):
        F.FormatTable(QuantAlgo, [F.GEMM[QuantAlgo.FP8], F.GEMM[QuantAlgo.FP8]])
    with pytest.raises(KeyError):
        F.GEMM["INT2"]


@pytest.mark.parametrize("fmt", list(F.GEMM.values()), ids=lambda f: f.value)
def test_gemm_entry_facts_filled(fmt):
    from precision_pipeline.checkpoint.codecs import CODECS, FAKE_QUANT

    assert fmt.source and fmt.needs and fmt.label and fmt.short
    assert _sorted_disjoint(fmt.builds_on) and _sorted_disjoint(fmt.warn_on)
    assert all(any(lo >= blo and hi <= bhi for blo, bhi in fmt.builds_on) for lo, hi in fmt.warn_on)
    assert bool(fmt.refusal) == (not fmt.builds_on)  # never buildable <=> says why
    if fmt.per_layer:
        assert fmt.weight_bits is None and fmt.codec is None and not fmt.stored_dtype and fmt.search_bits is None
        return
    assert fmt.stored_dtype
    if fmt.is_quantized:
        assert fmt.weight_bits > 0 and fmt.modelopt_preset and fmt.modelopt_format or not fmt.exported
        assert fmt.scales.kind != "none"
        assert fmt.pack == (2 if fmt.weight_bits == 4 else 1)
        assert (fmt.grouping != "none") == (fmt.scales.kind in ("per_group", "per_block", "per_mx_block"))
    else:
        assert fmt.weight_bits is None and fmt.scales.kind == "none" and fmt.modelopt_preset is None
    assert fmt.codec in CODECS or (fmt.codec is None and not fmt.exported)
    assert fmt.act_fake_quant is None or fmt.act_fake_quant in FAKE_QUANT
    if fmt.search_bits is not None:
        assert fmt.is_quantized and fmt.exported and 0 < fmt.search_bits < F.UNQUANTIZED_SEARCH_BITS
    if fmt.auto_gemm_plugin is not None:
        assert fmt.auto_gemm_plugin[0] and fmt.auto_gemm_plugin[1]


@pytest.mark.parametrize("fmt", list(F.KV.values()), ids=lambda f: f.value)
def test_kv_entry_facts_filled(fmt):
    from precision_pipeline.checkpoint.codecs import FAKE_QUANT

    assert fmt.source and fmt.needs and fmt.label and fmt.builds_on and _sorted_disjoint(fmt.builds_on)
    assert fmt.bytes_per_element > 0
    if fmt.is_quantized:
        assert fmt.fake_quant in FAKE_QUANT and fmt.bytes_per_element < 2
        assert bool(fmt.modelopt_preset) != bool(fmt.not_exported)  # exported with a preset, or says why not
    else:
        assert fmt.modelopt_preset is None and fmt.not_exported is None and fmt.bytes_per_element == 2.0


# --------------------------------------------------------------------------------------------
# the registry reproduces the tables that lived in six modules before


def test_registry_reproduces_the_old_tables():
    G = F.GEMM
    # quantize/ptq.py MAIN_CONFIGS (MIXED_PRECISION: the search, no single preset)
    assert {f.value: f.modelopt_preset for f in G.values() if f.exported and not f.per_layer} == {
        "FP8": "FP8_DEFAULT_CFG", "NVFP4": "NVFP4_DEFAULT_CFG", "W4A16_AWQ": "INT4_AWQ_CFG", "W4A8_AWQ": "W4A8_AWQ_BETA_CFG",
        "W8A8_SQ_PER_CHANNEL": "INT8_SMOOTHQUANT_CFG", "W8A16": "INT8_WEIGHT_ONLY_CFG", "NO_QUANT": None}
    # quantize/ptq.py KV_CONFIGS
    assert {k.value: k.modelopt_preset for k in F.KV.values()} == {"NONE": None, "FP8": "FP8_KV_CFG", "NVFP4": "NVFP4_KV_CFG",
                                                                   "INT8": None}
    assert F.KV[KVCacheQuantAlgo.INT8].not_exported == F.INT8_KV_NOT_EXPORTED
    # quantize/search.py CANDIDATES, ALIASES, CUDA_ONLY, _MODELOPT_FORMAT
    from precision_pipeline.quantize import search

    assert search.CANDIDATES == {"FP8": ("FP8_DEFAULT_CFG", 8), "W4A16_AWQ": ("INT4_AWQ_CFG", 4), "NVFP4": ("NVFP4_DEFAULT_CFG", 4)}
    assert F.SEARCH_ALIASES == {"INT4_AWQ": "W4A16_AWQ", "INT4_AWQ_CFG": "W4A16_AWQ", "FP8_DEFAULT_CFG": "FP8",
                                "NVFP4_DEFAULT_CFG": "NVFP4"}
    assert [f.value for f in G.values() if f.search_cuda_only] == ["NVFP4"]
    assert search.MODELOPT_FORMAT == {None: "NO_QUANT", "fp8": "FP8", "int4_awq": "W4A16_AWQ", "w4a8_awq": "W4A8_AWQ",
                                      "int8_wo": "W8A16", "int8_sq": "W8A8_SQ_PER_CHANNEL", "nvfp4": "NVFP4",
                                      "w4a8_mxfp4_fp8": "W4A8_MXFP4_FP8", "mxfp8": "MXFP8"}
    # checkpoint/reader.py _STORED, _ACT_FORMAT, _NEEDS_ACT_SCALE, _PACKED_PER_BYTE, SINGLE_ALGOS
    from precision_pipeline.checkpoint import reader
    from precision_pipeline.gate import model as gate_model

    assert {f.value: f.stored_dtype for f in G.values() if f.codec} == {
        "FP8": ("F8_E4M3",), "NVFP4": ("U8",), "W4A16_AWQ": ("I8",), "W4A8_AWQ": ("I8",),
        "W8A8_SQ_PER_CHANNEL": ("I8",), "W8A16": ("I8",), "NO_QUANT": ("BF16", "F16", "F32"),
        "W4A16_MXFP4": ("U8",), "W4A8_MXFP4_FP8": ("U8",), "W4A8_MXFP4_MXFP8": ("U8",)}  # issue 29: the MXFP4 codec
    assert {f.value: f.act_fake_quant for f in G.values() if f.act_fake_quant} == {
        "FP8": "fp8", "W4A8_AWQ": "fp8", "W8A8_SQ_PER_CHANNEL": "int8", "NVFP4": "nvfp4", "W4A8_MXFP4_FP8": "fp8"}
    assert gate_model.act_fake_quant("W4A16_AWQ") is None and gate_model.act_fake_quant(None) is None
    assert {f.value for f in G.values() if f.needs_act_scale} == {"FP8", "NVFP4", "W8A8_SQ_PER_CHANNEL", "W4A8_AWQ",
                                                                  "W4A8_MXFP4_FP8"}
    assert {f.value: f.pack for f in G.values() if f.pack > 1 and f.codec} == {
        "W4A16_AWQ": 2, "W4A8_AWQ": 2, "NVFP4": 2, "W4A16_MXFP4": 2, "W4A8_MXFP4_FP8": 2, "W4A8_MXFP4_MXFP8": 2}
    assert set(reader.SINGLE_ALGOS) == {"NO_QUANT", "FP8", "NVFP4", "W4A16_AWQ", "W4A8_AWQ", "W8A8_SQ_PER_CHANNEL", "W8A16",
                                        "W4A16_MXFP4", "W4A8_MXFP4_FP8", "W4A8_MXFP4_MXFP8"}
    assert set(gate_model.KV_FAKE_QUANT) == {"fp8", "int8"}  # NVFP4 KV is refused by the CPU model
    # spec/formats.py's own derived tables and resolve/rules.py's branches
    assert F.SUGGEST_ORDER == ("FP8", "NVFP4", "W4A8_AWQ", "W8A8_SQ_PER_CHANNEL", "W4A16_AWQ", "NO_QUANT")
    assert F.FP8_CONTEXT_FMHA_ALGOS == ("FP8", "W4A8_AWQ", "NVFP4")
    assert F.AWQ_ALGOS == ("W4A16_AWQ", "W4A8_AWQ")
    assert F.KV_BYTES == {"NONE": 2.0, "FP8": 1.0, "INT8": 1.0, "NVFP4": 0.5 + 1 / 16}
    assert {f.value for f in G.values() if f.fused_mlp} == {"FP8", "MIXED_PRECISION"}
    assert {f.value: f.auto_gemm_plugin[0] for f in G.values() if f.auto_gemm_plugin} == {"FP8": "disable", "NVFP4": "nvfp4"}
    assert {f.value: f.own_gemm_plugin for f in G.values() if f.own_gemm_plugin} == {"FP8": "fp8", "NVFP4": "nvfp4"}
    assert {f.value for f in G.values() if f.grouping == "fixed_block"} == {"NVFP4", "W4A16_NVFP4"}
    assert {k.value for k in F.KV.values() if not k.paged_context_fmha} == {"INT8"}
    assert {k.value for k in F.KV.values() if k.fp8_context_fmha} == {"FP8"}
    # serving/pack.py's Triton logits types
    from precision_pipeline.serving import pack

    assert pack._DTYPE_TO_TRITON is F.TRITON_DTYPE


@pytest.mark.parametrize("algo,group,bits,want", [
    ("FP8", None, None, 576 * 960 + 8),
    ("NVFP4", None, None, 576 * 960 / 2 + 576 * 960 / 16 + 8),
    ("W4A16_NVFP4", None, None, 576 * 960 / 2 + 576 * 960 / 16 + 8),
    ("W4A16_AWQ", 64, None, 480 * 576 + 960 * 9 * 4 + 576 * 2),
    ("W4A16_AWQ", None, None, 480 * 576 + 960 * 5 * 4 + 576 * 2),  # default group 128: ceil(576/128) = 5
    ("W4A8_AWQ", 64, None, 480 * 576 + 960 * 9 * 4 + 576 * 2 + 8),
    ("W8A8_SQ_PER_CHANNEL", None, None, 576 * 960 + 960 * 4 + 4 + 576 * 2),
    ("W8A16", None, None, 576 * 960 + 960 * 4),
    ("MIXED_PRECISION", None, 6.0, 576 * 960 * 6 / 8),
    ("MIXED_PRECISION", None, None, 576 * 960),
    ("NO_QUANT", None, None, 576 * 960 * 2),
])
def test_linear_bytes_per_entry(algo, group, bits, want):
    assert F.GEMM[algo].linear_bytes(576, 960, group, 2, bits) == want
    assert F.linear_weight_bytes(algo, 576, 960, group, 2, bits) == want


# --------------------------------------------------------------------------------------------
# nothing outside the registry names a format


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def format_literals(source: str) -> list[tuple[int, str]]:
    """(line, value) of every string constant in ``source`` equal to a format name (a
    ``QuantAlgo`` or ``KVCacheQuantAlgo`` value), docstrings excepted. Messages may mention
    formats (a longer string, or an f-string part); comparisons, dict keys, defaults and tuples of
    names may not."""
    names = {e.value for e in QuantAlgo} | {e.value for e in KVCacheQuantAlgo}
    tree = ast.parse(source)
    docs = _docstrings(tree)
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in names and id(n) not in docs]


def test_format_literal_scan_catches_branches():
    bad = 'def f(algo, kv):\n    """FP8"""\n    if algo == "MIXED_PRECISION":\n        return {"FP8": 1}.get(kv, "NONE")\n'
    assert sorted(format_literals(bad)) == [(3, "MIXED_PRECISION"), (4, "FP8"), (4, "NONE")]
    assert format_literals('raise E(f"quant_algo {a} needs MIXED_PRECISION", "use FP8 or NVFP4.")') == []


def test_no_module_outside_the_registry_names_a_format():
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel in REGISTRY_FILES:
            continue
        hits = format_literals(path.read_text(encoding="utf-8"))
        if hits:
            found[rel] = hits
    assert found == {}, f"format names as string literals outside spec/formats.py: {found}"


# --------------------------------------------------------------------------------------------
# import layering of the format consumers


def _private_imports(path: Path) -> list[str]:
    """``from precision_pipeline.x import _name`` in ``path`` (a private name of another module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("precision_pipeline"):
            out += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    return out


@pytest.mark.parametrize("rel", ["spec/formats.py", "resolve/rules.py", "quantize/ptq.py", "quantize/search.py",
                                 "spec/families.py", "checkpoint/reader.py", "checkpoint/codecs.py", "serving/pack.py"])
def test_no_private_imports_across_modules(rel):
    assert _private_imports(PKG / rel) == []


def test_imports_go_one_way_and_resolve_needs_no_stage():
    """search does not import ptq (ptq imports search); resolving a MIXED_PRECISION plan imports
    neither the quantize stage nor torch."""
    code = ("import sys\n"
            "import precision_pipeline.quantize.search\n"
            "assert 'precision_pipeline.quantize.ptq' not in sys.modules, 'search imports ptq'\n"
            "from precision_pipeline.resolve import plan\n"
            "from precision_pipeline.spec.model_arch import arch_from_config\n"
            "from precision_pipeline.spec.profile import load_profile\n"
            "for m in [k for k in sys.modules if k.startswith('precision_pipeline.quantize')]: del sys.modules[m]\n"
            "arch = arch_from_config({'architectures': ['LlamaForCausalLM'], 'num_hidden_layers': 30, 'hidden_size': 576,"
            " 'num_attention_heads': 9, 'num_key_value_heads': 3, 'head_dim': 64, 'intermediate_size': 1536,"
            " 'vocab_size': 49152, 'max_position_embeddings': 8192, 'tie_word_embeddings': True}, name='m')\n"
            "p = plan.evaluate(load_profile('mixed-fp8-int4-h100'), arch)\n"
            "print(sorted(k for k in sys.modules if k.startswith('precision_pipeline.quantize') or k == 'torch'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PKG.parent, check=True)
    assert out.stdout.strip() == "[]"
