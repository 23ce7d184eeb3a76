"""Reader of exported TensorRT-LLM checkpoints: headers, formats, dequantize, reassemble ranks.

A checkpoint directory holds ``config.json`` and ``rank{0..world_size-1}.safetensors`` (written by
``modelopt.torch.export.export_tensorrt_llm_checkpoint``). Everything here uses ONLY the
checkpoint's numbers: the HF model folder passed to the gate's ``gate.model.load_checkpoint_model`` (the
torch model that runs what a checkpoint says; it reads the checkpoint with ``dequantize_checkpoint``) supplies the
architecture config (and the caller's tokenizer), never weights. Every parameter of the built
model must come from the checkpoint (the model is built on the ``meta`` device and every tensor
is assigned), and every checkpoint tensor must be used; otherwise ``UserError("checkpoint", ...)``.

Tensor names (Llama, ``modelopt/torch/export/layer_utils.py`` / ``model_config_export.py``) and
how tensor parallelism splits them (``modelopt/torch/export/distribute.py`` + ``model_config_utils.py``;
checked by exporting with ``inference_tensor_parallel=3`` and comparing with tp 1):

===================================================  ========================  =======================
TRT-LLM name                                          HF Llama module           split over tp ranks
===================================================  ========================  =======================
``transformer.vocab_embedding.weight``                ``model.embed_tokens``     dim 0 (vocab) if ``use_parallel_embedding`` and ``embedding_sharding_dim == 0``, dim 1 if 1, else replicated
``transformer.layers.N.input_layernorm.weight``       ``input_layernorm``        replicated
``transformer.layers.N.attention.qkv.*``              ``q_proj``/``k_proj``/``v_proj``   rows ``[q_r; k_r; v_r]`` per rank (q heads/tp, kv heads/tp each)
``transformer.layers.N.attention.dense.*``            ``o_proj``                 dim 1 (input)
``transformer.layers.N.post_layernorm.weight``        ``post_attention_layernorm``  replicated
``transformer.layers.N.mlp.fc.*``                     ``gate_proj`` (SiLU side)  dim 0 (output)
``transformer.layers.N.mlp.gate.*``                   ``up_proj``                dim 0 (output)
``transformer.layers.N.mlp.proj.*``                   ``down_proj``              dim 1 (input)
``transformer.ln_f.weight``                           ``model.norm``             replicated
``lm_head.weight``                                    ``lm_head``                dim 0 (vocab)
===================================================  ========================  =======================

``mlp.fc`` = ``gate_proj`` and ``mlp.gate`` = ``up_proj`` was verified empirically: FP8-dequantized
``mlp.fc`` differs from HF ``gate_proj`` by at most the FP8 rounding (0.11 max on layer 0) and from
``up_proj`` by 4.4.

Dequantization (bit layouts; every rank is dequantized with its own scales, then ranks are
concatenated, so per-rank scales are honoured):

* **FP8** (``quant_algo FP8``; ``to_quantized_weight`` in ``modelopt/torch/export/quant_utils.py``):
  ``weight`` F8_E4M3 ``[out, in]``, ``weights_scaling_factor`` F32 ``[1]`` (= weight amax / 448);
  ``w = fp8.float() * weights_scaling_factor``. E4M3: 1 sign, 4 exponent (bias 7), 3 mantissa bits,
  no infinities, max 448; e.g. ``0x38 = 0 0111 000 = 1.0``, ``0x7E = 448``, ``0x01 = 2**-9``.
* **NVFP4** (``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``, ``quantize``/``dequantize``):
  ``weight`` U8 ``[out, in/2]``: byte ``j`` of a row holds element ``2j`` in the LOW nibble and
  element ``2j+1`` in the HIGH nibble (``packed = (q[..., 1::2] << 4) | q[..., 0::2]``). Each nibble
  is E2M1: bit 3 sign, bits 2..0 index into ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]`` (``0b0111 = 6.0``,
  ``0b1001 = -0.5``). ``weights_scaling_factor`` F8_E4M3 ``[out, in/16]`` (one per 16 elements),
  ``weights_scaling_factor_2`` F32 scalar (= amax / (6 * 448));
  ``w = e2m1 * (sf.float() * sf2)`` block by block.
* **W4A16_AWQ / W4A8_AWQ** (``pack_int4_in_uint8`` in ``modelopt/torch/export/quant_utils.py``):
  ``weight`` I8 ``[out/2, in]``, packed along the OUTPUT dim: byte ``[r, c]`` holds signed int4
  ``q[2r, c]`` in the LOW nibble and ``q[2r+1, c]`` in the HIGH nibble (two's complement, -8..7).
  ``weights_scaling_factor`` ``[out, in/group_size]``; ``w[o, i] = q[o, i] * s[o, i // group]``.
  W4A8_AWQ also has ``weights_scaling_factor_2`` F32 ``[1]`` (per-tensor FP8 scale of the
  dequantized INT4 weight: ``w = fp8(q*s/s2)*s2``, see ``_dequant_int4``) and ``activation_scaling_factor``. ``prequant_scaling_factor``
  ``[in]`` multiplies the activations: ``y = (x * pre) @ W^T`` (AWQ folds ``1/pre`` into ``W``).
* **W8A8_SQ_PER_CHANNEL / W8A16**: ``weight`` I8 ``[out, in]``, ``weights_scaling_factor`` F32
  ``[out]``; ``w = q * s[:, None]``. SmoothQuant also has ``prequant_scaling_factor`` ``[in]``
  (``y = q8(x * pre) @ W^T``) and a per-tensor ``activation_scaling_factor`` (= amax / 127).
* Unquantized tensors (BF16/F16/F32) are cast to float32.

Activation fake-quant that the gate's model (``gate/model.py``) applies on the input of each quantized linear:
FP8 (FP8, W4A8_AWQ): ``fp8(clamp(x / s, -448, 448)) * s`` with ``s = activation_scaling_factor``;
INT8 (W8A8_SQ): ``clamp(round(x / s), -128, 127) * s``; NVFP4: dynamic blocks of 16 along the input
dim, block scale ``fp8(amax_b / 6 / s2)`` (clamped to [2**-9, 448]), ``s2 = activation_scaling_factor``,
values rounded to E2M1 (half to even). KV cache FP8 (INT8 likewise, ``round(x/s)``
clamped to -128..127; NVFP4 KV is refused): keys (after RoPE) and values are fake-quantized
with ``k_cache_scaling_factor`` / ``v_cache_scaling_factor`` inside a custom attention function
(registered in ``transformers.AttentionInterface`` as ``"trtllm_kvq_sdpa"``) before SDPA. Query/softmax
FP8 (``use_fp8_context_fmha``) is a build-time choice and is not modelled.

**MIXED_PRECISION** (``mtq.auto_quantize`` export; TensorRT-LLM 1.2 ``QuantConfig`` /
``LayerQuantConfig`` in ``tensorrt_llm/models/modeling_utils.py`` read the same file):
``config.json`` says ``quant_algo: MIXED_PRECISION`` and ``quant_cfg.json`` beside it lists
``quantized_layers`` = ``{TRT-LLM module name: {"quant_algo": ..., "group_size": ...}}``. Each
listed linear is read with its own format (and its own activation fake-quant); a linear not listed
is stored unquantized. Formats inside a MIXED_PRECISION checkpoint: every single format above.
``kv_cache_quant_algo`` comes from ``quant_cfg.json`` (else ``config.json``).
"""

