"""Codecs: one class per number format of an exported TensorRT-LLM checkpoint (torch, CPU).

Each codec knows how its weights are stored (torch dtype of the weight tensor, which scale
tensors it needs and their shapes) and how to turn them back into float32, plus -- where the
format quantizes activations or the KV cache -- the fake-quant of those values. The reader picks a
codec through the format registry (``precision_pipeline.spec.formats``: ``GemmFormat.codec`` ->
``CODECS``; ``GemmFormat.act_fake_quant`` / ``KvFormat.fake_quant`` -> ``FAKE_QUANT``), never by
comparing format names. A new number format = one class here + its name in ``CODECS``.

Bit layouts (what ModelOpt 0.47 writes; sources per class):

* ``Fp8E4M3`` (FP8, per-tensor): ``weight`` F8_E4M3 ``[out, in]``, ``weights_scaling_factor`` F32
  ``[1]`` (= amax / 448); ``w = fp8.float() * s``. E4M3: 1 sign, 4 exponent (bias 7), 3 mantissa
  bits, no infinities, max 448 (``to_quantized_weight``, ``modelopt/torch/export/quant_utils.py``).
* ``Nvfp4`` (E2M1 + FP8 block scales + F32 global): ``weight`` U8 ``[out, in/2]``, element ``2j``
  in the LOW nibble; ``weights_scaling_factor`` F8_E4M3 ``[out, in/16]``, ``weights_scaling_factor_2``
  F32 scalar; ``w = e2m1 * (sf * sf2)`` (``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``).
* ``Int4Awq`` (INT4 packed along the OUTPUT dim, per-group F32 scales; ``pack_int4_in_uint8``):
  ``weight`` I8 ``[out/2, in]``, ``weights_scaling_factor`` ``[out, in/group]``; W4A8 adds an FP8
  re-quantization with ``weights_scaling_factor_2``.
* ``Int8PerChannel`` (SmoothQuant / W8A16): ``weight`` I8 ``[out, in]``, ``weights_scaling_factor``
  F32 ``[out]``; ``w = q * s[:, None]``; activations / KV: per-tensor INT8 fake-quant.
* ``Mxfp4`` (OCP MX: E2M1 elements, one E8M0 power-of-two scale per ``MX_BLOCK`` = 32 along the input dim):
  ``weight`` U8 ``[out, in/2]``, element ``2j`` in the LOW nibble (as NVFP4); ``weights_scaling_factor`` U8
  ``[out, in/32]``, the biased exponent ``e`` of the block's scale ``2**(e - 127)``; ``w = e2m1 * 2**(e - 127)``
  (``modelopt/torch/quantization/qtensor/mxfp4_tensor.py`` ``MXFP4QTensor.quantize``/``dequantize``;
  ``modelopt/torch/export/quant_utils.py`` ``get_weight_scaling_factor`` reshapes the scales to ``[out, in/32]``).
  gpt-oss's own checkpoint stores the same codes per expert as ``*_blocks`` U8 ``[E, out, in/32, 16]`` and
  ``*_scales`` U8 ``[E, out, in/32]`` (transformers ``integrations/mxfp4.py`` ``convert_moe_packed_tensors``):
  ``dequant_mx_blocks``. E8M0 code 255 is NaN (OCP MX v1.0) and refused.
* ``Plain``: BF16/F16/F32 cast to float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import torch

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.formats import AWQ_DEFAULT_GROUP, MX_BLOCK, NVFP4_BLOCK, GemmFormat

FIELD = "checkpoint"
FP8_MAX = 448.0
INT8_MAX = 127.0  # INT8 quantizer's maxbound (modelopt/torch/export/quant_utils.py get_weight_scaling_factor)
INT4_MAX = 7.0    # INT4 (AWQ) quantizer's maxbound (same function): a group scale is group amax / 7
NVFP4_SCALE_MAX = 6.0 * FP8_MAX  # an NVFP4 global scale is amax / (E2M1 max 6 x E4M3 max 448)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127  # an E8M0 scale byte e means 2**(e - 127) (OCP MX v1.0; MXFP4QTensor: e8m0_scale + 127)
E8M0_NAN = 255   # the one E8M0 code that is not a power of two (NaN)
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)


# --------------------------------------------------------------------------------------------
# Element formats

def fp8_e4m3_to_float(t: torch.Tensor) -> torch.Tensor:
    """float32 values of an FP8 E4M3 tensor (dtype float8_e4m3fn, or uint8/int8 raw bits)."""
    if t.dtype in (torch.uint8, torch.int8):
        t = t.view(torch.uint8).view(torch.float8_e4m3fn)
    return t.to(torch.float32)


def e2m1_to_float(nibbles: torch.Tensor) -> torch.Tensor:
    """float32 values of E2M1 codes (ints 0..15): bit 3 sign, bits 0..2 index [0,.5,1,1.5,2,3,4,6]."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=nibbles.device)
    n = nibbles.to(torch.int64)
    mag = table[n & 0x7]
    return torch.where((n & 0x8) != 0, -mag, mag)


