"""The format registry (one entry per GEMM ``quant_algo`` and per KV-cache format) and the other
data tables of the rules: which formats run on which SM, bytes per element, suggestions.

Every entry names the TensorRT-LLM 1.2 / ModelOpt 0.47 source it was read from. Nothing outside
this module branches on format names: the quantize stage, the search, the checkpoint reader and
its codecs, the rules, pack and the sensitivity analysis look facts up here (``GEMM[algo]``,
``KV[algo]``) and compare ``QuantAlgo`` / ``KVCacheQuantAlgo`` members, never strings. Adding a
format = one ``GemmFormat`` (or ``KvFormat``) entry here, plus one codec class in
``precision_pipeline/checkpoint/codecs.py`` if its numbers are new. Nothing here needs torch.

Sources (NVIDIA/TensorRT-LLM, 1.0-1.2-era commits):

* ``docs/source/features/quantization.md`` "Hardware Support Matrix": NVFP4 on Blackwell
  sm100/103 and sm120; FP8 (per tensor) on Ada, Hopper, Blackwell; FP8 KV cache on Ampere, Ada,
  Hopper, Blackwell; W4A8 AWQ on Ada and Hopper only; W4A16 AWQ on Ampere, Ada, Hopper.
* ``tensorrt_llm/builder.py`` ``build()``: for ``100 <= SM < 120`` it raises
  "INT8/INT4 quantization is not supported on SM>=100." (INT8/INT4 weight-only, INT8 KV cache)
  and "SmoothQuant is not supported on SM>=100." (and per-channel/per-token scaling).
* ``tensorrt_llm/quantization/mode.py``: ``QUANT_ALGO_LIST`` (what ``QuantMode.from_quant_algo``
  asserts) lacks ``W4A16_NVFP4``; ``KV_CACHE_QUANT_ALGO_LIST = [FP8, INT8, NVFP4]``.
* ``docs/source/legacy/reference/support-matrix.md`` "Hardware"/"Precision": Ampere (SM80, SM86)
  and newer; BF16 on all of them.
* Bytes per element / scale tensors / stored dtypes: shared/reference/trtllm-1.2-build-reference.md
  section 7 (what ModelOpt 0.47 writes into a TensorRT-LLM checkpoint, measured on CPU).
* ModelOpt config names: ``modelopt/torch/quantization/config.py``; per-module export format
  strings: ``modelopt/torch/export/model_config.py`` (``QUANTIZATION_*``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Iterable, Iterator, Literal, Optional, TypeVar

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.hardware import gpus_with_sm
from precision_pipeline.spec.algos import KVCacheQuantAlgo, QuantAlgo

SRC_QUANT_MD = "tensorrt_llm docs/source/features/quantization.md (Hardware Support Matrix)"
SRC_BUILDER = "tensorrt_llm/builder.py build()"
SRC_MODE = "tensorrt_llm/quantization/mode.py (QUANT_ALGO_LIST, KV_CACHE_QUANT_ALGO_LIST)"
SRC_SUPPORT = "tensorrt_llm docs/source/legacy/reference/support-matrix.md (Hardware, Precision)"
SRC_CKPT = "shared/reference/trtllm-1.2-build-reference.md section 7 (ModelOpt 0.47 checkpoint tensors)"
SRC_COMMON = "tensorrt_llm/_common.py check_max_num_tokens()"
SRC_INIT_SEQ = "tensorrt_llm/builder.py _init_max_seq_len()"
SRC_BUILDCONFIG = "tensorrt_llm/builder.py BuildConfig (defaults)"
SRC_PLUGIN = "tensorrt_llm/plugin/plugin.py PluginConfig"
SRC_BUILD_CMD = "tensorrt_llm/commands/build.py (trtllm-build flags)"
SRC_MODELOPT_CFG = "modelopt/torch/quantization/config.py (ModelOpt 0.47 presets)"
SRC_MODELOPT_EXPORT = "modelopt/torch/export/quant_utils.py, model_config.py (ModelOpt 0.47 export)"
SRC_SEARCH = ("modelopt/torch/quantization/model_quant.py auto_quantize (ModelOpt 0.47); candidates exported "
              "and read back in tests/test_autoquant.py, tests/test_mixed_precision.py")
SRC_PERF = "docs/source/performance/perf-best-practices.md (GEMM Plugin)"

# What the quantize stage (ModelOpt 0.47) cannot export although TensorRT-LLM could build it
# (modelopt/torch/quantization/config.py defines FP8_KV_CFG, FP8_AFFINE_KV_CFG, NVFP4_KV_CFG,
# NVFP4_AFFINE_KV_CFG, NVFP4_KV_ROTATE_CFG, and no INT8 KV-cache config): (reason, fix)
INT8_KV_NOT_EXPORTED = ("INT8 KV cache: ModelOpt 0.47 ships no INT8 KV-cache config (only FP8_KV_CFG and NVFP4_KV_CFG), "
                        "so no calibrated INT8 KV scales can be exported.",
                        "use kv_cache_quant_algo: FP8 (SM >= 89) or NONE.")
SRC_MAPPING = "tensorrt_llm/mapping.py Mapping (tp/pp/moe_tp/moe_ep)"
SRC_BACKEND = "tensorrtllm_backend all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt"
SRC_KVCONFIG = "tensorrt_llm/llmapi/llm_args.py KvCacheConfig (free_gpu_memory_fraction)"

ANY = 10_000  # upper bound meaning "and every later SM"
MIN_TRTLLM_SM = 80
SCALE_F32 = 4  # bytes of one F32 scale
NVFP4_BLOCK = 16  # NVFP4: one FP8 block scale per 16 elements along the input dim
MX_BLOCK = 32  # MXFP4 / MXFP8 (OCP MX): one E8M0 (power-of-two) scale byte per 32 elements along the input dim
AWQ_DEFAULT_GROUP = 128  # INT4_AWQ_CFG / W4A8_AWQ_BETA_CFG block_sizes[-1]
NO_MODELOPT_CONFIG = "NONE"  # the config name the quantize stage records when no ModelOpt PTQ runs
SmRanges = tuple[tuple[int, int], ...]  # inclusive (lo, hi) SM ranges; hi = ANY: every later SM
ActFakeQuant = Literal["fp8", "int8", "nvfp4"]


def _in(ranges: SmRanges, sm: int) -> bool:
    return any(lo <= sm <= hi for lo, hi in ranges)


def sm_text(ranges: SmRanges) -> str:
    """e.g. 'SM 100, 103 or 120-121' / 'SM >= 89' / 'no SM'."""
    parts = []
    for lo, hi in ranges:
        if hi >= ANY:
            parts.append(f">= {lo}")
        elif lo == hi:
            parts.append(str(lo))
        else:
            parts.append(f"{lo}-{hi}")
    if not parts:
        return "no SM"
    if len(parts) == 1:
        return "SM " + parts[0]
    return "SM " + ", ".join(parts[:-1]) + " or " + parts[-1]


@dataclass(frozen=True)
class ScaleLayout:
    """How the scale tensors of one quantized linear ``[n_out, n_in]`` are counted, in bytes.

    ``kind``: ``none`` / ``per_tensor`` / ``per_channel`` (one F32 per output channel) /
    ``per_group`` (one F32 per output channel and group of input channels) / ``per_block``
    (one FP8 byte per ``NVFP4_BLOCK`` inputs) / ``per_mx_block`` (one E8M0 byte per ``MX_BLOCK`` inputs). ``scalars``: extra F32 scalars (weight, activation,
    global scales). ``prequant``: a model-dtype pre-quant scale per input channel (AWQ,
    SmoothQuant). Source: SRC_CKPT.
    """

    kind: Literal["none", "per_tensor", "per_channel", "per_group", "per_block", "per_mx_block"]
    scalars: int = 0
    prequant: bool = False

    def bytes(self, n_in: int, n_out: int, group: Optional[int], dtype_bytes: int) -> float:
        """Bytes of the scale tensors (``group``: AWQ group size, default ``AWQ_DEFAULT_GROUP``)."""
        b: float = 0
        if self.kind == "per_block":
            b += n_in * n_out / NVFP4_BLOCK
        elif self.kind == "per_mx_block":
            b += n_in * n_out / MX_BLOCK
        elif self.kind == "per_group":
            b += SCALE_F32 * n_out * -(-n_in // (group or AWQ_DEFAULT_GROUP))
        elif self.kind == "per_channel":
            b += SCALE_F32 * n_out
        if self.prequant:
            b += dtype_bytes * n_in
        return b + self.scalars * SCALE_F32


class _BuildsOn:
    """Where a format builds (``builds_on``/``warn_on``: inclusive SM ranges); shared by GEMM and KV entries."""

    builds_on: tuple[tuple[int, int], ...]
    warn_on: tuple[tuple[int, int], ...]

    def supports(self, sm: int) -> bool:
        return _in(self.builds_on, sm)

    def untested(self, sm: int) -> bool:
        return _in(self.warn_on, sm)

    def sm_text(self) -> str:
        return sm_text(self.builds_on)

    def gpu_ids(self) -> list[str]:
        """Catalog GPUs that run it."""
        return [g.id for g in gpus_with_sm(self.builds_on)]


@dataclass(frozen=True)
class GemmFormat(_BuildsOn):
    """Everything the pipeline knows about one ``quantization.quant_algo``.

    * ``algo``, ``short`` (name in suggestions, e.g. ``int4-awq``), ``label`` (human text).
    * ``builds_on``: SM ranges where trtllm-build 1.2 accepts it; ``warn_on``: SMs where the
      builder accepts it but the support matrix does not list it; ``needs``: the requirement in
      words (refusals); ``refusal``: set = no TensorRT-LLM 1.2 build on any GPU (the text says why).
    * ``weight_bits``: payload bits per weight, scales excluded (None: the model dtype -- NO_QUANT --
      or per layer -- ``per_layer``); ``scales``: ``ScaleLayout``; ``grouping``: ``per_group``
      (AWQ: ``quantization.group_size``, default ``AWQ_DEFAULT_GROUP``), ``fixed_block``
      (NVFP4: ``NVFP4_BLOCK``), ``mx_block`` (MXFP4/MXFP8: ``MX_BLOCK``), ``none``; ``pack``: weights per stored
      element (4-bit formats: 2).
    * ``modelopt_preset``: ModelOpt config name (None: exported without PTQ, or per layer);
      ``modelopt_adjust``: how the quantize stage adjusts the preset (``int4_block``: INT4
      ``*weight_quantizer`` ``block_sizes[-1] = group_size``; ``smoothquant``: ``algorithm =
      {"method": "smoothquant", "alpha": smoothquant_alpha}``); ``modelopt_format``: ModelOpt
      export's per-module format string (``get_quantization_format``); ``exported``: the quantize
      stage produces it; ``not_exported``: (reason, fix) when it does not although TensorRT-LLM runs the format
      somewhere (resolve refuses a build without ``--checkpoint``, rule ``quantize.modelopt_inputs``).
    * ``stored_dtype``: safetensors dtype(s) of the exported weight tensor; ``codec``: name of the
      codec class that dequantizes it (``checkpoint/codecs.py`` ``CODECS``); ``act_fake_quant``:
      the activation fake-quant the checkpoint implies (also: an ``activation_scaling_factor``
      is required).
    * ``search_bits``: set = usable as a MIXED_PRECISION candidate, with these bits in the
      search's cost model; ``search_cuda_only``: ModelOpt's fake-quant asserts CUDA;
      ``aliases``: other names accepted for it as a candidate (its ``modelopt_preset`` too).
    * ``per_layer``: one format per layer from ``quant_cfg.json`` (MIXED_PRECISION).
    * builder facts: ``fp8_context_fmha`` (builder keeps ``use_fp8_context_fmha``),
      ``fused_mlp`` (``use_fused_mlp``), ``auto_gemm_plugin`` (``--gemm_plugin`` for ``auto``, and
      why; None = the model dtype), ``own_gemm_plugin`` (the plugin named after this format),
      ``plugin_off_warning`` (text when ``gemm_plugin: disable``).
    * ``suggest_rank``: order when suggested instead of a refused format (None: never suggested);
      ``fix_gpus_first``: the SM refusal's fix names this format's GPUs first (narrow SM range).
    * ``source``: where the facts were read.
    """

    algo: QuantAlgo
    short: str
    label: str
    builds_on: SmRanges
    needs: str
    source: str
    weight_bits: Optional[float]
    scales: ScaleLayout
    stored_dtype: tuple[str, ...]
    codec: Optional[str]
    modelopt_preset: Optional[str] = None
    modelopt_adjust: Optional[Literal["int4_block", "smoothquant"]] = None
    modelopt_format: Optional[str] = None
    exported: bool = True
    act_fake_quant: Optional[ActFakeQuant] = None
    grouping: Literal["none", "per_group", "fixed_block", "mx_block"] = "none"
    pack: int = 1
    search_bits: Optional[int] = None
    search_cuda_only: bool = False
    aliases: tuple[str, ...] = ()
    per_layer: bool = False
    warn_on: SmRanges = ()
    refusal: str = ""
    fp8_context_fmha: bool = False
    fused_mlp: bool = False
    auto_gemm_plugin: Optional[tuple[str, str]] = None
    own_gemm_plugin: Optional[str] = None
    plugin_off_warning: str = ""
    suggest_rank: Optional[int] = None
    fix_gpus_first: bool = False
    not_exported: Optional[tuple[str, str]] = None

    kind = "gemm"

    # -- look-ups -------------------------------------------------------------------------
    @property
    def value(self) -> str:
        """The profile / config.json name (``QuantAlgo`` value)."""
        return self.algo.value

    @property
    def is_quantized(self) -> bool:
        """False for the unquantized format (model-dtype GEMMs)."""
        return self.weight_bits is not None or self.per_layer

    @property
    def fixed_block(self) -> Optional[int]:
        """Elements per scale of a fixed-block format (NVFP4: ``NVFP4_BLOCK``; MX formats: ``MX_BLOCK``), else None."""
        return {"fixed_block": NVFP4_BLOCK, "mx_block": MX_BLOCK}.get(self.grouping)

    @property
    def needs_act_scale(self) -> bool:
        """Each linear of this format must carry an ``activation_scaling_factor``."""
        return self.act_fake_quant is not None


    def linear_bytes(self, n_in: int, n_out: int, group_size: Optional[int] = None, dtype_bytes: int = 2,
                     bits: Optional[float] = None) -> float:
        """Bytes of one linear's checkpoint tensors (weight + scales) for ``n_in x n_out``.

        ``group_size``: AWQ group (default ``AWQ_DEFAULT_GROUP``); ``dtype_bytes``: model dtype
        (unquantized weights, pre-quant scales); ``bits``: MIXED_PRECISION's budget (estimate;
        8 when None). Source: SRC_CKPT.
        """
        n = n_in * n_out
        if self.per_layer:
            return n * (bits or 8.0) / 8
        if self.weight_bits is None:
            return n * dtype_bytes
        return n * self.weight_bits / 8 + self.scales.bytes(n_in, n_out, group_size, dtype_bytes)


@dataclass(frozen=True)
class KvFormat(_BuildsOn):
    """Everything the pipeline knows about one ``quantization.kv_cache_quant_algo``.

    ``builds_on`` / ``needs`` / ``source`` as for ``GemmFormat``; ``bytes_per_element``: bytes of
    one cached K or V value (NVFP4: 0.5 + one FP8 scale per 16); ``modelopt_preset``: ModelOpt KV
    config merged into the PTQ config (None: nothing to merge); ``not_exported``: (reason, fix)
    when the quantize stage cannot produce it; ``fake_quant``: the codec's fake-quant of the
    cached K/V (None: unquantized); ``cpu_model``: the checkpoint reader's CPU model reproduces it
    (NVFP4 KV: the meaning of the exported scales for TensorRT-LLM's FP4 cache was not verified);
    ``paged_context_fmha``: paged context FMHA works with it (builder.py turns it off for INT8);
    ``fp8_context_fmha``: FP8 context FMHA reads it (with paged context FMHA the builder
    couples the two).
    """

    algo: KVCacheQuantAlgo
    short: str
    label: str
    builds_on: SmRanges
    needs: str
    source: str
    bytes_per_element: float
    modelopt_preset: Optional[str] = None
    not_exported: Optional[tuple[str, str]] = None
    fake_quant: Optional[ActFakeQuant] = None
    cpu_model: bool = True
    paged_context_fmha: bool = True
    fp8_context_fmha: bool = False

    kind = "kv"
    warn_on: SmRanges = ()
    refusal: str = ""

    @property
    def value(self) -> str:
        return self.algo.value

    @property
    def is_quantized(self) -> bool:
        return self.fake_quant is not None



E = TypeVar("E", bound=Enum)
T = TypeVar("T")


class FormatTable(Mapping, Generic[E, T]):
    """Read-only ``{enum member: entry}``; looked up by member or by its string value (a
    ``str`` enum hashes as its value). Iterates in declaration order. ``KeyError`` for an
    unknown name."""

    def __init__(self, enum: type[E], entries: Iterable[T]):
        self.enum = enum
        self._by: dict[E, T] = {}
        for e in entries:
            if e.algo in self._by:  # type: ignore[attr-defined]
                raise ValueError(f"two entries for {e.algo!r}")  # type: ignore[attr-defined]
            self._by[e.algo] = e  # type: ignore[attr-defined]

    def __getitem__(self, key: Any) -> T:
        try:
            return self._by[self.enum(getattr(key, "value", key))]
        except ValueError:
            raise KeyError(key) from None

    def __iter__(self) -> Iterator[E]:
        return iter(self._by)

    def __len__(self) -> int:
        return len(self._by)

    def get(self, key: Any, default: Any = None) -> Any:
        try:
            return self[key]
        except KeyError:
            return default

    def runnable_on(self, sm: int) -> list[T]:
        """Entries that build on ``sm``, in declaration order."""
        return [e for e in self._by.values() if e.supports(sm)]  # type: ignore[attr-defined]


SRC_MODE_MX = ("tensorrt_llm/quantization/mode.py:44-46 (QuantAlgo W4A8_MXFP4_FP8, W4A8_MXFP4_MXFP8, W4A16_MXFP4; "
               "QUANT_ALGO_LIST = every name but INT8, line 50)")
SRC_MX_ENGINE = ("NVIDIA/TensorRT-LLM has no MXFP4 engine model: tensorrt_llm/models/gpt_oss/convert.py (the only MXFP4 "
                 "weight conversion for trtllm-build in the stored sources) exists in forks only (Isekai-Creation, "
                 "gkswns0531, radna0), and tensorrt_llm/quantization/layers.py has FP4 linears for NVFP4 only")
SRC_MX_MOE = ("tensorrt_llm/_torch/modules/fused_moe/fused_moe_cutlass.py CutlassFusedMoE._QUANT_SUPPORT_TABLE "
              "(W4A16_MXFP4: SM 90; W4A8_MXFP4_FP8: SM 100/103; W4A8_MXFP4_MXFP8: SM 100/103/120/121; MXFP8: SM 100/103, "
              "'the fused kernel is M3.2'); tensorrt_llm/_torch/model_config.py ModelConfig.get_mxfp4_quant_algo (an HF "
              "quant_method mxfp4 checkpoint loads as W4A16_MXFP4 below SM 100, W4A8_MXFP4_MXFP8 from SM 100, "
              "W4A8_MXFP4_FP8 with the TRITON MoE backend)")
SRC_MXFP4_TENSOR = ("modelopt/torch/quantization/qtensor/mxfp4_tensor.py MXFP4QTensor (ModelOpt 0.47: E2M1 codes, low "
                    "nibble = even element; E8M0 scale = ceil(log2(amax/6)) + 127 per 32)")
_MX_ENGINE_REFUSAL = ("{} is a TensorRT-LLM QuantAlgo of the PyTorch backend only: trtllm-build 1.2 has no MXFP4 "
                      "layers (no MXFP4 engine model upstream), so the engine route cannot build it on any GPU.")
_MX_NOT_EXPORTED = ("the quantize stage does not produce MX formats: ModelOpt 0.47's MX fake-quant needs its CUDA "
                    "extension ('Skipping extension modelopt_cuda_ext_mx because CUDA is not available'), and no "
                    "ModelOpt 0.47 config writes W4A16_MXFP4 or W4A8_MXFP4_MXFP8 (MXFP4_DEFAULT_CFG and "
                    "MXFP4_MLP_WEIGHT_ONLY_CFG export the format string 'mxfp4', not a TensorRT-LLM name).",
                    "give an MXFP4 checkpoint with --checkpoint (e.g. gpt-oss's own, quant_method mxfp4), or use "
                    "NVFP4 on Blackwell / W4A16_AWQ on Hopper.")
_INT_SM100 = "is refused by trtllm-build on SM 100-119 ('INT8/INT4 quantization is not supported on SM>=100')"
_NO_SCALES = ScaleLayout("none")

# GEMM formats (quantization.quant_algo) --------------------------------------------------------
GEMM: FormatTable[QuantAlgo, GemmFormat] = FormatTable(QuantAlgo, [
    GemmFormat(QuantAlgo.NO_QUANT, "bf16", "BF16 (no quantization)", ((80, ANY),),
               "BF16 needs SM >= 80 (Ampere or newer)", f"{SRC_SUPPORT}; {SRC_CKPT}",
               weight_bits=None, scales=_NO_SCALES, stored_dtype=("BF16", "F16", "F32"), codec="plain",
               suggest_rank=5),
    GemmFormat(QuantAlgo.FP8, "fp8", "FP8 E4M3, per-tensor scales", ((89, ANY),),
               "FP8 GEMMs need SM >= 89 (Ada, Hopper, Blackwell)",
               f"{SRC_QUANT_MD}; {SRC_CKPT}; {SRC_MODELOPT_CFG}; {SRC_SEARCH}; {SRC_PERF}",
               weight_bits=8, scales=ScaleLayout("per_tensor", scalars=2), stored_dtype=("F8_E4M3",), codec="fp8",
               modelopt_preset="FP8_DEFAULT_CFG", modelopt_format="fp8", act_fake_quant="fp8",
               search_bits=8, fp8_context_fmha=True, fused_mlp=True,
               auto_gemm_plugin=("disable", "FP8 GEMMs via TensorRT Q/DQ fusion; GEMM plugin off for FP8 "
                                            "(docs/source/performance/perf-best-practices.md, GEMM Plugin)"),
               own_gemm_plugin="fp8", suggest_rank=0),
    GemmFormat(QuantAlgo.W4A16_AWQ, "int4-awq", "INT4 AWQ weights, BF16 activations", ((80, 99), (120, ANY)),
               f"INT4 weight-only (AWQ) {_INT_SM100}", f"{SRC_BUILDER}; {SRC_CKPT}; {SRC_MODELOPT_CFG}; {SRC_SEARCH}",
               weight_bits=4, scales=ScaleLayout("per_group", prequant=True), stored_dtype=("I8",), codec="int4_awq",
               modelopt_preset="INT4_AWQ_CFG", modelopt_adjust="int4_block", modelopt_format="int4_awq",
               grouping="per_group", pack=2, search_bits=4, aliases=("INT4_AWQ",), warn_on=((120, ANY),),
               suggest_rank=4),
    GemmFormat(QuantAlgo.W4A8_AWQ, "w4a8-awq", "INT4 AWQ weights, FP8 activations", ((89, 90),),
               "W4A8 AWQ needs Ada or Hopper: SM 89 or 90", f"{SRC_QUANT_MD}; {SRC_CKPT}; {SRC_MODELOPT_CFG}",
               weight_bits=4, scales=ScaleLayout("per_group", scalars=2, prequant=True), stored_dtype=("I8",),
               codec="int4_awq", modelopt_preset="W4A8_AWQ_BETA_CFG", modelopt_adjust="int4_block",
               modelopt_format="w4a8_awq", act_fake_quant="fp8", grouping="per_group", pack=2,
               fp8_context_fmha=True, suggest_rank=2, fix_gpus_first=True),
    GemmFormat(QuantAlgo.NVFP4, "nvfp4", "NVFP4 (FP4 E2M1, FP8 scale per 16 elements)", ((100, 100), (103, 103), (120, 121)),
               "NVFP4 needs Blackwell: SM 100, 103, 120 or 121",
               f"{SRC_QUANT_MD}; {SRC_CKPT}; modelopt/torch/quantization/qtensor/nvfp4_tensor.py; {SRC_SEARCH}",
               weight_bits=4, scales=ScaleLayout("per_block", scalars=2), stored_dtype=("U8",), codec="nvfp4",
               modelopt_preset="NVFP4_DEFAULT_CFG", modelopt_format="nvfp4", act_fake_quant="nvfp4",
               grouping="fixed_block", pack=2, search_bits=4, search_cuda_only=True, fp8_context_fmha=True,
               auto_gemm_plugin=("nvfp4", f"NVFP4 checkpoints turn the NVFP4 GEMM plugin on ({SRC_BUILDER})"),
               own_gemm_plugin="nvfp4",
               plugin_off_warning="NVFP4 GEMMs without the NVFP4 plugin use TensorRT's own (OOTB) kernels.",
               suggest_rank=1, fix_gpus_first=True),
    GemmFormat(QuantAlgo.W8A8_SQ_PER_CHANNEL, "int8-sq", "INT8 SmoothQuant (per-channel weights)", ((80, 99), (120, ANY)),
               "INT8 SmoothQuant is refused by trtllm-build on SM 100-119 ('SmoothQuant is not supported on SM>=100')",
               f"{SRC_BUILDER}; {SRC_CKPT}; {SRC_MODELOPT_CFG}",
               weight_bits=8, scales=ScaleLayout("per_channel", scalars=1, prequant=True), stored_dtype=("I8",),
               codec="int8_channel", modelopt_preset="INT8_SMOOTHQUANT_CFG", modelopt_adjust="smoothquant",
               modelopt_format="int8_sq", act_fake_quant="int8", warn_on=((120, ANY),), suggest_rank=3),
    GemmFormat(QuantAlgo.W8A16, "int8-wo", "INT8 weight-only (per-channel)", ((80, 99), (120, ANY)),
               f"INT8 weight-only {_INT_SM100}", f"{SRC_BUILDER}; {SRC_CKPT}; {SRC_MODELOPT_CFG}",
               weight_bits=8, scales=ScaleLayout("per_channel"), stored_dtype=("I8",), codec="int8_channel",
               modelopt_preset="INT8_WEIGHT_ONLY_CFG", modelopt_format="int8_wo", warn_on=((120, ANY),)),
    GemmFormat(QuantAlgo.W4A16_NVFP4, "w4a16-nvfp4", "NVFP4 weights, BF16 activations", (),
               "W4A16_NVFP4 is not a TensorRT-LLM 1.2 QuantAlgo", f"{SRC_MODE}; {SRC_CKPT}",
               # codec None: the reader refuses it (never exported here, and trtllm-build cannot build it)
               weight_bits=4, scales=ScaleLayout("per_block", scalars=2), stored_dtype=("U8",), codec=None,
               modelopt_preset="W4A16_NVFP4_CFG", exported=False, grouping="fixed_block", pack=2,
               refusal="W4A16_NVFP4 is written by ModelOpt (W4A16_NVFP4_CFG) but is not in TensorRT-LLM 1.2's "
                       "QUANT_ALGO_LIST, so trtllm-build cannot build it on any GPU."),
    # MX formats: TensorRT-LLM runs them on the PyTorch backend only (the llm_api route's rows in spec/capability.py);
    # builds_on () = no trtllm-build 1.2 engine (SRC_MX_ENGINE). None is exported by the quantize stage (_MX_NOT_EXPORTED).
    GemmFormat(QuantAlgo.W4A16_MXFP4, "w4a16-mxfp4", "MXFP4 weights (E2M1, E8M0 scale per 32), BF16 activations", (),
               "W4A16_MXFP4 runs on the llm_api route only (PyTorch backend MoE, SM 90)",
               f"{SRC_MODE_MX}; {SRC_MX_ENGINE}; {SRC_MX_MOE}; {SRC_MXFP4_TENSOR}",
               # modelopt_format None: ModelOpt's 'mxfp4' string also covers MXFP4 activations (no TensorRT-LLM name)
               weight_bits=4, scales=ScaleLayout("per_mx_block"), stored_dtype=("U8",), codec="mxfp4",
               exported=False, grouping="mx_block", pack=2,
               refusal=_MX_ENGINE_REFUSAL.format("W4A16_MXFP4"), not_exported=_MX_NOT_EXPORTED),
    GemmFormat(QuantAlgo.W4A8_MXFP4_FP8, "w4a8-mxfp4-fp8", "MXFP4 weights, FP8 per-tensor activations", (),
               "W4A8_MXFP4_FP8 runs on the llm_api route only (PyTorch backend MoE, SM 100 or 103)",
               f"{SRC_MODE_MX}; {SRC_MX_ENGINE}; {SRC_MX_MOE}; {SRC_MXFP4_TENSOR}",
               weight_bits=4, scales=ScaleLayout("per_mx_block", scalars=1), stored_dtype=("U8",), codec="mxfp4",
               modelopt_preset="W4A8_MXFP4_FP8_CFG", modelopt_format="w4a8_mxfp4_fp8", exported=False,
               act_fake_quant="fp8", grouping="mx_block", pack=2,
               refusal=_MX_ENGINE_REFUSAL.format("W4A8_MXFP4_FP8"), not_exported=_MX_NOT_EXPORTED),
    GemmFormat(QuantAlgo.W4A8_MXFP4_MXFP8, "w4a8-mxfp4-mxfp8", "MXFP4 weights, MXFP8 activations", (),
               "W4A8_MXFP4_MXFP8 runs on the llm_api route only (PyTorch backend MoE, SM 100, 103, 120 or 121)",
               f"{SRC_MODE_MX}; {SRC_MX_ENGINE}; {SRC_MX_MOE}; {SRC_MXFP4_TENSOR}",
               weight_bits=4, scales=ScaleLayout("per_mx_block"), stored_dtype=("U8",), codec="mxfp4",
               exported=False, grouping="mx_block", pack=2,
               refusal=_MX_ENGINE_REFUSAL.format("W4A8_MXFP4_MXFP8"), not_exported=_MX_NOT_EXPORTED),
    GemmFormat(QuantAlgo.MXFP8, "mxfp8", "MXFP8 (FP8 E4M3, E8M0 scale per 32) weights and activations", (),
               "MXFP8 runs on the llm_api route with TensorRT-LLM 1.3 only (PyTorch backend MoE, SM 100 or 103)",
               f"{SRC_MX_MOE}; {SRC_MODELOPT_CFG} (MXFP8_DEFAULT_CFG); shared/reference/trtllm-1.2-build-reference.md "
               "section 4 (not in the 1.2 QuantAlgo enum)",
               weight_bits=8, scales=ScaleLayout("per_mx_block"), stored_dtype=("F8_E4M3",), codec=None,
               modelopt_preset="MXFP8_DEFAULT_CFG", modelopt_format="mxfp8", exported=False, grouping="mx_block",
               refusal="MXFP8 is not a TensorRT-LLM 1.2 QuantAlgo (tensorrt_llm/quantization/mode.py), so "
                       "trtllm-build cannot build it on any GPU.", not_exported=_MX_NOT_EXPORTED),
    GemmFormat(QuantAlgo.MIXED_PRECISION, "mixed", "per-layer formats (mtq.auto_quantize)", ((80, ANY),),
               "each candidate format must run on the GPU", f"{SRC_MODE}; {SRC_SEARCH}",
               weight_bits=None, scales=_NO_SCALES, stored_dtype=(), codec=None, per_layer=True, fused_mlp=True),
])

# KV-cache formats (quantization.kv_cache_quant_algo) -------------------------------------------
KV: FormatTable[KVCacheQuantAlgo, KvFormat] = FormatTable(KVCacheQuantAlgo, [
    KvFormat(KVCacheQuantAlgo.NONE, "bf16", "KV cache in the model dtype", ((80, ANY),),
             "a BF16 KV cache needs SM >= 80", SRC_SUPPORT, 2.0),
    KvFormat(KVCacheQuantAlgo.FP8, "fp8", "FP8 KV cache", ((80, ANY),),
             "an FP8 KV cache needs SM >= 80 (the matrix lists it for Ampere too)",
             f"{SRC_QUANT_MD}; {SRC_MODELOPT_CFG}; {SRC_BUILDER}", 1.0,
             modelopt_preset="FP8_KV_CFG", fake_quant="fp8", fp8_context_fmha=True),
    KvFormat(KVCacheQuantAlgo.INT8, "int8", "INT8 KV cache", ((80, 99), (120, ANY)),
             "an INT8 KV cache " + _INT_SM100, f"{SRC_BUILDER}; {SRC_MODELOPT_CFG}", 1.0,
             not_exported=INT8_KV_NOT_EXPORTED, fake_quant="int8", paged_context_fmha=False),
    KvFormat(KVCacheQuantAlgo.NVFP4, "nvfp4", "NVFP4 KV cache", ((100, 100), (103, 103), (120, 121)),
             "an NVFP4 KV cache needs Blackwell: SM 100, 103, 120 or 121",
             f"{SRC_MODE}; {SRC_QUANT_MD}; {SRC_MODELOPT_CFG}", 0.5 + 1 / 16,
             modelopt_preset="NVFP4_KV_CFG", fake_quant="nvfp4", cpu_model=False),
])

# Facts derived from the registry (string values, for messages and membership tests).
SUGGEST_ORDER = tuple(f.value for f in sorted((f for f in GEMM.values() if f.suggest_rank is not None),
                                               key=lambda f: f.suggest_rank))
FP8_CONTEXT_FMHA_ALGOS = tuple(f.value for f in GEMM.values() if f.fp8_context_fmha)
AWQ_ALGOS = tuple(f.value for f in GEMM.values() if f.grouping == "per_group")
KV_BYTES = {k.algo: k.bytes_per_element for k in KV.values()}  # bytes per K or V element
# Quant algos for which the builder keeps use_fp8_context_fmha needs SM >= 89 (builder.py build()).
FP8_CONTEXT_FMHA_MIN_SM = 89


def gemm(algo: Any) -> GemmFormat:
    """``GEMM[algo]`` (``QuantAlgo`` member or its string); a missing / null name is NO_QUANT
    (config.json writes ``quant_algo: null`` for an unquantized checkpoint)."""
    return GEMM[algo or QuantAlgo.NO_QUANT]


def kv(algo: Any) -> KvFormat:
    """``KV[algo]``; a missing / null name is NONE."""
    return KV[algo or KVCacheQuantAlgo.NONE]


def linear_weight_bytes(algo: Any, n_in: int, n_out: int, group_size: Optional[int], dtype_bytes: int = 2,
                        bits: Optional[float] = None) -> float:
    """Bytes of one quantized linear's checkpoint tensors (weight + scales), for ``n_in x n_out``:
    ``GEMM[algo].linear_bytes(...)`` (an unknown name counts as unquantized).

    Per SRC_CKPT: FP8: F8 weight + F32 weight & activation scales. NVFP4: packed U8 (0.5 B/elt) +
    F8 scale per 16 inputs + two F32 scalars. W4A16_AWQ: int4 (0.5 B/elt) + F32 scale per group +
    BF16 pre-quant scale per input; W4A8_AWQ adds two F32 scalars. W8A8_SQ_PER_CHANNEL: I8 + F32
    per output channel + F32 activation scale + BF16 pre-quant scale. W8A16: I8 + F32 per output.
    MIXED_PRECISION: ``bits`` per element (estimate). NO_QUANT: model dtype.
    """
    fmt = GEMM.get(algo) or GEMM[QuantAlgo.NO_QUANT]
    return fmt.linear_bytes(n_in, n_out, group_size, dtype_bytes, bits)


# Names of formats ModelOpt can produce that are not TensorRT-LLM 1.2 QuantAlgo values at all (so they
# are not in the QuantAlgo enum): name a profile might use -> (reason, fix). Per-tensor INT8 is ModelOpt's
# INT8_DEFAULT_CFG (modelopt/torch/quantization/config.py); TensorRT-LLM 1.2 builds INT8 activations only
# per channel with SmoothQuant (W8A8_SQ_PER_CHANNEL) or INT8 weight-only (W8A16) (SRC_MODE).
_INT8_PER_TENSOR = ("per-tensor INT8 (ModelOpt INT8_DEFAULT_CFG) is not a quant_algo TensorRT-LLM 1.2 builds.",
                    "use W8A8_SQ_PER_CHANNEL (SmoothQuant, INT8 activations) or W8A16 (INT8 weight-only).")
# ModelOpt's MXFP4_DEFAULT_CFG quantizes weights AND activations to MXFP4 and exports the format string 'mxfp4'
# (modelopt/torch/export/quant_utils.py: no TensorRT-LLM name for it); TensorRT-LLM's MXFP4 QuantAlgos keep
# activations in BF16, FP8 or MXFP8 (SRC_MODE_MX).
_MXFP4_W4A4 = ("MXFP4 weights and activations (ModelOpt MXFP4_DEFAULT_CFG, exported as 'mxfp4') is not a TensorRT-LLM "
               "QuantAlgo.", "use W4A16_MXFP4 (SM 90), W4A8_MXFP4_MXFP8 (SM 100-121) or W4A8_MXFP4_FP8 (SM 100/103), "
                             "all on route: llm_api.")
NOT_TRTLLM_NAMES: dict[str, tuple[str, str]] = {
    "INT8": _INT8_PER_TENSOR, "INT8_DEFAULT": _INT8_PER_TENSOR, "INT8_DEFAULT_CFG": _INT8_PER_TENSOR,
    "W8A8": _INT8_PER_TENSOR, "W8A8_SQ_PER_TENSOR": _INT8_PER_TENSOR, "INT8_SQ": _INT8_PER_TENSOR,
    "MXFP4": _MXFP4_W4A4, "MXFP4_DEFAULT_CFG": _MXFP4_W4A4, "W4A4_MXFP4": _MXFP4_W4A4,
}


def buildable_gemm_names() -> list[str]:
    """quant_algo values a profile may name that TensorRT-LLM 1.2 can build on some GPU (registry order)."""
    return [f.value for f in GEMM.values() if not f.refusal]


def refuse_gemm_name(value: Any) -> Optional[tuple[str, str]]:
    """(reason, fix) when ``value`` is not an acceptable quant_algo name, else None.

    The fix lists only buildable values (``buildable_gemm_names``), never one the resolve stage then
    refuses; a ModelOpt-only name (``NOT_TRTLLM_NAMES``) or an unbuildable QuantAlgo gets its own
    reason and the buildable alternative.
    """
    if isinstance(value, QuantAlgo) or (isinstance(value, str) and GEMM.get(value) is not None):
        return None  # a QuantAlgo; one TensorRT-LLM cannot build is refused by rule format.trtllm_buildable
    listed = ", ".join(buildable_gemm_names())
    if isinstance(value, str) and value.upper() in NOT_TRTLLM_NAMES:
        reason, fix = NOT_TRTLLM_NAMES[value.upper()]
        return reason, fix
    shown = repr(value) if isinstance(value, str) and len(value) <= 40 else type(value).__name__
    return f"{shown} is not a quant_algo; TensorRT-LLM 1.2 builds {listed}.", f"use one of: {listed}."


def supported_alternatives(sm: int, exclude: Any = "") -> list[GemmFormat]:
    """GEMM formats of SUGGEST_ORDER that run on ``sm`` (minus ``exclude``)."""
    ex = getattr(exclude, "value", exclude)
    return [GEMM[a] for a in SUGGEST_ORDER if a != ex and GEMM[a].supports(sm)]


# ---------------------------------------------------------------------------------------------
# Search candidates (MIXED_PRECISION): the user-input checks, one place (resolve rule
# quantize.modelopt_inputs and the quantize stage call them)

FIELD_SEARCH_BITS = "quantization.auto_quantize_bits"
FIELD_SEARCH_FORMATS = "quantization.auto_quantize_formats"
UNQUANTIZED_SEARCH_BITS = 16  # a layer the search leaves unquantized, in its cost model
SEARCH_CANDIDATES = tuple(f for f in GEMM.values() if f.search_bits is not None)
SEARCH_BITS = {GEMM[QuantAlgo.NO_QUANT].value: UNQUANTIZED_SEARCH_BITS,
               **{f.value: f.search_bits for f in SEARCH_CANDIDATES}}
SEARCH_ALIASES = {a: f.value for f in SEARCH_CANDIDATES for a in f.aliases + (f.modelopt_preset,) if a}


def normalize_candidates(formats: Iterable[Any], cuda_available: bool) -> list[str]:
    """Search candidates (``QuantAlgo`` members or names; aliases and ModelOpt preset names
    accepted, any case) as ``QuantAlgo`` values, deduplicated in order.

    Raises ``UserError`` (``quantization.auto_quantize_formats``) for an empty list, a format
    that is not a candidate (``GemmFormat.search_bits`` unset), or a CUDA-only candidate
    without CUDA. Source: SRC_SEARCH.
    """
    names = [SEARCH_ALIASES.get(n, n) for n in (str(getattr(f, "value", f)).strip().upper() for f in formats)]
    cands = [f.value for f in SEARCH_CANDIDATES]
    bad = [n for n in names if n not in cands]
    if bad:
        raise UserError(FIELD_SEARCH_FORMATS, f"{', '.join(bad)} cannot be a per-layer search candidate (ModelOpt's "
                        "auto_quantize candidates exported and read here: " + ", ".join(cands) + ").",
                        "use candidates from: " + ", ".join(cands) + ".")
    out: list[str] = []
    for name in names:
        if GEMM[name].search_cuda_only and not cuda_available:
            cpu_ok = " and ".join(f.value for f in SEARCH_CANDIDATES if not f.search_cuda_only)
            raise UserError(FIELD_SEARCH_FORMATS, f"{name} cannot be a search candidate without a CUDA GPU: ModelOpt's "
                            "fake-quantized forward asserts 'amax must be a CUDA tensor for dynamic block "
                            "quantization' on CPU, and auto_quantize scores every candidate by running it.",
                            f"search over {cpu_ok} on CPU, or run the search on a GPU machine.")
        if name not in out:
            out.append(name)
    if not out:
        raise UserError(FIELD_SEARCH_FORMATS, "no candidate formats given for the per-layer search.",
                        "list at least one, e.g. [FP8, W4A16_AWQ].")
    return out


def check_search_bits(effective_bits: Any, formats: list[str]) -> float:
    """The search budget as a float: in (0, 16] and at least the cheapest candidate's bits.

    ``formats``: candidates from ``normalize_candidates``. Raises ``UserError``
    (``quantization.auto_quantize_bits``) otherwise.
    """
    try:
        eb = float(effective_bits)
    except (TypeError, ValueError):
        raise UserError(FIELD_SEARCH_BITS, f"{effective_bits!r} is not a number.", "give the bits budget, e.g. 6.0.")
    lowest = min(SEARCH_BITS[f] for f in formats)
    if not (0 < eb <= UNQUANTIZED_SEARCH_BITS):
        raise UserError(FIELD_SEARCH_BITS, f"{eb} is outside (0, 16].", "give a budget between the candidates' bits and 16.")
    if eb < lowest:
        raise UserError(FIELD_SEARCH_BITS, f"a budget of {eb} bits per weight is below the cheapest candidate "
                        f"({lowest} bits: {', '.join(f for f in formats if SEARCH_BITS[f] == lowest)}).",
                        f"raise the budget to at least {lowest}, or add a cheaper candidate format.")
    return eb


# ---------------------------------------------------------------------------------------------
# Other tables

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# BuildConfig defaults when a limit is left out (tensorrt_llm/builder.py BuildConfig).
DEFAULT_MAX_INPUT_LEN = 1024
DEFAULT_MAX_NUM_TOKENS = 8192
DEFAULT_MAX_SEQ_LEN_NO_POSITIONS = 2048  # _init_max_seq_len when max_position_embeddings is None
MAX_NUM_TOKENS_ADVISED = 16384  # _common.check_max_num_tokens warns above this

# Triton data types of the tensorrt_llm model's logits outputs (tensorrtllm_backend config.pbtxt).
TRITON_DTYPE = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}
# trtllm-build --logits_dtype choices (tensorrt_llm/commands/build.py).
LOGITS_DTYPES_TRTLLM_BUILD = ("float16", "float32")

# Memory planning constants (estimates, documented in build/precision_pipeline/resolve/plan.py).
RUNTIME_RESERVE_BYTES = 1 << 30  # CUDA context, cuBLAS/NCCL workspaces, Triton: ~1 GiB (estimate)


def join_or(items: list[str]) -> str:
    """'a', 'a or b', 'a, b or c'."""
    items = list(items)
    if not items:
        return ""
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " or " + items[-1]


__all__ = [n for n in dir() if n.isupper() or n in (
    "ScaleLayout", "GemmFormat", "KvFormat", "FormatTable", "gemm", "kv", "sm_text", "linear_weight_bytes",
    "supported_alternatives", "join_or", "normalize_candidates", "check_search_bits")]