from __future__ import annotations

import fnmatch
import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from precision_pipeline.checkpoint import codecs
from precision_pipeline.checkpoint.codecs import (  # noqa: F401  (the element functions are part of this module's API)
    E2M1_VALUES, FAKE_QUANT, FIELD, FP8_MAX, QUANTIZED_DTYPES, e2m1_to_float, fake_quant_fp8, fake_quant_int8,
    fake_quant_nvfp4, fp8_e4m3_to_float, round_e2m1, unpack_int4_rows, unpack_nvfp4)
from precision_pipeline.core.errors import UserError
from precision_pipeline.spec import formats as FMT
from precision_pipeline.spec.profile import KVCacheQuantAlgo, QuantAlgo
from precision_pipeline.spec.families import COLUMN, GATE_ARCHITECTURES, LLAMA, qkv_rows_of_config

NO_QUANT = QuantAlgo.NO_QUANT.value
KV_NONE = KVCacheQuantAlgo.NONE.value



def _merge_kind(trt: str) -> str:
    """How ``merge_linear`` joins GEMM ``trt``'s rank slices: ``qkv`` (a column GEMM of several HF linears,
    rows ``[q_r; k_r; v_r]`` per rank), ``col`` or ``row`` (``spec.families``: the family's parallel kinds)."""
    if LLAMA.parallel(trt) == COLUMN:
        return "qkv" if len(LLAMA.gemm_hf(trt)) > 1 else "col"
    return "row"


# per-linear TRT-LLM name -> merge kind, from the model-family registry (every family the gate reads has the
# Llama layout: spec/families.py GATE_ARCHITECTURES)
_LINEARS = {trt: _merge_kind(trt) for trt in LLAMA.gemms}
# scale tensors of a quantized linear (``<linear>.<suffix>``) and of an attention's KV cache
# (``transformer.layers.N.attention.<name>``; ``kv_cache_scaling_factor`` stands for both when the
# k/v ones are absent), as ModelOpt 0.47 names them (modelopt/torch/export/layer_utils.py)
SCALE_SUFFIXES = ("weights_scaling_factor", "weights_scaling_factor_2", "activation_scaling_factor",
                  "prequant_scaling_factor")
KV_SCALE_NAMES = ("k_cache_scaling_factor", "v_cache_scaling_factor", "kv_cache_scaling_factor")


def is_scale_tensor(name: str) -> bool:
    """Whether checkpoint tensor ``name`` is a scale (its last component is one of ``SCALE_SUFFIXES``
    or ``KV_SCALE_NAMES``)."""
    return name.rsplit(".", 1)[-1] in SCALE_SUFFIXES + KV_SCALE_NAMES


LINEAR_NAMES = tuple(_LINEARS)
"""TRT-LLM names of a decoder layer's linears (``transformer.layers.N.<name>``), in layer order."""


# --------------------------------------------------------------------------------------------
# Layout

HF_QUANT_CONFIG = "hf_quant_config.json"
"""ModelOpt's unified HF export writes it at the checkpoint's root (``modelopt/torch/export/unified_export_hf.py``
``_write_hf_export_config``); a TensorRT-LLM checkpoint has none."""


def checkpoint_layout(ckpt_dir: Path) -> str:
    """``"hf_unified"`` when ``ckpt_dir`` holds ``HF_QUANT_CONFIG`` (ModelOpt's unified HF checkpoint, read by
    ``checkpoint.hf_unified``); ``"hf_mxfp4"`` when its config.json says ``quantization_config.quant_method``
    ``mxfp4`` (an HF checkpoint with MXFP4 experts as gpt-oss ships it, read by ``checkpoint.mxfp4_verify`` and
    ``gate.moe_model.load_gpt_oss_mxfp4``; TensorRT-LLM's PyTorch backend loads it as is); else
    ``"trtllm_checkpoint"`` (config.json + rank*.safetensors, read here). Every reader of a checkpoint folder
    dispatches on this."""
    if (Path(ckpt_dir) / HF_QUANT_CONFIG).is_file():
        return "hf_unified"
    try:
        qc = json.loads((Path(ckpt_dir) / "config.json").read_text()).get("quantization_config")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        qc = None  # the layout's own reader reports a missing or broken config.json
    return "hf_mxfp4" if isinstance(qc, dict) and qc.get("quant_method") == "mxfp4" else "trtllm_checkpoint"