def unpack_nvfp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n/2]`` uint8 -> ``[..., n]`` float32 E2M1 values; element 2j = low nibble, 2j+1 = high."""
    p = packed.view(torch.uint8).to(torch.int64)
    lo = p & 0x0F
    hi = (p >> 4) & 0x0F
    out = torch.stack([lo, hi], dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    return e2m1_to_float(out)


def e8m0_exponents(scales: torch.Tensor, what: str) -> torch.Tensor:
    """int32 exponents ``e - 127`` of E8M0 scale bytes (uint8, any shape); UserError naming ``what`` when a byte is
    255 (NaN in OCP MX v1.0: no power of two)."""
    e = scales.view(torch.uint8).to(torch.int32)
    if bool((e == E8M0_NAN).any()):
        raise UserError(FIELD, f"{what} holds E8M0 code 255 (NaN in the OCP MX format): {int((e == E8M0_NAN).sum())} "
                        "block scale(s) are not a power of two.", "re-export the checkpoint.")
    return e - E8M0_BIAS


def dequant_mx(packed: torch.Tensor, scales: torch.Tensor, what: str) -> torch.Tensor:
    """MXFP4 codes ``[..., n/2]`` (uint8, low nibble = even element) and E8M0 scales ``[..., n/MX_BLOCK]`` (uint8)
    -> float32 ``[..., n]``: ``e2m1 * 2**(e - 127)`` per block of ``MX_BLOCK``, exact (``torch.ldexp``; a product past
    float32's range is inf). UserError when the scales do not tile the codes or hold code 255."""
    vals = unpack_nvfp4(packed)
    n = vals.shape[-1]
    if tuple(scales.shape[:-1]) != tuple(vals.shape[:-1]) or scales.shape[-1] * MX_BLOCK != n:
        raise UserError(FIELD, f"{what}: MXFP4 scales {tuple(scales.shape)} do not tile {tuple(vals.shape)} codes in "
                        f"blocks of {MX_BLOCK}.", "re-export the checkpoint.")
    exp = e8m0_exponents(scales, what)
    blocks = vals.reshape(*vals.shape[:-1], n // MX_BLOCK, MX_BLOCK)
    return torch.ldexp(blocks, exp.unsqueeze(-1)).reshape(vals.shape)


def dequant_mx_blocks(blocks: torch.Tensor, scales: torch.Tensor, what: str) -> torch.Tensor:
    """gpt-oss's layout: ``blocks`` uint8 ``[..., out, in/32, 16]``, ``scales`` uint8 ``[..., out, in/32]`` ->
    float32 ``[..., out, in]`` (the same codes as ``dequant_mx``, grouped per block on disk)."""
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] * 2 != MX_BLOCK:
        raise UserError(FIELD, f"{what}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
                        f"match (expected [..., n/{MX_BLOCK}, {MX_BLOCK // 2}] and [..., n/{MX_BLOCK}]).",
                        "re-export the checkpoint.")
    return dequant_mx(blocks.flatten(-2), scales, what)


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """``[out/2, in]`` int8/uint8 -> ``[out, in]`` int64 in -8..7. Row ``2r`` = low nibble of byte
    row ``r``, row ``2r+1`` = high nibble (``pack_int4_in_uint8``, modelopt/torch/export/quant_utils.py)."""
    p = packed.view(torch.uint8).to(torch.int64)
    lo = p & 0x0F
    hi = (p >> 4) & 0x0F
    lo = torch.where(lo >= 8, lo - 16, lo)
    hi = torch.where(hi >= 8, hi - 16, hi)
    out = torch.stack([lo, hi], dim=1)  # [out/2, 2, in]
    return out.reshape(p.shape[0] * 2, *p.shape[1:])


def fake_quant_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-tensor (or broadcast) FP8 E4M3 quantize-dequantize of ``x`` with scale ``s`` (= amax/448):
    ``fp8(clamp(x/s, ±448)) * s``, rounding to nearest even.

    Computed in ModelOpt's operation order (``_fp8_eager`` in
    ``modelopt/torch/quantization/tensor_quant.py``): ``amax = s*448``, ``k = 448/amax``,
    ``fp8(clamp(x*k)) * (1/k)``, so that given the same scales the result is bit-identical to
    ModelOpt's fake-quant (values exactly halfway between two FP8 codes round by this float path).
    """
    amax = scale.to(torch.float32) * FP8_MAX
    k = FP8_MAX / amax
    # the same operations as ``(x*k).clamp(...).to(fp8).to(fp32) * (1/k)``, two temporaries fewer
    y = (x.to(torch.float32) * k).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return y.mul_(1 / k).to(x.dtype)


def requantize_fp8_fused(weights: list[torch.Tensor], scales: list[torch.Tensor],
                         dtype: torch.dtype) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The FP8 parts of one fused GEMM (q/k/v, gate/up) re-quantized to one per-tensor scale, as TensorRT-LLM's
    PyTorch backend loads a HF checkpoint (``tensorrt_llm/_torch/modules/linear.py``
    ``FP8QDQLinearMethod.load_weights_fused_qkv_linear`` / ``load_weights_fused_gate_up_linear``): the scale is the
    max of the parts' ``weight_scale``; each part ``w_fp8.to(dtype) * s_i`` (in the model ``dtype``) is divided by
    it and cast to FP8 E4M3. ``weights``: float8_e4m3fn ``[out_i, in]``; ``scales``: 0-d float32. Returns the
    re-quantized float8 parts and the shared scale (0-d float32). Parts that already share the max scale come
    back unchanged (``x * s / s`` is exact for their values)."""
    smax = torch.stack([s.reshape(()) for s in scales]).max()
    out = [((w.to(dtype) * s.reshape(())) / smax).to(torch.float8_e4m3fn) for w, s in zip(weights, scales)]
    return out, smax