# --------------------------------------------------------------------------------------------
# Reading


def read_config(ckpt_dir: Path) -> dict:
    """``config.json`` of a checkpoint. Raises UserError when missing or not JSON."""
    p = Path(ckpt_dir) / "config.json"
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(FIELD, f"{ckpt_dir} has no config.json (not a TensorRT-LLM checkpoint).",
                        "run the quantize stage first, or point at its output folder.")
    except json.JSONDecodeError as e:
        raise UserError(FIELD, f"{p} is not valid JSON: {e}.", "re-run the quantize stage.")


# formats the reader decodes (a codec in checkpoint/codecs.py), for one linear / a whole checkpoint
SINGLE_ALGOS = tuple(f.value for f in FMT.GEMM.values() if f.codec is not None)
LAYER_ALGOS = tuple(f.value for f in FMT.GEMM.values() if f.codec is not None and f.is_quantized)
READ_ALGOS = SINGLE_ALGOS + tuple(f.value for f in FMT.GEMM.values() if f.per_layer)


def _group_ok(g: object) -> bool:
    return not isinstance(g, bool) and isinstance(g, int) and g >= 1


def read_quant_cfg(ckpt_dir: Path, cfg: dict | None = None) -> dict:
    """The checkpoint's quantization, per linear: ``{"quant_algo", "kv_cache_quant_algo",
    "group_size", "exclude_modules", "layers": {TRT-LLM linear name: {"quant_algo", "group_size"}}}``.

    ``layers`` is filled only for MIXED_PRECISION (from ``quant_cfg.json``'s ``quantized_layers``);
    a single-format checkpoint has one ``quant_algo`` for every linear not in ``exclude_modules``.
    Raises UserError when MIXED_PRECISION has no readable ``quant_cfg.json``, or a layer's format
    is not one the reader knows.
    """
    cfg = read_config(ckpt_dir) if cfg is None else cfg
    q = cfg.get("quantization") or {}
    algo = q.get("quant_algo") or NO_QUANT
    out = {"quant_algo": algo, "kv_cache_quant_algo": q.get("kv_cache_quant_algo"), "group_size": q.get("group_size"),
           "exclude_modules": list(q.get("exclude_modules") or []), "layers": {}}
    fmt = FMT.GEMM.get(algo)  # None: an unknown name (dequantize_checkpoint refuses it)
    if fmt is None or not fmt.per_layer:
        g = out["group_size"]
        if fmt is not None and fmt.grouping == "per_group" and not _group_ok(g):
            raise UserError(FIELD, f"config.json declares {algo} with group_size {g!r}; it needs a positive integer "
                            "(the input channels per scale).", "re-export the checkpoint.")
        return out
    p = Path(ckpt_dir) / "quant_cfg.json"
    try:
        qc = json.loads(p.read_text())
    except FileNotFoundError:
        raise UserError(FIELD, f"quant_algo is MIXED_PRECISION but {p} is missing (it lists each layer's format).",
                        "re-export the checkpoint with the per-layer search (build/precision_pipeline/quantize/search.py).")
    except json.JSONDecodeError as e:
        raise UserError(FIELD, f"{p} is not valid JSON: {e}.", "re-export the checkpoint.")
    layers = qc.get("quantized_layers") if isinstance(qc, dict) else None
    if not isinstance(layers, dict):
        raise UserError(FIELD, f"{p} has no quantized_layers table ({{layer name: {{\"quant_algo\": ...}}}}).",
                        "re-export the checkpoint.")
    for name, entry in layers.items():
        if not isinstance(entry, dict):
            raise UserError(FIELD, f"{p}: layer {name} is {entry!r}, not an object with quant_algo.", "re-export the checkpoint.")
        la = entry.get("quant_algo")
        if la not in LAYER_ALGOS:
            raise UserError(FIELD, f"{p}: layer {name} has quant_algo {la!r}, which is not read here.",
                            f"use {FMT.join_or(list(LAYER_ALGOS))} per layer.")
        g = entry.get("group_size")
        if FMT.GEMM[la].grouping == "per_group" and not _group_ok(g):
            raise UserError(FIELD, f"{p}: layer {name} ({la}) has group_size {g!r}; it needs a positive integer "
                            "(the input channels per scale).", "re-export the checkpoint.")
        out["layers"][name] = {"quant_algo": la, "group_size": g}
    kv_q = qc.get("kv_cache_quant_algo")
    kv_c = q.get("kv_cache_quant_algo")
    if kv_q is not None and kv_c is not None and kv_q != kv_c:
        raise UserError(FIELD, f"{p} says kv_cache_quant_algo {kv_q} but config.json says {kv_c}.",
                        "re-export the checkpoint (one KV-cache format per engine).")
    if kv_q is not None:
        out["kv_cache_quant_algo"] = kv_q
    return out


def check_declared_formats(ckpt_dir: Path, cfg: dict | None = None) -> None:
    """Every linear's stored weight (dtype, and for INT8-stored formats the scale layout) must match
    the format that config.json / quant_cfg.json declare for it; read from the safetensors headers
    only (stored dtype: ``GemmFormat.stored_dtype``; scale layout: the codec's ``header_problem``).
    Raises UserError naming the layer, what is stored and what is declared."""
    cfg = read_config(ckpt_dir) if cfg is None else cfg
    qinfo = read_quant_cfg(ckpt_dir, cfg)
    top = FMT.GEMM.get(qinfo["quant_algo"])
    for f in rank_files(ckpt_dir, cfg):
        h = safetensors_header(f)
        for key, meta in h.items():
            if key == "__metadata__" or not key.endswith(".weight"):
                continue
            stem = key[: -len(".weight")]
            if not (stem.endswith(tuple(_LINEARS)) or stem == "lm_head"):
                continue
            algo, _ = linear_format(qinfo, stem)
            fmt = FMT.GEMM.get(algo)
            want = fmt.stored_dtype if fmt is not None else ()
            if meta["dtype"] not in want:
                excluded = fmt is not None and not fmt.is_quantized and top is not None and top.is_quantized and not top.per_layer
                why = " (exclude_modules lists it)" if excluded else ""
                raise UserError(FIELD, f"{stem} is stored as {meta['dtype']} in {f.name} but declared {algo}{why} "
                                f"(stored as {' or '.join(want)}).", "re-export the checkpoint.")
            codec = codecs.CODECS.get(fmt.codec or "")
            problem = codec.header_problem(stem, fmt, meta, h.get(stem + ".weights_scaling_factor")) if codec else None
            if problem:
                raise UserError(FIELD, problem, "re-export the checkpoint.")


def linear_format(qinfo: dict, name: str) -> tuple[str, int | None]:
    """``(quant_algo, group_size)`` that the checkpoint declares for TRT-LLM linear ``name``
    (``NO_QUANT`` for excluded / unlisted ones); ``qinfo`` from ``read_quant_cfg``."""
    fmt = FMT.GEMM.get(qinfo["quant_algo"])
    if fmt is not None and fmt.per_layer:
        e = qinfo["layers"].get(name)
        return (e["quant_algo"], e.get("group_size")) if e else (NO_QUANT, None)
    if (fmt is not None and not fmt.is_quantized) or _excluded(name, qinfo["exclude_modules"]):
        return NO_QUANT, None
    return qinfo["quant_algo"], qinfo["group_size"]


def rank_files(ckpt_dir: Path, cfg: dict) -> list[Path]:
    """``rank0..rank{world_size-1}.safetensors`` of a checkpoint (``mapping.world_size``); UserError when one is missing."""
    world = int((cfg.get("mapping") or {}).get("world_size", 1))
    files = [Path(ckpt_dir) / f"rank{r}.safetensors" for r in range(world)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UserError(FIELD, f"{ckpt_dir} lacks {', '.join(missing)} (mapping.world_size = {world}).",
                        "re-run the quantize stage.")
    return files


# bytes per element of the safetensors dtypes (the format's spec, huggingface/safetensors README "Format")
SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
                           "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit on the JSON header


def safetensors_header(path: Path, field: str = FIELD) -> dict:
    """The JSON header of a safetensors file (names -> dtype, shape, data_offsets), without loading data.

    Layout (safetensors format): 8 bytes little-endian header length N, N bytes of JSON, then the
    data; each tensor's ``data_offsets`` [begin, end) are relative to the data's start. Every tensor's
    byte range is checked against the file size (and against dtype x shape for known dtypes), so a
    truncated or garbage file is a ``UserError`` on ``field`` naming the file, never an
    ``OverflowError``/``MemoryError`` or a half-read checkpoint later."""
    path = Path(path)
    fix = "give a complete checkpoint (a copy may have been cut short); re-export it if it was written by a build."

    def bad(why: str) -> UserError:
        return UserError(field, f"{path} is not a complete safetensors file: {why}.", fix)

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"{size} bytes, shorter than the 8-byte header length")
            n = struct.unpack("<Q", head)[0]
            if n > size - 8 or n > MAX_SAFETENSORS_HEADER:
                raise bad(f"its header claims {n} bytes but the file has {size}")
            text = f.read(n)
    except OSError as e:
        raise UserError(field, f"{path} cannot be read ({type(e).__name__}: {e}).", "check the file's permissions.")
    try:
        h = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise bad("its header is not JSON")
    if not isinstance(h, dict):
        raise bad("its header is not a JSON object")
    data = size - 8 - n
    for name, meta in h.items():
        if name == "__metadata__":
            continue
        ok = isinstance(meta, dict) and isinstance(meta.get("dtype"), str) and isinstance(meta.get("shape"), list) \
            and isinstance(meta.get("data_offsets"), list) and len(meta["data_offsets"]) == 2 \
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in meta["shape"] + meta["data_offsets"])
        if not ok:
            raise bad(f"tensor {name[:120]!r} has no valid dtype, shape and data_offsets")
        begin, end = meta["data_offsets"]
        if not begin <= end <= data:
            raise bad(f"tensor {name[:120]!r} needs bytes {begin}..{end} of the data but only {data} are there")
        width = SAFETENSORS_DTYPE_BYTES.get(meta["dtype"])
        count = 1
        for d in meta["shape"]:
            count *= d
        if width is not None and end - begin != count * width:
            raise bad(f"tensor {name[:120]!r} ({meta['dtype']} {meta['shape']}) needs {count * width} bytes, "
                      f"its data_offsets give {end - begin}")
    return h