def fake_quant_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-tensor INT8 quantize-dequantize with scale ``s`` (= amax/127):
    ``clamp(round(x/s), -128, 127) * s`` (round half to even).

    Computed in ModelOpt's operation order (``_tensor_quant`` in
    ``modelopt/torch/quantization/tensor_quant.py``, ``narrow_range=False``):
    ``k = 127/amax``, ``clamp(round(x*k), -128, 127) / k``.
    """
    amax = scale.to(torch.float32) * INT8_MAX
    k = INT8_MAX / amax
    return (torch.round(x.to(torch.float32) * k).clamp(-128, 127) / k).to(x.dtype)


def round_e2m1(v: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest E2M1 value (ties to the even code, as ModelOpt's
    ``NVFP4QTensor._cast_fp4``); magnitudes above 6 saturate to 6."""
    a = v.abs()
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32, device=a.device)
    idx = torch.searchsorted(bounds, a.contiguous())
    odd = (a == 0.75) | (a == 1.75) | (a == 3.5)
    idx = idx + odd.to(idx.dtype)
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=a.device)[idx.clamp(max=7)]
    return torch.where(v < 0, -mag, mag)


def fake_quant_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, block: int = NVFP4_BLOCK) -> torch.Tensor:
    """Dynamic NVFP4 quantize-dequantize along the last dim (blocks of ``block``):
    ``sf_b = fp8(clamp(amax_b / (6 * s2), 2**-9, 448))``, ``x_q = e2m1(x / (sf_b*s2)) * sf_b*s2``."""
    shape = x.shape
    xf = x.to(torch.float32).reshape(*shape[:-1], shape[-1] // block, block)
    s2 = global_scale.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    sf = (amax / (6.0 * s2))
    sf = torch.where(sf == 0, torch.ones_like(sf), sf)
    sf = sf.clamp(2.0 ** -9, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    scale = sf * s2
    q = round_e2m1(xf / scale) * scale
    return q.reshape(shape).to(x.dtype)


def dequant_int4(t: dict[str, torch.Tensor], prefix: str, group: int) -> torch.Tensor:
    """INT4 AWQ weight of one rank -> float32 ``[out, in]``.

    ``w = q * weights_scaling_factor[o, i // group]`` (``pack_int4_in_uint8`` quantizes
    ``round(w / s)`` with the INT4 quantizer's per-group scale; ``weights_scaling_factor_2`` is
    not used for the packing). W4A8_AWQ: ``weights_scaling_factor_2`` is the per-tensor scale of
    the second, FP8 weight quantizer (ModelOpt's ``SequentialQuantizer``, INT4 then FP8 E4M3;
    ``get_weight_scaling_factor_2`` in ``modelopt/torch/export/quant_utils.py``): the INT4 values
    times their group scales are represented in FP8 with that scale, so
    ``w = fp8(q * s / s2) * s2`` (measured: without the FP8 step the relative error vs. the HF
    weights is the same; multiplying by ``s2`` instead gives ~99% error).
    """
    q = unpack_int4_rows(t[prefix + "weight"]).to(torch.float32)
    s = t[prefix + "weights_scaling_factor"].to(torch.float32)
    if s.shape[0] != q.shape[0] and s.shape[-1] == q.shape[0]:
        s = s.T  # [in/group, out] layout
    if s.dim() != 2 or s.shape[0] != q.shape[0] or q.shape[1] != s.shape[1] * group:
        raise UserError(FIELD, f"{prefix}weights_scaling_factor has shape {tuple(s.shape)}; expected "
                        f"[{q.shape[0]}, {q.shape[1] // group}] for weight [{q.shape[0]}, {q.shape[1]}] and group {group}.",
                        "re-export the checkpoint.")
    w = q * s.repeat_interleave(group, dim=1)
    s2 = t.get(prefix + "weights_scaling_factor_2")
    if s2 is not None:
        w = fake_quant_fp8(w, s2.to(torch.float32).reshape(()))
    return w


# --------------------------------------------------------------------------------------------
# Codec classes


def _need(t: dict[str, torch.Tensor], prefix: str, name: str) -> torch.Tensor:
    """``t[prefix + name]`` as float32 (FP8 tensors as stored); UserError when missing."""
    if prefix + name not in t:
        raise UserError(FIELD, f"{prefix}weight is {t[prefix + 'weight'].dtype} but {prefix}{name} is missing.",
                        "re-export the checkpoint.")
    v = t[prefix + name]
    return v.to(torch.float32) if v.dtype != torch.float8_e4m3fn else v


class Codec:
    """One number format: ``dequantize`` (one rank's tensors -> float32 ``[out, in]``),
    ``header_problem`` (what the safetensors header alone shows against the declared format),
    and ``fake_quant`` when the format also quantizes activations / the KV cache."""

    name: ClassVar[str] = ""
    weight_dtype: ClassVar[Optional[torch.dtype]] = None  # torch dtype of the stored weight
    code_max: ClassVar[Optional[float]] = None
    """Largest code magnitude that ``weights_scaling_factor`` maps the weight's amax to (``amax =
    scale * code_max``, per tensor / channel / group); None where the scale is not of that kind
    (NVFP4's FP8 block scales are relative to ``weights_scaling_factor_2``)."""

    def dequantize(self, t: dict[str, torch.Tensor], prefix: str, group_size: Optional[int]) -> torch.Tensor:
        raise NotImplementedError

    def header_problem(self, stem: str, fmt: GemmFormat, weight: dict, scale: Optional[dict]) -> Optional[str]:
        """Reason text when the header's weight / ``weights_scaling_factor`` (``{"dtype", "shape"}``)
        contradict ``fmt`` beyond the stored dtype (checked from ``fmt.stored_dtype``), else None."""
        return None

    fake_quant: ClassVar[Optional[Callable[..., torch.Tensor]]] = None

    def layout(self, fmt: GemmFormat, n_out: int, n_in: int, group: Optional[int]) -> dict[str, Slot]:
        """Every tensor one rank of a linear ``[n_out, n_in]`` (this rank's slice) stores in ``fmt``:
        ``{suffix: Slot}`` (``weight`` and the scale tensors, names as ``reader.SCALE_SUFFIXES``).
        The activation scale and the pre-quant scale follow the registry (``fmt.needs_act_scale``,
        ``fmt.scales.prequant``); the rest is the codec's own layout (class docstrings)."""
        out = self._own(fmt, n_out, n_in, group)
        if fmt.needs_act_scale:
            out["activation_scaling_factor"] = Slot(("F32",), SCALAR)
        if fmt.scales.prequant:
            out["prequant_scaling_factor"] = Slot(PLAIN_DTYPES, (n_in,))
        return out

    def _own(self, fmt: GemmFormat, n_out: int, n_in: int, group: Optional[int]) -> dict[str, "Slot"]:
        raise NotImplementedError


SCALAR = ()
"""A per-tensor scale's shape: stored as ``[]`` (NVFP4) or ``[1]`` (the others); ``Slot.fits`` takes both."""
PLAIN_DTYPES = ("BF16", "F16", "F32")  # unquantized weights and pre-quant scales (the model dtype)


@dataclass(frozen=True)
class Slot:
    """One stored tensor of a linear: the safetensors dtypes it may have and its shape (``SCALAR``:
    one value, ``[]`` or ``[1]``); ``alt_shape``: a second accepted shape (FP8 per-channel)."""

    dtypes: tuple[str, ...]
    shape: tuple[int, ...]
    alt_shape: Optional[tuple[int, ...]] = None

    def fits(self, shape: list[int]) -> bool:
        got = tuple(shape)
        if self.shape == SCALAR:
            return got in ((), (1,))
        return got == self.shape or (self.alt_shape is not None and got == self.alt_shape)

    def text(self) -> str:
        shp = "[] or [1]" if self.shape == SCALAR else str(list(self.shape))
        if self.alt_shape is not None:
            shp += f" or {list(self.alt_shape)}"
        return f"{'/'.join(self.dtypes)} {shp}"


class Plain(Codec):
    """BF16 / F16 / F32 weights: cast to float32."""

    name = "plain"

    def dequantize(self, t, prefix, group_size):
        return t[prefix + "weight"].to(torch.float32)

    def _own(self, fmt, n_out, n_in, group):
        return {"weight": Slot(PLAIN_DTYPES, (n_out, n_in))}


class Fp8E4M3(Codec):
    """FP8 E4M3 weights with a per-tensor (or, not produced by FP8_DEFAULT_CFG, per-channel) F32
    scale; activations / KV cache: per-tensor FP8 fake-quant (``fake_quant_fp8``)."""

    name = "fp8"
    weight_dtype = torch.float8_e4m3fn
    code_max = FP8_MAX
    fake_quant = staticmethod(fake_quant_fp8)

    def dequantize(self, t, prefix, group_size):
        w = t[prefix + "weight"]
        s = _need(t, prefix, "weights_scaling_factor")
        if s.numel() == 1:
            return fp8_e4m3_to_float(w) * s.reshape(())
        if s.numel() == w.shape[0]:  # per-channel FP8 (not produced by FP8_DEFAULT_CFG)
            return fp8_e4m3_to_float(w) * s.reshape(-1, 1)
        raise UserError(FIELD, f"{prefix}weights_scaling_factor has {s.numel()} elements for FP8 weight {tuple(w.shape)}.",
                        "re-export the checkpoint.")

    def _own(self, fmt, n_out, n_in, group):  # per-tensor scale (per-channel also decoded, see dequantize)
        return {"weight": Slot(("F8_E4M3",), (n_out, n_in)),
                "weights_scaling_factor": Slot(("F32",), SCALAR, alt_shape=(n_out,))}


class Nvfp4(Codec):
    """NVFP4: packed E2M1 nibbles, an FP8 E4M3 scale per ``NVFP4_BLOCK`` elements and an F32 global
    scale; activations: dynamic NVFP4 fake-quant (``fake_quant_nvfp4``)."""

    name = "nvfp4"
    weight_dtype = torch.uint8
    fake_quant = staticmethod(fake_quant_nvfp4)

    def dequantize(self, t, prefix, group_size):
        w = t[prefix + "weight"]
        sf = _need(t, prefix, "weights_scaling_factor")
        sf2 = _need(t, prefix, "weights_scaling_factor_2").reshape(())
        vals = unpack_nvfp4(w)  # [out, in]
        block = vals.shape[1] // sf.shape[1]
        if sf.shape[0] != vals.shape[0] or block * sf.shape[1] != vals.shape[1]:
            raise UserError(FIELD, f"{prefix}: NVFP4 scales {tuple(sf.shape)} do not tile weight {tuple(vals.shape)}.",
                            "re-export the checkpoint.")
        scale = fp8_e4m3_to_float(sf) * sf2
        return vals * scale.repeat_interleave(block, dim=1)

    def _own(self, fmt, n_out, n_in, group):  # packed along the input dim; FP8 scale per NVFP4_BLOCK inputs
        return {"weight": Slot(("U8",), (n_out, n_in // fmt.pack)),
                "weights_scaling_factor": Slot(("F8_E4M3",), (n_out, n_in // NVFP4_BLOCK)),
                "weights_scaling_factor_2": Slot(("F32",), SCALAR)}


class Mxfp4(Codec):
    """MXFP4 (W4A16_MXFP4, W4A8_MXFP4_FP8, W4A8_MXFP4_MXFP8): packed E2M1 nibbles and one E8M0 scale byte per
    ``MX_BLOCK`` inputs (``dequant_mx``). The FP8 activation scale of W4A8_MXFP4_FP8 follows the registry
    (``Codec.layout``); W4A8_MXFP4_MXFP8's activations are quantized per block at run time (no stored scale)."""

    name = "mxfp4"
    weight_dtype = torch.uint8

    def dequantize(self, t, prefix, group_size):
        return dequant_mx(t[prefix + "weight"], _need_raw(t, prefix, "weights_scaling_factor"), prefix + "weight")

    def _own(self, fmt, n_out, n_in, group):
        return {"weight": Slot(("U8",), (n_out, n_in // fmt.pack)),
                "weights_scaling_factor": Slot(("U8",), (n_out, n_in // MX_BLOCK))}


def _need_raw(t: dict[str, torch.Tensor], prefix: str, name: str) -> torch.Tensor:
    """``t[prefix + name]`` as stored (E8M0 bytes stay uint8); UserError when missing."""
    if prefix + name not in t:
        raise UserError(FIELD, f"{prefix}weight is {t[prefix + 'weight'].dtype} but {prefix}{name} is missing.",
                        "re-export the checkpoint.")
    return t[prefix + name]


def _int4_packed(weight: dict, scale: dict) -> bool:
    """Header shapes say INT4 packed rows with per-group scales: ``[out, in/g]`` for ``[out/2, in]``."""
    return len(scale["shape"]) == 2 and scale["shape"][0] == 2 * weight["shape"][0]


class Int4Awq(Codec):
    """INT4 AWQ: two signed int4 per byte along the output dim, F32 scale per group of
    ``group_size`` inputs (default ``AWQ_DEFAULT_GROUP``); W4A8_AWQ's ``weights_scaling_factor_2``
    re-quantizes the result to FP8 (``dequant_int4``)."""

    name = "int4_awq"
    weight_dtype = torch.int8
    code_max = INT4_MAX

    def dequantize(self, t, prefix, group_size):
        _need(t, prefix, "weights_scaling_factor")
        return dequant_int4(t, prefix, int(group_size or AWQ_DEFAULT_GROUP))

    def _own(self, fmt, n_out, n_in, group):  # packed along the OUTPUT dim; F32 scale per group of inputs
        g = int(group or AWQ_DEFAULT_GROUP)
        out = {"weight": Slot(("I8",), (n_out // fmt.pack, n_in)),
               "weights_scaling_factor": Slot(("F32",), (n_out, n_in // g))}
        if fmt.needs_act_scale:  # W4A8: the second, FP8 weight quantizer's per-tensor scale (dequant_int4)
            out["weights_scaling_factor_2"] = Slot(("F32",), SCALAR)
        return out

    def header_problem(self, stem, fmt, weight, scale):
        if weight["dtype"] == "I8" and scale is not None and not _int4_packed(weight, scale):
            return (f"{stem} is declared {fmt.value} but stored as INT8 with per-channel scales "
                    f"{scale['shape']} (W8A16 / SmoothQuant layout).")
        return None


class Int8PerChannel(Codec):
    """INT8 weights with one F32 scale per output channel (SmoothQuant, W8A16); activations /
    KV cache: per-tensor INT8 fake-quant (``fake_quant_int8``)."""

    name = "int8_channel"
    weight_dtype = torch.int8
    code_max = INT8_MAX
    fake_quant = staticmethod(fake_quant_int8)

    def dequantize(self, t, prefix, group_size):
        w = t[prefix + "weight"]
        s = _need(t, prefix, "weights_scaling_factor")
        if s.numel() != w.shape[0]:
            raise UserError(FIELD, f"{prefix}weights_scaling_factor has {s.numel()} elements; expected {w.shape[0]} (per output channel).",
                            "re-export the checkpoint.")
        return w.to(torch.float32) * s.reshape(-1, 1)

    def _own(self, fmt, n_out, n_in, group):
        return {"weight": Slot(("I8",), (n_out, n_in)), "weights_scaling_factor": Slot(("F32",), (n_out,))}

    def header_problem(self, stem, fmt, weight, scale):
        if weight["dtype"] == "I8" and scale is not None and _int4_packed(weight, scale):
            return (f"{stem} is declared {fmt.value} but stored as packed INT4 with per-group scales "
                    f"{scale['shape']} (AWQ layout).")
        return None


CODECS: dict[str, Codec] = {c.name: c for c in (Plain(), Fp8E4M3(), Nvfp4(), Int4Awq(), Int8PerChannel(), Mxfp4())}
# GemmFormat.act_fake_quant / KvFormat.fake_quant kind -> quantize-dequantize function (x, scale)
FAKE_QUANT: dict[str, Callable[..., torch.Tensor]] = {"fp8": fake_quant_fp8, "int8": fake_quant_int8,
                                                      "nvfp4": fake_quant_nvfp4}
# fake-quant kind -> what its per-tensor scale (activation_scaling_factor, k/v_cache_scaling_factor)
# maps the amax to: ``amax = scale * CODE_MAX[kind]`` (FP8 amax/448, INT8 amax/127, NVFP4 global amax/(6*448))
CODE_MAX: dict[str, float] = {"fp8": FP8_MAX, "int8": INT8_MAX, "nvfp4": NVFP4_SCALE_MAX}


def codec_for(fmt: GemmFormat) -> Codec:
    """The codec of ``fmt`` (``CODECS[fmt.codec]``); UserError when the reader has none for it."""
    c = CODECS.get(fmt.codec or "")
    if c is None:
        raise UserError(FIELD, f"quant_algo {fmt.value} is not read here (no codec).",
                        "use a format with a codec in build/precision_pipeline/checkpoint/codecs.py.")
    return c


def dequantize(t: dict[str, torch.Tensor], prefix: str, fmt: GemmFormat, group_size: Optional[int]) -> torch.Tensor:
    """float32 ``[out, in]`` weight of linear ``prefix`` from one rank's tensors, decoded as ``fmt``
    declares. An unquantized stored dtype is cast (a linear kept in high precision); a quantized
    one must be the codec's own (else UserError: stored differs from declared)."""
    w = t[prefix + "weight"]
    if w.dtype not in QUANTIZED_DTYPES:
        return w.to(torch.float32)
    codec = codec_for(fmt)
    if codec.weight_dtype is not None and w.dtype != codec.weight_dtype:
        raise UserError(FIELD, f"{prefix}weight is stored as {w.dtype} but declared {fmt.value}.", "re-export the checkpoint.")
    if codec.weight_dtype is None:
        raise UserError(FIELD, f"{prefix}weight is stored quantized ({w.dtype}) but declared {fmt.value}.",
                        "re-export the checkpoint.")
    return codec.dequantize(t, prefix, group_size)


__all__ = ["Slot", "SCALAR", "PLAIN_DTYPES", "Codec", "Plain", "Fp8E4M3", "Nvfp4", "Int4Awq", "Int8PerChannel", "Mxfp4",
           "dequant_mx", "dequant_mx_blocks", "e8m0_exponents", "E8M0_BIAS", "E8M0_NAN", "CODECS", "FAKE_QUANT", "codec_for", "dequantize",
           "dequant_int4", "fp8_e4m3_to_float", "e2m1_to_float", "unpack_nvfp4", "unpack_int4_rows", "fake_quant_fp8",
           "fake_quant_int8", "fake_quant_nvfp4", "requantize_fp8_fused", "round_e2m1", "FP8_MAX", "INT8_MAX", "INT4_MAX", "NVFP4_SCALE_MAX", "CODE_MAX", "E2M1_VALUES", "QUANTIZED_DTYPES"]