def checkpoint_info(ckpt_dir: Path) -> dict:
    """Summary of a checkpoint, from config.json and the safetensors headers (no tensor data read).

    Returns ``{"quant_algo", "kv_cache_quant_algo", "group_size", "exclude_modules", "mapping",
    "logits_dtype", "dtype", "architecture", "layers" (MIXED_PRECISION: {TRT-LLM linear: quant_algo},
    else {}), "total_bytes" (sum of rank*.safetensors file sizes),
    "rank_bytes": [...], "dtypes": {safetensors dtype: {"tensors": n, "bytes": b}}, "num_tensors"}``.
    ``quant_algo`` is ``"NO_QUANT"`` when config.json has null; ``kv_cache_quant_algo`` ``"NONE"``.
    """
    ckpt_dir = Path(ckpt_dir)
    cfg = read_config(ckpt_dir)
    files = rank_files(ckpt_dir, cfg)
    dtypes: dict[str, dict[str, int]] = {}
    n = 0
    for f in files:
        for name, meta in safetensors_header(f).items():
            if name == "__metadata__":
                continue
            d = dtypes.setdefault(meta["dtype"], {"tensors": 0, "bytes": 0})
            d["tensors"] += 1
            d["bytes"] += meta["data_offsets"][1] - meta["data_offsets"][0]
            n += 1
    q = cfg.get("quantization") or {}
    qinfo = read_quant_cfg(ckpt_dir, cfg)
    return {
        "quant_algo": q.get("quant_algo") or NO_QUANT,
        "kv_cache_quant_algo": qinfo["kv_cache_quant_algo"] or KV_NONE,
        "layers": {n: e["quant_algo"] for n, e in qinfo["layers"].items()},
        "group_size": q.get("group_size"),
        "exclude_modules": list(q.get("exclude_modules") or []),
        "mapping": cfg.get("mapping", {}),
        "logits_dtype": cfg.get("logits_dtype"),
        "dtype": cfg.get("dtype"),
        "architecture": cfg.get("architecture"),
        "total_bytes": sum(f.stat().st_size for f in files),
        "rank_bytes": [f.stat().st_size for f in files],
        "dtypes": dict(sorted(dtypes.items())),
        "num_tensors": n,
    }


def format_rows(linears) -> tuple[list[dict], dict[str, dict], int, int]:
    """The per-linear rows and per-format totals of a layer table (``layer_table``; ``hf_unified.hf_layer_table``):
    ``linears`` yields (name, quant_algo, group_size, stored weight elements, bytes); a 4-bit format stores 2 weights
    per element (``GemmFormat.pack``). Returns (rows, by_format, total bits, total params)."""
    rows, by_fmt, tot_bits, tot_params = [], {}, 0, 0
    for stem, algo, group, stored, nbytes in linears:
        fmt = FMT.GEMM.get(algo)
        params = stored * (fmt.pack if fmt else 1)
        rows.append({"name": stem, "quant_algo": algo, "group_size": group if fmt and fmt.grouping != "none" else None,
                     "params": params, "bytes": nbytes, "bits_per_weight": round(nbytes * 8 / params, 4)})
        agg = by_fmt.setdefault(algo, {"linears": 0, "params": 0, "bytes": 0})
        agg["linears"] += 1
        agg["params"] += params
        agg["bytes"] += nbytes
        tot_bits += nbytes * 8
        tot_params += params
    return rows, by_fmt, tot_bits, tot_params


def layer_table(ckpt_dir: Path, search: dict | None = None) -> dict:
    """The checkpoint, GEMM by GEMM, from config.json/quant_cfg.json and the safetensors headers
    (no tensor data read): what the plan shows as ``layers``.

    Returns ``{"quant_algo", "kv_cache_quant_algo", "source", "linears": [{"name" (TRT-LLM
    linear, e.g. ``transformer.layers.0.attention.qkv``), "quant_algo", "group_size", "params"
    (weights, all ranks), "bytes" (weight + scale tensors, all ranks), "bits_per_weight" (bytes
    * 8 / params)}], "by_format": {quant_algo: {"linears", "params", "bytes"}},
    "effective_bits" (weight bits per parameter over the quantized-or-not linears, lm_head
    included)}``, plus, when ``search`` (the checkpoint's ``autoquant.json``) is given, the
    search's ``effective_bits_budget`` / ``effective_bits_achieved`` (over the searched layers).
    """
    ckpt_dir = Path(ckpt_dir)
    cfg = read_config(ckpt_dir)
    qinfo = read_quant_cfg(ckpt_dir, cfg)
    check_declared_formats(ckpt_dir, cfg)
    sizes: dict[str, list[int]] = {}  # linear prefix -> [weight elements as stored, bytes]
    names: list[str] = []
    for f in rank_files(ckpt_dir, cfg):
        for name, meta in safetensors_header(f).items():
            if name == "__metadata__" or "cache_scaling_factor" in name:
                continue
            stem, _, leaf = name.rpartition(".")
            if leaf not in ("weight",) + SCALE_SUFFIXES or not (stem.endswith(tuple(_LINEARS)) or stem == "lm_head"):
                continue
            if stem not in sizes:
                sizes[stem] = [0, 0]
                names.append(stem)
            n_bytes = meta["data_offsets"][1] - meta["data_offsets"][0]
            sizes[stem][1] += n_bytes
            if leaf == "weight":
                n = 1
                for d in meta["shape"]:
                    n *= int(d)
                sizes[stem][0] += n
    order = list(_LINEARS)

    def key(stem: str) -> tuple:
        parts = stem.split(".", 3)
        if len(parts) == 4 and parts[2].isdigit() and parts[3] in order:
            return (0, int(parts[2]), order.index(parts[3]))
        return (1, 0, 0)

    rows, by_fmt, tot_bits, tot_params = format_rows(
        (stem, *linear_format(qinfo, stem), *sizes[stem]) for stem in sorted(names, key=key))
    out = {"quant_algo": qinfo["quant_algo"], "kv_cache_quant_algo": qinfo["kv_cache_quant_algo"] or KV_NONE,
           "source": "exported checkpoint (config.json" + (", quant_cfg.json" if qinfo["layers"] else "") +
                     ", rank*.safetensors headers)",
           "linears": rows, "by_format": dict(sorted(by_fmt.items())),
           "effective_bits": round(tot_bits / tot_params, 4) if tot_params else None}
    if search:
        out["search"] = {k: search.get(k) for k in ("effective_bits_budget", "effective_bits_achieved", "formats",
                                                    "group_size", "method", "constraint_satisfied", "search_s")}
    return out


def _load_ranks(ckpt_dir: Path, cfg: dict) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [load_file(str(f)) for f in rank_files(ckpt_dir, cfg)]


# --------------------------------------------------------------------------------------------
# Dequantization of one rank's linear


def dequantize_weight(t: dict[str, torch.Tensor], prefix: str, quant_algo: str, group_size: int | None) -> torch.Tensor:
    """float32 ``[out, in]`` weight of the linear ``prefix`` (e.g. ``transformer.layers.0.attention.qkv.``)
    from one rank's tensors ``t``, decoded by the codec that the registry names for ``quant_algo``
    (``codecs.dequantize``). Quantized iff the weight's dtype is FP8/INT8/UINT8.

    Raises UserError when the scales that the format needs are missing or have wrong shapes, or
    the stored dtype is not the declared format's.
    """
    return codecs.dequantize(t, prefix, FMT.gemm(quant_algo), group_size)


# --------------------------------------------------------------------------------------------
# Reassembly of ranks


@dataclass
class LinearSpec:
    """A dequantized TRT-LLM linear, ranks merged.

    ``weight`` float32 ``[out, in]``; ``quantized``: weight was stored in a quantized dtype;
    ``act_scale``: activation scale broadcastable over the input ``[in]`` (per-rank scalars spread
    over the rank's input slice for row-parallel linears) or None; ``act_scale_rows``: for
    column-parallel linears whose ranks have different activation scales, a list of
    ``(out_start, out_end, scale)``; ``pre``: prequant scale ``[in]`` or None; ``quant_algo``: the
    format the checkpoint declares for this linear (``NO_QUANT`` if unquantized); ``group_size``:
    its AWQ group size (None for other formats); ``bias``: float32 ``[out]`` (stored unquantized; Qwen2's
    ``attention.qkv.bias``, ``spec.families`` ``Family.bias_gemms``) or None.
    """

    weight: torch.Tensor
    quantized: bool
    act_scale: Optional[torch.Tensor] = None
    act_scale_rows: list = field(default_factory=list)
    pre: Optional[torch.Tensor] = None
    quant_algo: str = NO_QUANT
    group_size: Optional[int] = None
    bias: Optional[torch.Tensor] = None


def _merge_qkv(parts: list[torch.Tensor], cfg: dict, tp: int) -> torch.Tensor:
    """Reassemble per-rank ``[q_r; k_r; v_r]`` rows into ``[q; k; v]`` (ranks sharing a KV head
    when num_key_value_heads < tp hold copies; the first copy is taken)."""
    q_rows, kv_rows, _ = qkv_rows_of_config(cfg, tp)
    nkv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    qs, ks, vs = [], [], []
    for p in parts:
        if p.shape[0] != q_rows + 2 * kv_rows:
            raise UserError(FIELD, f"qkv rank slice has {p.shape[0]} rows; expected {q_rows} + 2 x {kv_rows}.",
                            "re-export the checkpoint.")
        qs.append(p[:q_rows])
        ks.append(p[q_rows:q_rows + kv_rows])
        vs.append(p[q_rows + kv_rows:])
    if nkv < tp:
        step = tp // nkv
        ks, vs = ks[::step], vs[::step]
    return torch.cat([torch.cat(qs), torch.cat(ks), torch.cat(vs)])


def _scalar_or_none(t: dict, key: str) -> torch.Tensor | None:
    v = t.get(key)
    return None if v is None else v.to(torch.float32).reshape(-1)


def merge_linear(ranks: list[dict], prefix: str, kind: str, cfg: dict, quant_algo: str,
                 group_size: int | None, used: set) -> LinearSpec:
    """Dequantize ``prefix`` on every rank and concatenate (``kind``: qkv / col / row / replicated)."""
    tp = len(ranks)
    for r, t in enumerate(ranks):
        if prefix + "weight" not in t:
            raise UserError(FIELD, f"rank{r}.safetensors lacks {prefix}weight.", "re-export the checkpoint.")
        for k in t:
            if k.startswith(prefix) and k[len(prefix):] in ("weight", "bias") + SCALE_SUFFIXES:
                used.add((r, k))
    ws = [dequantize_weight(t, prefix, quant_algo, group_size) for t in ranks]
    quantized = ranks[0][prefix + "weight"].dtype in QUANTIZED_DTYPES
    if any((t[prefix + "weight"].dtype in QUANTIZED_DTYPES) != quantized for t in ranks):
        raise UserError(FIELD, f"{prefix}weight is quantized on some ranks only.", "re-export the checkpoint.")
    acts = [_scalar_or_none(t, prefix + "activation_scaling_factor") for t in ranks]
    pres = [_scalar_or_none(t, prefix + "prequant_scaling_factor") for t in ranks]
    if tp == 1 or kind == "replicated":
        weight = ws[0]
    elif kind == "qkv":
        weight = _merge_qkv(ws, cfg, tp)
    elif kind == "col":
        weight = torch.cat(ws, dim=0)
    else:
        weight = torch.cat(ws, dim=1)
    grouped = quantized and FMT.gemm(quant_algo).grouping == "per_group"
    spec = LinearSpec(weight=weight, quantized=quantized, quant_algo=quant_algo if quantized else NO_QUANT,
                      group_size=group_size if grouped else None)
    in_dim = weight.shape[1]
    if any(a is not None for a in acts):
        if any(a is None for a in acts):
            raise UserError(FIELD, f"{prefix}activation_scaling_factor is missing on some ranks.", "re-export the checkpoint.")
        if kind == "row" and tp > 1:
            spec.act_scale = torch.cat([a.expand(w.shape[1]) for a, w in zip(acts, ws)])
        elif all(torch.equal(a, acts[0]) for a in acts):
            spec.act_scale = acts[0].reshape(())
        else:  # column-parallel ranks with different scales: each output slice uses its own
            start = 0
            rows = [w.shape[0] for w in ws]
            if kind == "qkv":
                raise UserError(FIELD, f"{prefix}: qkv ranks carry different activation scales.", "re-export the checkpoint.")
            for a, n in zip(acts, rows):
                spec.act_scale_rows.append((start, start + n, a.reshape(())))
                start += n
    if any(p is not None for p in pres):
        if kind == "row" and tp > 1:
            spec.pre = torch.cat([p for p in pres])
        else:
            spec.pre = pres[0]
        if spec.pre.numel() != in_dim:
            raise UserError(FIELD, f"{prefix}prequant_scaling_factor has {spec.pre.numel()} elements; input dim is {in_dim}.",
                            "re-export the checkpoint.")
    spec.bias = _merge_bias(ranks, prefix, kind, cfg, weight.shape[0])
    return spec


def _merge_bias(ranks: list[dict], prefix: str, kind: str, cfg: dict, rows: int) -> Optional[torch.Tensor]:
    """``<prefix>bias`` of every rank merged as the weight's rows are (qkv / col; a row-parallel or replicated
    linear's bias is whole on each rank), float32 ``[rows]``; None when no rank stores one. UserError when only some
    ranks store it, it is stored quantized, or it does not have ``rows`` elements."""
    bs = [t.get(prefix + "bias") for t in ranks]
    if all(b is None for b in bs):
        return None
    if any(b is None or b.dtype in QUANTIZED_DTYPES for b in bs):
        raise UserError(FIELD, f"{prefix}bias is missing on some ranks or stored quantized.", "re-export the checkpoint.")
    parts = [b.to(torch.float32).reshape(-1) for b in bs]
    merged = (parts[0] if len(parts) == 1 or kind in ("row", "replicated") else
              _merge_qkv(parts, cfg, len(parts)) if kind == "qkv" else torch.cat(parts))
    if merged.numel() != rows:
        raise UserError(FIELD, f"{prefix}bias has {merged.numel()} elements; the weight has {rows} rows.",
                        "re-export the checkpoint.")
    return merged


def _merge_plain(ranks: list[dict], name: str, dim: Optional[int], used: set, rows: Optional[int] = None) -> torch.Tensor:
    parts = []
    for r, t in enumerate(ranks):
        if name not in t:
            raise UserError(FIELD, f"rank{r}.safetensors lacks {name}.", "re-export the checkpoint.")
        used.add((r, name))
        parts.append(t[name].to(torch.float32) if t[name].dtype not in QUANTIZED_DTYPES else None)
    if any(p is None for p in parts):
        raise UserError(FIELD, f"{name} is stored quantized; this reader supports quantized linears only.",
                        "exclude it from quantization (quantization.exclude_modules).")
    out = parts[0] if dim is None or len(parts) == 1 else torch.cat(parts, dim=dim)
    if rows is not None and out.shape[0] > rows:  # vocab padding
        out = out[:rows]
    return out


@dataclass
class DequantizedCheckpoint:
    """All tensors of a checkpoint, float32, ranks merged, in TRT-LLM names.

    ``linears``: TRT-LLM linear prefix (``transformer.layers.0.attention.qkv``, ``lm_head``) -> LinearSpec;
    ``tensors``: other tensors (embedding, norms); ``kv_scales``: layer -> (k scale ``[kv_heads]``,
    v scale ``[kv_heads]``); ``config``: config.json.
    """

    config: dict
    linears: dict[str, LinearSpec]
    tensors: dict[str, torch.Tensor]
    kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]]
    kv_cache_quant_algo: Optional[str] = None


def dequantize_checkpoint(ckpt_dir: Path) -> DequantizedCheckpoint:
    """Read and dequantize every tensor of a Llama TRT-LLM checkpoint (any tp_size, pp_size 1).

    Raises UserError for a missing file, unsupported architecture/pp/quant_algo, a missing scale,
    inconsistent shapes, or tensors left unused.
    """
    ckpt_dir = Path(ckpt_dir)
    cfg = read_config(ckpt_dir)
    mapping = cfg.get("mapping") or {}
    tp = int(mapping.get("tp_size", 1))
    if int(mapping.get("pp_size", 1)) != 1:
        raise UserError(FIELD, f"pp_size {mapping.get('pp_size')} checkpoints are not read here.", "export with pp_size 1.")
    if cfg.get("architecture") not in GATE_ARCHITECTURES:
        raise UserError(FIELD, f"architecture {cfg.get('architecture')!r} is not read here ({', '.join(GATE_ARCHITECTURES)} only).",
                        "use a checkpoint of: " + ", ".join(GATE_ARCHITECTURES) + ".")
    q = cfg.get("quantization") or {}
    algo = q.get("quant_algo") or NO_QUANT
    if algo not in READ_ALGOS:
        raise UserError(FIELD, f"quant_algo {algo} is not read here.", f"use {FMT.join_or(list(READ_ALGOS))}.")
    qinfo = read_quant_cfg(ckpt_dir, cfg)
    check_declared_formats(ckpt_dir, cfg)
    kv_algo = qinfo["kv_cache_quant_algo"]

    def fmt(name: str) -> tuple[str, int | None]:  # stored = declared (check_declared_formats above)
        return linear_format(qinfo, name)
    ranks = _load_ranks(ckpt_dir, cfg)
    if len(ranks) != tp:
        raise UserError(FIELD, f"{len(ranks)} rank files but tp_size {tp}.", "re-export the checkpoint.")
    used: set = set()
    vocab = int(cfg["vocab_size"])
    linears: dict[str, LinearSpec] = {}
    tensors: dict[str, torch.Tensor] = {}
    kv_scales: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    emb_dim = None
    if cfg.get("use_parallel_embedding") and tp > 1:
        emb_dim = int(cfg.get("embedding_sharding_dim", 0))
    tensors["transformer.vocab_embedding.weight"] = _merge_plain(ranks, "transformer.vocab_embedding.weight", emb_dim, used, vocab)
    tensors["transformer.ln_f.weight"] = _merge_plain(ranks, "transformer.ln_f.weight", None, used)
    nkv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    for i in range(int(cfg["num_hidden_layers"])):
        base = f"transformer.layers.{i}."
        for n in ("input_layernorm.weight", "post_layernorm.weight"):
            tensors[base + n] = _merge_plain(ranks, base + n, None, used)
        for trt, kind in _LINEARS.items():
            linears[base + trt] = merge_linear(ranks, base + trt + ".", kind, cfg, *fmt(base + trt), used)
        ks, vs = [], []
        for r, t in enumerate(ranks):
            k = t.get(base + "attention.k_cache_scaling_factor")
            v = t.get(base + "attention.v_cache_scaling_factor")
            kv = t.get(base + "attention.kv_cache_scaling_factor")
            for name in KV_SCALE_NAMES:
                if base + "attention." + name in t:
                    used.add((r, base + "attention." + name))
            if k is None and kv is not None:
                k = kv
            if v is None and kv is not None:
                v = kv
            if k is not None:
                ks.append(k.to(torch.float32).reshape(()))
                vs.append(v.to(torch.float32).reshape(()))
        if kv_algo:
            if len(ks) != tp:
                raise UserError(FIELD, f"kv_cache_quant_algo {kv_algo} but {base}attention lacks "
                                "k/v_cache_scaling_factor.", "re-export the checkpoint.")
            per_rank = max(1, nkv // tp)
            if nkv >= tp:
                kvec = torch.stack([s.expand(per_rank) for s in ks]).reshape(-1)
                vvec = torch.stack([s.expand(per_rank) for s in vs]).reshape(-1)
            else:
                step = tp // nkv
                kvec, vvec = torch.stack(ks[::step]), torch.stack(vs[::step])
            kv_scales[i] = (kvec, vvec)
    # lm_head
    if "lm_head.weight" in ranks[0]:
        linears["lm_head"] = merge_linear(ranks, "lm_head.", "col", cfg, *fmt("lm_head"), used)
        if linears["lm_head"].weight.shape[0] > vocab:
            linears["lm_head"].weight = linears["lm_head"].weight[:vocab]
    elif not cfg.get("share_embedding_table"):
        raise UserError(FIELD, "lm_head.weight is missing and share_embedding_table is false.", "re-export the checkpoint.")
    leftover = sorted({k for r, t in enumerate(ranks) for k in t if (r, k) not in used})
    if leftover:
        raise UserError(FIELD, f"{len(leftover)} tensors are not understood by the reader, e.g. {', '.join(leftover[:5])}.",
                        "this reader handles Llama-layout checkpoints (spec/families.py GATE_ARCHITECTURES); re-export or extend build/precision_pipeline/checkpoint/reader.py.")
    _check_layers(linears, qinfo)
    return DequantizedCheckpoint(config=cfg, linears=linears, tensors=tensors, kv_scales=kv_scales,
                                 kv_cache_quant_algo=kv_algo)


def _excluded(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def _check_layers(linears: dict[str, LinearSpec], qinfo: dict) -> None:
    """What the header check (``check_declared_formats``) cannot see: quant_cfg.json layers the
    checkpoint lacks, and activation scales the declared formats need."""
    unknown = sorted(set(qinfo["layers"]) - set(linears))
    if unknown:
        raise UserError(FIELD, f"quant_cfg.json lists {unknown[0]}, which the checkpoint does not have.",
                        "re-export the checkpoint.")
    for n, s in linears.items():
        if s.quantized and FMT.gemm(s.quant_algo).needs_act_scale and s.act_scale is None and not s.act_scale_rows:
            raise UserError(FIELD, f"{n} lacks activation_scaling_factor, which {s.quant_algo} needs.", "re-export the checkpoint.")


__all__ = [
    "checkpoint_layout", "HF_QUANT_CONFIG", "checkpoint_info", "rank_files", "SCALE_SUFFIXES", "KV_SCALE_NAMES", "is_scale_tensor", "LINEAR_NAMES", "read_config", "read_quant_cfg", "linear_format", "layer_table", "check_declared_formats", "dequantize_checkpoint", "dequantize_weight",
    "LinearSpec", "DequantizedCheckpoint", "fp8_e4m3_to_float", "e2m1_to_float", "unpack_nvfp4",
    "unpack_int4_rows", "fake_quant_fp8", "fake_quant_int8", "fake_quant_nvfp4", "round_e2m1", "safetensors_header",
]
