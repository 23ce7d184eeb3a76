"""The model-family registry: one entry per Hugging Face architecture (``config.json`` ``architectures[0]``).

Beside the format registry (``spec/formats.py``): every fact about a model family that more than one stage
reads lives here, and the stages look it up (torch-free):

* ``architecture`` (HF class name), ``model_type`` (HF ``config.json``), ``trtllm_class`` (the TensorRT-LLM
  1.2 model class that builds it), ``export_decoder`` (the ModelOpt decoder type the quantize stage exports
  it as; None: the pipeline plans it but does not quantize it);
* ``linears``: each decoder-layer linear, HF name <-> TensorRT-LLM name, with its tensor-parallel kind
  (``column``: output rows split over tp; ``row``: input columns split over tp);
* ``fused``: linears TensorRT-LLM runs as one GEMM (QKV) or fuses at build time (gate/up): excluding one
  member of a group keeps the whole group in high precision;
* ``norms`` (HF -> TensorRT-LLM), ``attention_bias`` (q/k/v carry a bias: ``Family.bias_linears``);
* ``trtllm_config``: the TensorRT-LLM checkpoint ``config.json`` fields the family's TensorRT-LLM model class reads
  beyond the Llama ones (Qwen's ``qwen_type``, ``attn_bias``, ``mlp_bias``), which ModelOpt writes only through
  TensorRT-LLM's own ``from_hugging_face`` when tensorrt_llm is installed: the quantize stage writes them;
* ``sliding_window``: the family's HF config may set an attention window (``config.json`` ``sliding_window``);
* ``moe``: the router and the expert linears (None for a dense family);
* ``routes`` and ``trtllm_versions``: the serving routes that run it (on each route's TensorRT-LLM lines,
  ``spec/capability.py`` ``ROUTE_LINES``; ``spec/capability.py`` ``family_row`` is the one question resolve asks) and
  the TensorRT-LLM versions whose sources the entry was read from;
* ``gate_reader``: the accuracy gate's reader of the family's exported checkpoints (None: the gate does
  not read it, so ``invoke build`` refuses it at resolve, rule ``model.gate_reads``, naming the stages
  ``Family.build_gaps`` lists; planning from config.json needs none of them);
* ``hf_read``: on route llm_api the family's unified HF checkpoint is exported, verified and gated in its own HF names
  (Qwen3, Qwen3-MoE, Mixtral, Qwen2-MoE: ``gate/moe_model.py``), with no ``export_decoder`` / ``gate_reader``;
* ``sources``: where each fact comes from.

Name facts (TensorRT-LLM 1.2):

* ``tensorrt_llm/models/model_weights_loader.py:50-61`` (``tllm_to_externel_key_dict``): ``qkv`` ->
  [q_proj, k_proj, v_proj], ``dense`` -> o_proj, ``gate`` -> up_proj, ``proj`` -> down_proj,
  ``fc`` -> gate_proj, ``post_layernorm`` -> post_attention_layernorm, ``ln_f`` -> norm.
* ``tensorrt_llm/models/llama/convert.py`` (``convert_hf_llama``): ``mlp.gate_proj`` -> ``mlp.fc``
  (split dim 0, column), ``mlp.up_proj`` -> ``mlp.gate`` (dim 0, column), ``mlp.down_proj`` ->
  ``mlp.proj`` (dim 1, row), ``o_proj`` -> ``attention.dense`` (dim 1, row), q/k/v split per rank and
  concatenated ``[q; k; v]``; MoE: ``experts.w3`` and ``experts.w1`` concatenated ``[w3; w1]`` into
  ``mlp.fc``, ``experts.w2`` -> ``mlp.proj``, ``block_sparse_moe.gate`` -> ``mlp.router`` (FP32).
* ``tensorrt_llm/models/modeling_utils.py`` ``fuse_gate_mlp``: gate and fc are fused into one GEMM at
  build time (FP8), so they must share a format.
* ModelOpt 0.47 ``modelopt/torch/export/model_utils.py``: MixtralForCausalLM exports with decoder
  type ``"llama"`` (the experts by the same path).
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Optional

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec.algos import KVCacheQuantAlgo, QuantAlgo

COLUMN, ROW = "column", "row"
MOE_HF_READ_FORMATS = (QuantAlgo.FP8.value, QuantAlgo.NO_QUANT.value)
"""quant_algo values whose unified HF checkpoint the gate's HF reader reads (``Family.hf_read``; ``checkpoint/hf_unified.py``
``dequantize_hf_moe``: FP8 weights, fused groups re-quantized as TensorRT-LLM loads them, or unquantized ones)."""
MXFP4_READ_FORMATS = (QuantAlgo.W4A16_MXFP4.value,)
"""quant_algo values the gate reads of a family shipped with MXFP4 experts (``MoE.expert_format``; gpt-oss): its HF
checkpoint as shipped (``quant_method`` mxfp4, given with ``--checkpoint``), decoded weight-only by
``gate/moe_model.py`` ``load_gpt_oss_mxfp4`` -- what W4A16_MXFP4 runs on Hopper (BF16 activations)."""
LAYER_PREFIX_HF = "model.layers"
LAYER_PREFIX_TRT = "transformer.layers"
LAYER_RE = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
EXPERT = "{e}"
"""Placeholder of the expert index in an MoE expert linear's HF name (``block_sparse_moe.experts.{e}.w1``)."""

SRC_LOADER = "tensorrt_llm/models/model_weights_loader.py:50-61 (tllm_to_externel_key_dict)"
SRC_CONVERT = "tensorrt_llm/models/llama/convert.py (convert_hf_llama: gate_proj -> mlp.fc, up_proj -> mlp.gate, [w3; w1] -> mlp.fc)"
SRC_FUSE = "tensorrt_llm/models/modeling_utils.py (fuse_gate_mlp)"
SRC_MODELOPT = "modelopt/torch/export/model_utils.py (MODEL_NAME_TO_TYPE: Mixtral -> llama)"
SRC_HF = "transformers 4.57 models/<family>/modeling_<family>.py"


@dataclass(frozen=True)
class Linear:
    """One decoder-layer linear: HF name (relative to ``model.layers.N.``), TensorRT-LLM GEMM (relative to
    ``transformer.layers.N.``) and its tensor-parallel kind (``column`` | ``row``)."""

    hf: str
    trt: str
    parallel: str


@dataclass(frozen=True)
class MoE:
    """Router and expert linears of a MoE family (HF names relative to the layer, ``{e}`` = expert index)."""

    router_hf: str
    router_trt: str
    experts: tuple[Linear, ...]
    fused: tuple[tuple[str, ...], ...] = ()
    shared_experts: tuple[str, ...] = ()
    """HF linears (relative) of the always-active shared expert(s) and their gate (Qwen2-MoE); () when none."""
    packed_experts: bool = False
    """The HF model stores every expert of a projection in one 3-D parameter (gpt-oss ``mlp.experts.gate_up_proj``
    ``[E, hidden, 2 x inter]``, gate/up rows interleaved), not one Linear per expert (``{e}`` names)."""
    expert_format: str = ""
    """The format the family's own checkpoint stores its experts in ('' = the model dtype; gpt-oss: MXFP4,
    ``*_blocks``/``*_scales``, decoded by ``checkpoint/codecs.py`` ``dequant_mx_blocks``)."""

    @property
    def router_modules(self) -> tuple[str, ...]:
        """HF modules (relative) kept unquantized and read as stored: the router and a shared-expert gate (Qwen2-MoE
        ``mlp.shared_expert_gate``, ``[1, hidden]``): not quantizable linears (``hf_linear_shapes`` lists neither)."""
        return (self.router_hf,) + tuple(s for s in self.shared_experts if s.endswith("_gate"))

    @property
    def router_patterns(self) -> tuple[str, ...]:
        """``exclude_modules`` patterns keeping the router (and a shared-expert gate) out of quantization: the router
        stays in the model dtype (TensorRT-LLM loads it as F32, ``mlp.router``) and a quantized one is refused by
        ``router_problems``."""
        return tuple(f"*{m}" for m in self.router_modules)


def _reader_gaps(reader: str, reads: str, formats: tuple[str, ...], quant_algo: Optional[str],
                 kv: Optional[str]) -> tuple[tuple[str, str], ...]:
    """The gate gap of a checkpoint reader that reads the weight ``formats`` (``reads`` says so in words) and an
    unquantized KV cache only: ``(("gate", reason),)`` for another ``quant_algo`` or a quantized ``kv``, else ``()``."""
    if quant_algo is not None and quant_algo not in formats:
        return (("gate", f"{reader} reads {reads}, not {quant_algo}"),)
    if kv not in (None, KVCacheQuantAlgo.NONE.value):
        return (("gate", f"{reader} reads an unquantized KV cache only, not {kv} (set "
                         f"quantization.kv_cache_quant_algo: {KVCacheQuantAlgo.NONE.value})"),)
    return ()


def _mxfp4_gaps(quant_algo: Optional[str], kv: Optional[str]) -> tuple[tuple[str, str], ...]:
    """``Family.build_gaps`` on route llm_api of a family shipped with MXFP4 experts (gpt-oss): the quantize stage
    adopts its checkpoint as shipped (``--checkpoint``; it writes no MXFP4 itself, rule ``quantize.modelopt_inputs``)
    and the gate decodes it weight-only, so formats with quantized activations or KV cache have a gate gap."""
    reader = "the gate's reader of gpt-oss's MXFP4 checkpoint (gate/moe_model.py load_gpt_oss_mxfp4, weight-only)"
    return _reader_gaps(reader, f"{' or '.join(MXFP4_READ_FORMATS)} only (the checkpoint as shipped, given with "
                                "--checkpoint)", MXFP4_READ_FORMATS, quant_algo, kv)


@dataclass(frozen=True)
class Family:
    """A model family (see the module doc for each field)."""

    architecture: str
    model_type: str
    trtllm_class: str
    export_decoder: Optional[str]
    linears: tuple[Linear, ...]
    fused: tuple[tuple[str, ...], ...]
    norms: dict[str, str]
    attention_bias: bool = False
    moe: Optional[MoE] = None
    routes: tuple[str, ...] = ("engine", "llm_api")
    trtllm_versions: tuple[str, ...] = ("1.2", "1.3")
    gate_reader: Optional[str] = None
    sources: dict[str, str] = field(default_factory=dict)
    trtllm_config: dict = field(default_factory=dict)
    sliding_window: bool = False
    hf_read: bool = False
    """Its unified HF checkpoint (ModelOpt ``export_hf_checkpoint``, no decoder type) is verified
    (``checkpoint/hf_verify.py``: experts' layout, router unquantized, the family's norms) and read by the gate's HF
    reader (``gate/moe_model.py`` ``load_hf_moe_model``: the family's HF class fed the dequantized checkpoint), in
    ``MOE_HF_READ_FORMATS``; ``invoke build`` runs it on route llm_api (``Family.build_gaps(route)``): Qwen3 (dense),
    Qwen3-MoE, Mixtral, Qwen2-MoE."""

    # -- lookups

    def build_gaps(self, route: Optional[str] = None, quant_algo: Optional[str] = None,
                   kv_cache_quant_algo: Optional[str] = None) -> tuple[tuple[str, str], ...]:
        """(stage, what it lacks) for each build stage that cannot handle this family yet on ``route`` (None: on
        every route it serves; a family served on llm_api only: that route): ``quantize`` when no export decoder is
        wired (``export_decoder`` None), ``gate`` when the gate has no checkpoint reader (``gate_reader`` None) --
        except on the ``llm_api`` route for a family whose unified HF checkpoint is verified and read (``hf_read``:
        ModelOpt's ``export_hf_checkpoint`` needs no decoder type, the gate reads it with ``gate/moe_model.py``) in the
        formats that reader reads (``MOE_HF_READ_FORMATS``, an unquantized KV cache; checked when ``quant_algo`` /
        ``kv_cache_quant_algo`` are given). A family shipped with MXFP4 experts (``MoE.expert_format``, gpt-oss) is
        built from its checkpoint as shipped in ``MXFP4_READ_FORMATS`` (``_mxfp4_gaps``). () for a family ``invoke
        build`` runs end to end (there). Planning needs none of them."""
        if route is None and self.routes == ("llm_api",):
            route = "llm_api"  # served on that route only
        if route == "llm_api" and self.moe is not None and self.moe.expert_format == "MXFP4":
            return _mxfp4_gaps(quant_algo, kv_cache_quant_algo)
        reader = "the gate's HF reader (gate/moe_model.py load_hf_moe_model)"
        if route == "llm_api" and self.hf_read:
            return _reader_gaps(reader, f"{' or '.join(MOE_HF_READ_FORMATS)} weights of {self.architecture} only",
                                MOE_HF_READ_FORMATS, quant_algo, kv_cache_quant_algo)
        gaps = []
        if self.export_decoder is None:
            gaps.append(("quantize", "its ModelOpt export (the quantize stage's decoder type) is not wired "
                                     "(spec/families.py export_decoder)" + ("; route llm_api builds it" if self.hf_read else "")))
        if self.gate_reader is None:
            gaps.append(("gate", "the accuracy gate has no reader of its TensorRT-LLM checkpoints (spec/families.py "
                                 "gate_reader)" + ("; route llm_api reads its unified HF checkpoint" if self.hf_read else "")))
        return tuple(gaps)

    def hf_fused_groups(self, num_experts: int) -> tuple[tuple[str, ...], ...]:
        """The HF linears (relative) TensorRT-LLM's PyTorch backend loads as one fused GEMM, each group once: q/k/v,
        gate/up, each of ``num_experts`` experts' gate/up (``MoE.fused`` with ``{e}``), a shared expert's gate/up.
        The unified HF checkpoint's verifier (``hf.fused_scales``) and the gate's HF reader read them."""
        groups = list(self.fused)
        for g in self.moe.fused if self.moe else ():
            if any(EXPERT in m for m in g):
                groups += [tuple(m.replace(EXPERT, str(e)) for m in g) for e in range(num_experts)]
            else:
                groups.append(g)
        return tuple(groups)

    @property
    def bias_linears(self) -> tuple[str, ...]:
        """HF linears (relative) that carry a bias, kept unquantized by the export: q/k/v when ``attention_bias``
        (Qwen2: q/k/v_proj bias=True, o_proj none; TensorRT-LLM ``Attention(bias=attn_bias, dense_bias=False)``),
        else none."""
        return _QKV if self.attention_bias else ()

    @property
    def bias_gemms(self) -> tuple[str, ...]:
        """TensorRT-LLM GEMMs (relative) that carry a bias (``attention.qkv`` for Qwen2: one fused ``[q; k; v]`` bias)."""
        return self.gemms_of(self.bias_linears)

    @property
    def hf_to_trt(self) -> dict[str, str]:
        """{HF linear (relative): TensorRT-LLM GEMM (relative)} of the dense linears."""
        return {lin.hf: lin.trt for lin in self.linears}

    @property
    def gemms(self) -> tuple[str, ...]:
        """TensorRT-LLM GEMM names of a dense decoder layer, in layer order (q/k/v are one ``attention.qkv``)."""
        return tuple(dict.fromkeys(lin.trt for lin in self.linears))

    def gemm_hf(self, trt: str) -> tuple[str, ...]:
        """HF linears (relative) that make TensorRT-LLM GEMM ``trt`` (``attention.qkv``: q, k, v)."""
        return tuple(lin.hf for lin in self.linears if lin.trt == trt)

    def gemms_of(self, hf: tuple[str, ...]) -> tuple[str, ...]:
        """TensorRT-LLM GEMMs (relative) of HF linears ``hf``, in layer order (``("mlp.gate_proj", "mlp.up_proj")``
        -> ``("mlp.fc", "mlp.gate")``)."""
        return tuple(dict.fromkeys(lin.trt for lin in self.linears if lin.hf in hf))

    def parallel(self, trt: str) -> str:
        """``column`` | ``row``: how TensorRT-LLM splits GEMM ``trt`` over tensor-parallel ranks."""
        kinds = {lin.parallel for lin in self.linears if lin.trt == trt}
        if len(kinds) != 1:
            raise KeyError(f"{self.architecture} has no GEMM {trt!r}")
        return kinds.pop()

    def layer_linears(self) -> tuple[str, ...]:
        """HF names (relative) of one decoder layer's quantizable linears: the dense ones, or for a MoE
        family the attention ones and one representative expert's (index 0; a pattern naming one
        expert index is not modelled per expert)."""
        if self.moe is None:
            return tuple(lin.hf for lin in self.linears)
        attn = tuple(lin.hf for lin in self.linears if lin.hf.startswith("self_attn."))
        return attn + tuple(x.hf.replace(EXPERT, "0") for x in self.moe.experts)

    def linear_names(self, num_layers: int) -> list[str]:
        """HF names of the model's quantizable linears: every decoder layer's (``layer_linears``), then ``lm_head``."""
        return [f"{LAYER_PREFIX_HF}.{i}.{rest}" for i in range(num_layers) for rest in self.layer_linears()] + ["lm_head"]

    def fused_partners(self, rel: str) -> tuple[str, ...]:
        """The HF linears (relative) fused with ``rel`` into one TensorRT-LLM GEMM, ``rel`` included (just
        ``rel`` when it is in no group). Expert groups keep ``rel``'s expert index."""
        groups = self.fused + (self.moe.fused if self.moe else ())
        for group in groups:
            if rel in group:
                return group
            for t in group:
                if EXPERT in t:
                    rx = re.escape(t).replace(re.escape(EXPERT), r"(\d+)")
                    m = re.fullmatch(rx, rel)
                    if m:
                        return tuple(g.replace(EXPERT, m.group(1)) for g in group)
        return (rel,)

    def trtllm_name(self, hf_name: str) -> str:
        """TensorRT-LLM checkpoint module name of HF module ``hf_name`` (module-level ``trtllm_name``)."""
        m = LAYER_RE.match(hf_name)
        if m:
            idx, rest = m.groups()
            trt = self.hf_to_trt.get(rest)
            if trt is not None:
                return f"{LAYER_PREFIX_TRT}.{idx}.{trt}"
        if hf_name == "model.embed_tokens":
            return "transformer.vocab_embedding"
        if hf_name == "model.norm":
            return "transformer.ln_f"
        return hf_name


_ATTENTION = (
    Linear("self_attn.q_proj", "attention.qkv", COLUMN),
    Linear("self_attn.k_proj", "attention.qkv", COLUMN),
    Linear("self_attn.v_proj", "attention.qkv", COLUMN),
    Linear("self_attn.o_proj", "attention.dense", ROW),
)
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_LLAMA_LINEARS = _ATTENTION + (
    Linear("mlp.gate_proj", "mlp.fc", COLUMN),     # SiLU side; model_weights_loader.py:61 "fc": "gate_proj"
    Linear("mlp.up_proj", "mlp.gate", COLUMN),     # model_weights_loader.py:59 "gate": "up_proj"
    Linear("mlp.down_proj", "mlp.proj", ROW),      # model_weights_loader.py:60 "proj": "down_proj"
)
_LLAMA_FUSED = (_QKV, ("mlp.gate_proj", "mlp.up_proj"))
_NORMS = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_layernorm"}
_NAME_SOURCES = {"linears": f"{SRC_LOADER}; {SRC_CONVERT}", "fused": f"QKV: {SRC_CONVERT}; gate/up: {SRC_FUSE}",
                 "norms": SRC_LOADER, "routes": "README (serving routes); shared/reference/trtllm-1.2-build-reference.md"}
_MIXTRAL_MOE = MoE(
    router_hf="block_sparse_moe.gate", router_trt="mlp.router",
    experts=(Linear("block_sparse_moe.experts.{e}.w1", "mlp.fc", COLUMN),   # gate side: [w3; w1] in mlp.fc
             Linear("block_sparse_moe.experts.{e}.w3", "mlp.fc", COLUMN),   # up side
             Linear("block_sparse_moe.experts.{e}.w2", "mlp.proj", ROW)),
    fused=(("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3"),))
_QWEN_MOE = MoE(
    router_hf="mlp.gate", router_trt="mlp.router",
    experts=(Linear("mlp.experts.{e}.gate_proj", "mlp.fc", COLUMN),
             Linear("mlp.experts.{e}.up_proj", "mlp.fc", COLUMN),
             Linear("mlp.experts.{e}.down_proj", "mlp.proj", ROW)),
    fused=(("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj"),))


def _planned(arch: str, model_type: str, trtllm_class: str, sources: Optional[dict[str, str]] = None, **kw) -> Family:
    """A family the pipeline plans (``invoke check``) but does not quantize or gate (``Family.build_gaps``)."""
    return Family(architecture=arch, model_type=model_type, trtllm_class=trtllm_class, export_decoder=None,
                  linears=_LLAMA_LINEARS, fused=_LLAMA_FUSED, norms=_NORMS,
                  sources={**_NAME_SOURCES, "model": f"{SRC_HF}; spec/model_arch.py", **(sources or {})}, **kw)


# Qwen2 / Qwen2.5 (TensorRT-LLM at commit 04a2cac / 0428c18 / 047098b of the stored sources):
# * engine route: tensorrt_llm/models/__init__.py MODEL_MAP "Qwen2ForCausalLM": QWenForCausalLM;
#   tensorrt_llm/models/qwen/config.py QWenConfig.from_hugging_face: attn_bias = True for every qwen_type but
#   qwen3/qwen3_moe ("Legacy Qwen models have attn bias"), mlp_bias False, rotary_base = rope_theta;
#   tensorrt_llm/models/qwen/model.py QWenDecoderLayer: Attention(bias=config.attn_bias, dense_bias=False) (one
#   fused qkv bias, none on the o_proj), GatedMLP like Llama; from_hugging_face maps the HF names with the
#   unified ModelWeightsLoader (the Llama names above; custom_dict only for qwen1, qwen2_moe and tied lm_head).
# * PyTorch backend (LLM API): tensorrt_llm/_torch/models/modeling_qwen.py @register_auto_model("Qwen2ForCausalLM"):
#   QwenAttention(bias=True, dense_bias=False), GatedMLP(bias=mlp_bias or False), RMSNorm input/post-attention.
# * HF: transformers models/qwen2/modeling_qwen2.py Qwen2Attention q/k/v_proj bias=True, o_proj bias=False.
_QWEN2_SOURCES = {
    "attention_bias": "tensorrt_llm/models/qwen/config.py (QWenConfig.from_hugging_face: attn_bias True for qwen2); "
                      "tensorrt_llm/models/qwen/model.py (QWenDecoderLayer: Attention(bias=attn_bias, dense_bias=False)); "
                      "transformers models/qwen2/modeling_qwen2.py (q/k/v_proj bias=True, o_proj bias=False)",
    "routes": "engine: tensorrt_llm/models/__init__.py MODEL_MAP (Qwen2ForCausalLM -> QWenForCausalLM), "
              "tensorrt_llm/models/qwen/; PyTorch backend (LLM API): tensorrt_llm/_torch/models/modeling_qwen.py "
              "(@register_auto_model(\"Qwen2ForCausalLM\"))",
    "linears": f"{SRC_LOADER} (QWenForCausalLM.from_hugging_face loads qwen2 with the unified ModelWeightsLoader, "
               "no custom names)",
    "export": "ModelOpt 0.47 modelopt/torch/export/model_utils.py:36 (MODEL_NAME_TO_TYPE \"QWen\" -> \"qwen\", matched "
              "case-insensitively in the class name, :84-86); model_config_export.py:154-155 and tensorrt_llm_utils.py:145 "
              "(architecture = the HF config's architectures[0]), tensorrt_llm_utils.py:190-215 (TensorRT-LLM's QWenConfig.from_hugging_face writes the config when tensorrt_llm is "
              "installed), :240 (else the manual config: no qwen_type, attn_bias, mlp_bias)",
    "trtllm_config": "tensorrt_llm/models/qwen/config.py at 0428c18 (QWenConfig.from_hugging_face: qwen_type = "
                     "hf_config.model_type, line 91; attn_bias True but for qwen3/qwen3_moe, lines 120-124; mlp_bias "
                     "default False, line 27); tensorrt_llm/models/qwen/model.py at 04a2cac (QWenDecoderLayer: "
                     "bias=config.attn_bias line 67, dense_bias=False line 74, qwen_type 'qwen' halves "
                     "intermediate_size, lines 104-110: a config without qwen_type builds a wrong model)",
    "gate": "gate/model.py load_checkpoint_model (an HF Qwen2ForCausalLM fed the dequantized checkpoint, q/k/v biases "
            "from attention.qkv.bias)",
}
_QWEN2_TRTLLM = {"qwen_type": "qwen2", "attn_bias": True, "mlp_bias": False}

# Mistral: Llama's layout and names, no biases; sliding_window (4096 in Mistral-7B v0.1, null from v0.2) is a
# run-time setting on the engine route, not modelled by the planner (the KV cache is planned for max_seq_len: an
# upper bound when a window is set).
_MISTRAL_SOURCES = {
    "routes": "engine: tensorrt_llm/models/__init__.py MODEL_MAP (MistralForCausalLM -> LLaMAForCausalLM); PyTorch "
              "backend (LLM API): tensorrt_llm/_torch/models/modeling_llama.py (@register_auto_model(\"MistralForCausalLM\") "
              "on LlamaModel, attention_bias False)",
    "sliding_window": "tensorrtllm_backend docs/model_config.md:115 (max_attention_window_size: the tokens attended "
                      "with sliding window attention; default max_sequence_length, i.e. all tokens)",
    "export": "ModelOpt 0.47 modelopt/torch/export/model_utils.py:26 (MODEL_NAME_TO_TYPE \"Mistral\" -> \"llama\"); "
              "model_config_export.py:154-155 (architecture MistralForCausalLM; the checkpoint has no window field)",
    "gate": "gate/model.py load_checkpoint_model (an HF MistralForCausalLM with the HF config's sliding_window)",
}

# Qwen3 (dense): Qwen2's layout without biases, plus an RMSNorm over each head's q and k (QK-norm) before RoPE.
# * HF: transformers models/qwen3/modeling_qwen3.py (Qwen3Attention: q_norm, k_norm = Qwen3RMSNorm(head_dim);
#   attention_bias False in the shipped configs).
# * PyTorch backend (LLM API): tensorrt_llm/_torch/models/modeling_qwen3.py at 010bb95 (@register_auto_model(
#   "Qwen3ForCausalLM"), Qwen3DecoderLayer: QKNormRoPEAttention(bias=config.attention_bias)).
# * engine route: tensorrt_llm/models/qwen/config.py at 0428c18 accepts qwen_type qwen3 (attn_bias False), but
#   tensorrt_llm/models/qwen/model.py at 04a2cac builds Attention(...) without a Q/K norm (lines 58-74): an engine
#   would drop q_norm / k_norm, so the registry gives Qwen3 the llm_api route only (spec/capability.py family rows).
_QWEN3_SOURCES = {
    "norms": "transformers models/qwen3/modeling_qwen3.py (q_norm, k_norm: RMSNorm(head_dim) per layer); TensorRT-LLM "
             "names attention.q_layernorm / attention.k_layernorm (tensorrt_llm/models/qwen/convert.py, qwen3 branch)",
    "routes": "llm_api: tensorrt_llm/_torch/models/modeling_qwen3.py at 010bb95 (@register_auto_model(\"Qwen3ForCausalLM\"), "
              "QKNormRoPEAttention); not engine: tensorrt_llm/models/qwen/model.py at 04a2cac lines 58-74 (QWenDecoderLayer's "
              "Attention has no Q/K norm: the engine would drop q_norm/k_norm)",
    "trtllm_config": "tensorrt_llm/models/qwen/config.py at 0428c18 (qwen_type = model_type, line 91; attn_bias False for "
                     "qwen3, lines 120-124)",
    "gate": "route llm_api: gate/moe_model.py load_hf_moe_model (an HF Qwen3ForCausalLM fed the dequantized unified HF "
            "checkpoint, q_norm/k_norm as stored)",
}
_QWEN3 = Family(architecture="Qwen3ForCausalLM", model_type="qwen3", trtllm_class="QWenForCausalLM", export_decoder=None,
                linears=_LLAMA_LINEARS, fused=_LLAMA_FUSED,
                norms={**_NORMS, "self_attn.q_norm": "attention.q_layernorm", "self_attn.k_norm": "attention.k_layernorm"},
                routes=("llm_api",), trtllm_config={"qwen_type": "qwen3", "attn_bias": False}, hf_read=True,
                sources={**_NAME_SOURCES, "model": f"{SRC_HF}; spec/model_arch.py", **_QWEN3_SOURCES})


FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family(architecture="LlamaForCausalLM", model_type="llama", trtllm_class="LLaMAForCausalLM", export_decoder="llama",
           linears=_LLAMA_LINEARS, fused=_LLAMA_FUSED, norms=_NORMS, gate_reader="llama", routes=("engine", "llm_api"),
           sources={**_NAME_SOURCES, "export": "ModelOpt 0.47 export_tensorrt_llm_checkpoint(model, 'llama', ...)",
                    "gate": "gate/model.py load_checkpoint_model (an HF LlamaForCausalLM fed the dequantized checkpoint)"}),
    Family(architecture="MistralForCausalLM", model_type="mistral", trtllm_class="LLaMAForCausalLM",
           export_decoder="llama", linears=_LLAMA_LINEARS, fused=_LLAMA_FUSED, norms=_NORMS, gate_reader="mistral",
           sliding_window=True, sources={**_NAME_SOURCES, **_MISTRAL_SOURCES}),
    Family(architecture="MixtralForCausalLM", model_type="mixtral", trtllm_class="LLaMAForCausalLM", export_decoder="llama",
           linears=_LLAMA_LINEARS, fused=_LLAMA_FUSED, norms=_NORMS, moe=_MIXTRAL_MOE, hf_read=True,
           sources={**_NAME_SOURCES, "export": SRC_MODELOPT, "moe": SRC_CONVERT,
                    "gate": "route llm_api: gate/moe_model.py load_hf_moe_model (an HF MixtralForCausalLM fed the "
                            "dequantized unified HF checkpoint, block_sparse_moe.gate as stored)"}),
    Family(architecture="Qwen2ForCausalLM", model_type="qwen2", trtllm_class="QWenForCausalLM", export_decoder="qwen",
           linears=_LLAMA_LINEARS, fused=_LLAMA_FUSED, norms=_NORMS, attention_bias=True, gate_reader="qwen2",
           trtllm_config=_QWEN2_TRTLLM, sources={**_NAME_SOURCES, **_QWEN2_SOURCES}),
    _planned("Qwen2MoeForCausalLM", "qwen2_moe", "QWenForCausalLM", attention_bias=True, moe=_QWEN_MOE),
    _QWEN3,
    _planned("Qwen3MoeForCausalLM", "qwen3_moe", "QWenForCausalLM", moe=_QWEN_MOE),
)}
"""Every architecture the pipeline accepts, by HF class name (``config.json`` ``architectures[0]``)."""

# --- MoE families and gpt-oss (issue 29, helper mxfp4) --------------------------------------------------------------
# Qwen3-MoE: per-expert gate/up/down Linears under mlp.experts.{e}, a router mlp.gate (no bias), no shared expert
# (transformers models/qwen3_moe/modeling_qwen3_moe.py Qwen3MoeSparseMoeBlock; Qwen2-MoE's shared_expert and
# shared_expert_gate are gone). Engine: tensorrt_llm/models/qwen/config.py handles qwen_type qwen3_moe (attn_bias False);
# PyTorch backend: tensorrt_llm/_torch/models/modeling_qwen3_moe.py, checkpoints/hf/qwen3_moe_weight_mapper.py.
# The router stays BF16: ModelOpt 0.47's presets disable '*mlp.gate.*' (modelopt/torch/quantization/config.py,
# e.g. FP8_DEFAULT_CFG, MXFP4_DEFAULT_CFG), and TensorRT-LLM loads mlp.router in F32 (SRC_CONVERT).
_QWEN3_MOE_SOURCES = {
    "moe": "transformers models/qwen3_moe/modeling_qwen3_moe.py (Qwen3MoeSparseMoeBlock: gate = router, experts.{e}."
           "gate_proj/up_proj/down_proj, no shared expert); modelopt/torch/quantization/config.py ('*mlp.gate.*' disabled)",
    "routes": "engine: tensorrt_llm/models/qwen/config.py (qwen_type qwen3_moe); PyTorch backend: "
              "tensorrt_llm/_torch/models/modeling_qwen3_moe.py, checkpoints/hf/qwen3_moe_weight_mapper.py",
}
QWEN3_MOE = replace(_planned("Qwen3MoeForCausalLM", "qwen3_moe", "QWenForCausalLM", moe=_QWEN_MOE, hf_read=True,
                             routes=("engine", "llm_api"), trtllm_versions=("1.2", "1.3"), sources=_QWEN3_MOE_SOURCES),
                    norms=_QWEN3.norms)  # Qwen3's QK-norm (transformers modeling_qwen3_moe.py Qwen3MoeAttention q_norm/k_norm)

# gpt-oss: MoE with MXFP4 experts as shipped (*_blocks / *_scales, quant_method mxfp4), attention sinks (one learned
# logit per head, self_attn.sinks), biases on q/k/v/o, the router and the experts, and sliding-window attention on
# every other layer (config layer_types: sliding_attention / full_attention, sliding_window 128)
# (transformers models/gpt_oss/modeling_gpt_oss.py; integrations/mxfp4.py). TensorRT-LLM runs it on the PyTorch
# backend only (tensorrt_llm/_torch/models/modeling_gpt_oss.py, checkpoints/hf/gpt_oss_weight_mapper.py; an HF
# mxfp4 checkpoint loads as W4A16_MXFP4 on Hopper, W4A8_MXFP4_MXFP8 on Blackwell: spec/formats.py SRC_MX_MOE);
# tensorrt_llm/models/gpt_oss/ (an engine model) exists in forks only (spec/formats.py SRC_MX_ENGINE).
_GPT_OSS_MOE = MoE(
    router_hf="mlp.router", router_trt="mlp.router",
    # gate_up_proj holds gate (even rows) and up (odd rows) of every expert: listed twice, once per half
    experts=(Linear("mlp.experts.gate_up_proj", "mlp.fc", COLUMN), Linear("mlp.experts.gate_up_proj", "mlp.fc", COLUMN),
             Linear("mlp.experts.down_proj", "mlp.proj", ROW)),
    packed_experts=True, expert_format="MXFP4")
_GPT_OSS_SOURCES = {
    "moe": "transformers models/gpt_oss/modeling_gpt_oss.py (GptOssMLP: router Linear with bias, GptOssExperts "
           "gate_up_proj [E, hidden, 2 x inter] interleaved, down_proj [E, inter, hidden]); integrations/mxfp4.py "
           "(convert_moe_packed_tensors: *_blocks [E, out, in/32, 16], *_scales [E, out, in/32], exponent - 127)",
    "attention": "transformers models/gpt_oss/modeling_gpt_oss.py (self_attn.sinks; layer_types alternate "
                 "sliding_attention / full_attention; q/k/v/o_proj bias=True)",
    "routes": "PyTorch backend only: tensorrt_llm/_torch/models/modeling_gpt_oss.py, checkpoints/hf/"
              "gpt_oss_weight_mapper.py; tensorrt_llm/_torch/model_config.py get_mxfp4_quant_algo",
}
GPT_OSS = Family(architecture="GptOssForCausalLM", model_type="gpt_oss", trtllm_class="GptOssForCausalLM (PyTorch backend)",
                 export_decoder=None, linears=_LLAMA_LINEARS, fused=_LLAMA_FUSED, norms=_NORMS, attention_bias=True,
                 moe=_GPT_OSS_MOE, routes=("llm_api",), trtllm_versions=("1.2", "1.3"),
                 sources={**_NAME_SOURCES, **_GPT_OSS_SOURCES})
# Qwen2-MoE's shared expert (always active, intermediate shared_expert_intermediate_size) and its sigmoid gate
# mlp.shared_expert_gate (transformers models/qwen2_moe/modeling_qwen2_moe.py Qwen2MoeSparseMoeBlock); ModelOpt's
# presets disable '*mlp.shared_expert_gate.*' like the router (modelopt/torch/quantization/config.py).
_QWEN2_MOE_SHARED = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
                     "mlp.shared_expert_gate")
QWEN2_MOE = replace(FAMILIES["Qwen2MoeForCausalLM"], hf_read=True, moe=replace(
    _QWEN_MOE, shared_experts=_QWEN2_MOE_SHARED, fused=_QWEN_MOE.fused + (_QWEN2_MOE_SHARED[:2],)))  # shared gate/up fused
FAMILIES.update({f.architecture: f for f in (QWEN2_MOE, QWEN3_MOE, GPT_OSS)})  # they replace the entries above

_MX_EXPERTS = tuple(a.value for a in (QuantAlgo.NO_QUANT, QuantAlgo.W4A16_MXFP4, QuantAlgo.W4A8_MXFP4_FP8,
                                       QuantAlgo.W4A8_MXFP4_MXFP8))
FAMILY_FORMATS: dict[str, tuple[str, ...]] = {GPT_OSS.architecture: _MX_EXPERTS}
"""quant_algo values a family is served with, where it is narrower than the format registry: gpt-oss ships MXFP4
experts (TensorRT-LLM's MXFP4 QuantAlgos, SRC_MX_MOE) or their BF16 dequantization (NO_QUANT)."""


def family_problems(fam: Family, route: str, line: str, quant_algo: str) -> list[tuple[str, str, str]]:
    """(field, reason, fix) for each way ``route`` / TensorRT-LLM ``line`` / ``quant_algo`` is not served for ``fam``
    (``Family.routes``, ``Family.trtllm_versions``, ``FAMILY_FORMATS``); [] when all are."""
    out = []
    if route not in fam.routes:
        where = " and ".join(f"route {r} (TensorRT-LLM {', '.join(fam.trtllm_versions)})" for r in fam.routes)
        out.append(("route", f"{fam.architecture} is not served on the {route} route; it runs on {where} "
                    f"({fam.sources.get('routes', 'spec/families.py')}).",
                    f"use route: {' or '.join(fam.routes)}."))
    if line not in fam.trtllm_versions:
        out.append(("target.trtllm_version", f"{fam.architecture} is not served by TensorRT-LLM {line}.",
                    f"use a TensorRT-LLM {' or '.join(fam.trtllm_versions)} version."))
    allowed = FAMILY_FORMATS.get(fam.architecture)
    if allowed and quant_algo not in allowed:
        out.append(("quantization.quant_algo", f"{fam.architecture} is served with {', '.join(allowed)} only "
                    f"({fam.moe.expert_format if fam.moe else ''} experts as shipped); got {quant_algo}.",
                    f"use one of: {', '.join(allowed)}."))
    return out


def router_problems(fam: Family, stored: dict[str, str]) -> list[tuple[str, str]]:
    """(tensor, reason) for each router (or shared-expert gate) tensor stored quantized: ``stored`` maps tensor names
    to safetensors dtypes (a header); a router weight must be a plain float dtype with no scale tensor beside it
    (``MoE.router_patterns``; TensorRT-LLM loads the router as F32). [] for a dense family."""
    if fam.moe is None:
        return []
    routers = {*fam.moe.router_modules, fam.moe.router_trt}
    out = []
    for name, dtype in stored.items():
        m = LAYER_RE.match(name.replace("transformer.layers.", "layers.", 1))
        if not m:
            continue
        stem, _, leaf = m.group(2).rpartition(".")
        if stem not in routers:
            continue
        if leaf == "weight" and dtype not in ("BF16", "F16", "F32"):
            out.append((name, f"router weight stored as {dtype}; the router must stay unquantized (BF16/F32)"))
        elif leaf not in ("weight", "bias"):
            out.append((name, f"a scale tensor of the router ({leaf}): the router was quantized"))
    return out


LLAMA = FAMILIES["LlamaForCausalLM"]
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(FAMILIES)
"""Architectures ``spec.model_arch`` reads (planned by resolve)."""
EXPORTED_ARCHITECTURES: tuple[str, ...] = tuple(a for a, f in FAMILIES.items() if f.export_decoder)
"""Architectures the quantize stage exports (``Family.export_decoder``)."""
HF_READ_ARCHITECTURES: tuple[str, ...] = tuple(a for a, f in FAMILIES.items() if f.hf_read)
"""Architectures built on route llm_api through their unified HF checkpoint (``Family.hf_read``)."""
GATE_ARCHITECTURES: tuple[str, ...] = tuple(a for a, f in FAMILIES.items() if f.gate_reader)
"""Architectures whose checkpoints the accuracy gate reads (``Family.gate_reader``); every other supported
architecture is refused by ``invoke build`` at resolve (rule ``model.gate_reads``), before quantizing."""


def family(architecture: str) -> Family:
    """The registry entry of HF class ``architecture``; UserError (``--model``) naming the supported ones."""
    f = FAMILIES.get(architecture)
    if f is None:
        raise UserError("--model", f"architecture {architecture!r} is not supported by this pipeline.",
                        f"use a model of: {', '.join(SUPPORTED_ARCHITECTURES)}.")
    return f


def family_of_model_type(model_type: str) -> Optional[Family]:
    """The entry whose HF ``model_type`` is ``model_type`` (None when no entry has it)."""
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)


KV_PROJECTIONS = _QKV[1:]
"""The HF linears that produce K and V (relative names): where a unified HF export stores the KV-cache scales."""


def num_experts_of(cfg: dict) -> int:
    """The routed experts a config.json gives: ``num_local_experts`` (Mixtral, gpt-oss) or ``num_experts`` (Qwen-MoE); 0
    for a dense model (``spec/model_arch.py`` reads the same keys)."""
    return int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)


def hf_linear_shapes(cfg: dict, fam: Optional[Family] = None) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each HF linear of a Llama-layout decoder layer (relative name) and of ``lm_head``, from
    ``config.json`` (hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
    vocab_size); for a MoE family (``fam``, default: the config's ``architectures[0]``, else Qwen-MoE's names) with
    experts (``num_experts_of``) also each expert's linears under the family's names (``MoE.experts``; Qwen-MoE
    ``mlp.experts.{e}.gate_proj/up_proj [moe_inter, hidden]``, ``down_proj [hidden, moe_inter]``; Mixtral
    ``block_sparse_moe.experts.{e}.w1/w3 [inter, hidden]``, ``w2 [hidden, inter]``; the expert width is
    ``moe_intermediate_size``, else ``intermediate_size``) and a shared expert's (Qwen2-MoE ``mlp.shared_expert.*``,
    ``shared_expert_intermediate_size``); the router and the shared-expert gate are no linears here
    (``MoE.router_modules``). Raises KeyError/ValueError for a config without them."""
    h, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    nkv, inter = int(cfg.get("num_key_value_heads") or nh), int(cfg["intermediate_size"])
    hd = int(cfg.get("head_dim") or h // nh)
    q, k, v = _QKV
    out = {q: (nh * hd, h), k: (nkv * hd, h), v: (nkv * hd, h), "self_attn.o_proj": (h, nh * hd),
           "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter),
           "lm_head": (int(cfg["vocab_size"]), h)}
    fam = fam or FAMILIES.get((cfg.get("architectures") or [None])[0])
    moe = fam.moe if fam is not None and fam.moe is not None else _QWEN_MOE
    n_exp = num_experts_of(cfg)
    if n_exp and not moe.packed_experts:  # one Linear per expert (gpt-oss packs them: checkpoint/mxfp4_verify.py)
        mi = int(cfg.get("moe_intermediate_size") or inter)
        for e in range(n_exp):
            for lin in moe.experts:
                out[lin.hf.replace(EXPERT, str(e))] = (mi, h) if lin.parallel == COLUMN else (h, mi)
        si = int(cfg.get("shared_expert_intermediate_size") or 0)
        for rel in (s for s in moe.shared_experts if s not in moe.router_modules):
            out[rel] = (si, h) if not rel.endswith("down_proj") else (h, si)
    return out


def qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int, tp: int = 1) -> tuple[int, int]:
    """(q rows, k rows = v rows) of one tensor-parallel rank's fused ``attention.qkv`` (rows ``[q; k; v]``).

    q: ``head_dim x num_heads / tp``; k and v: ``head_dim x max(1, num_kv_heads / tp)`` (ranks share a KV
    head, each holding a copy, when ``num_kv_heads < tp``; TensorRT-LLM ``tensorrt_llm/models/llama/convert.py``
    splits q, k and v separately and concatenates them per rank). The one QKV split of the pipeline: the
    checkpoint verifier's shapes, the reader's rank merge and the gate's q/k/v split read it.
    """
    return head_dim * num_heads // tp, head_dim * max(1, num_kv_heads // tp)


def qkv_rows_of_config(cfg: dict, tp: int = 1) -> tuple[int, int, int]:
    """``qkv_rows`` from a TensorRT-LLM checkpoint ``config.json`` (``head_size`` or hidden / heads), plus head_dim."""
    nh = int(cfg["num_attention_heads"])
    hd = int(cfg.get("head_size") or int(cfg["hidden_size"]) // nh)
    q, kv = qkv_rows(nh, int(cfg.get("num_key_value_heads") or nh), hd, tp)
    return q, kv, hd


def _matches(pattern: str, names: tuple[str, ...]) -> bool:
    """``fnmatch.fnmatchcase`` of any of ``names`` (the pattern compiled once: ``_glob``)."""
    match = _glob(pattern)
    return any(match(n) for n in names)


@lru_cache(maxsize=1024)
def _glob(pattern: str):
    """The compiled ``fnmatch.translate`` of ``pattern`` (what ``fnmatch.fnmatchcase`` matches with)."""
    return re.compile(fnmatch.translate(pattern)).match


def match_names(fam: Family, hf_name: str) -> tuple[str, str, str]:
    """The names an ``exclude_modules`` pattern is matched against for HF linear ``hf_name``: its HF name,
    its TensorRT-LLM name and its last name component."""
    return hf_name, fam.trtllm_name(hf_name), hf_name.rsplit(".", 1)[-1]


def resolve_exclusions(linear_names: list[str], exclude_patterns: list[str], keep_first: int, keep_last: int,
                       num_layers: int, fam: Family = LLAMA) -> tuple[list[str], list[str]]:
    """HF names of the linears to keep unquantized, and the patterns that matched nothing.

    ``linear_names``: HF names of the model's linears. A pattern is matched (fnmatch) against each
    linear's ``match_names``; ``keep_first`` / ``keep_last`` keep every linear of those decoder layers;
    then every fused group (``Family.fused_partners``) of a kept linear is kept whole. Order: that of
    ``linear_names``. The one matcher of the pipeline: the export and the memory plan both call it.
    """
    excluded: set[str] = set()
    unmatched = []
    candidates = [(n, match_names(fam, n)) for n in linear_names] if exclude_patterns else []
    for p in exclude_patterns:
        hit = [n for n, names in candidates if _matches(p, names)]
        if not hit:
            unmatched.append(p)
        excluded.update(hit)
    keep = set(range(min(keep_first, num_layers))) | set(range(max(0, num_layers - keep_last), num_layers))
    for n in linear_names:
        m = LAYER_RE.match(n)
        if m and int(m.group(1)) in keep:
            excluded.add(n)
    present = set(linear_names)
    for n in list(excluded):
        m = LAYER_RE.match(n)
        if not m:
            continue
        prefix = n[: len(n) - len(m.group(2))]
        excluded.update(prefix + g for g in fam.fused_partners(m.group(2)) if prefix + g in present)
    order = {n: i for i, n in enumerate(linear_names)}
    return sorted(excluded, key=lambda n: order[n]), unmatched


@lru_cache(maxsize=256)
def unmatched_exclusions(architecture: str, patterns: tuple[str, ...], num_layers: int) -> tuple[tuple[str, str], ...]:
    """The ``exclude_modules`` patterns that match none of the model's linears (``resolve_exclusions``' second result:
    the export keeps nothing for them, silently), each with the closest module name it may have meant ("" when none is
    close: ``core.errors.closest`` over the HF, TensorRT-LLM and short names of ``Family.linear_names``). Hostile s15b
    F1: ``[lm_haed]`` quantized the logits projection with no word. For an MoE family only expert 0 is named, so a
    pattern for another expert index is reported too (``rules`` warns there instead of refusing)."""
    from precision_pipeline.core.errors import closest

    fam = family(architecture)
    names = fam.linear_names(num_layers)
    _, unmatched = resolve_exclusions(names, list(patterns), 0, 0, num_layers, fam)
    if not unmatched:
        return ()
    known = sorted({x for n in names for x in match_names(fam, n)})
    return tuple((p, "" if any(c in p for c in "*?[") else closest(p, known) or "") for p in unmatched)  # no guess for a glob


def trtllm_name(hf_name: str, fam: Family = LLAMA) -> str:
    """TensorRT-LLM checkpoint module name of an HF module name (``Family.trtllm_name``).

    ``model.layers.3.self_attn.k_proj`` -> ``transformer.layers.3.attention.qkv``;
    ``lm_head`` -> ``lm_head``; ``model.embed_tokens`` -> ``transformer.vocab_embedding``;
    anything else (an MoE expert linear included) is returned unchanged.
    """
    return fam.trtllm_name(hf_name)


@lru_cache(maxsize=256)
def kept_linears(architecture: str, patterns: tuple[str, ...], keep_first: int, keep_last: int,
                 num_layers: int) -> tuple[tuple[frozenset[str], ...], bool]:
    """What the export keeps in high precision, per decoder layer 0..num_layers-1: the set of HF linears
    (relative, from ``Family.layer_linears``), and whether ``lm_head`` is kept -- ``resolve_exclusions``
    over ``Family.linear_names`` (the export's own matching), memoised per (family, patterns, keep_first,
    keep_last, layers): the names depend on nothing else."""
    fam = family(architecture)
    excluded, _ = resolve_exclusions(fam.linear_names(num_layers), list(patterns), keep_first, keep_last, num_layers, fam)
    per_layer: list[set[str]] = [set() for _ in range(num_layers)]
    head = False
    for n in excluded:
        m = LAYER_RE.match(n)
        if m:
            per_layer[int(m.group(1))].add(m.group(2))
        elif n == "lm_head":
            head = True
    return tuple(frozenset(s) for s in per_layer), head


__all__ = ["MOE_HF_READ_FORMATS", "num_experts_of", "hf_linear_shapes", "Linear", "MoE", "Family", "FAMILIES", "LLAMA", "QWEN2_MOE", "QWEN3_MOE", "GPT_OSS", "FAMILY_FORMATS", "family_problems",
           "router_problems", "SUPPORTED_ARCHITECTURES", "EXPORTED_ARCHITECTURES",
           "GATE_ARCHITECTURES", "HF_READ_ARCHITECTURES", "COLUMN", "ROW", "EXPERT", "LAYER_RE", "family", "family_of_model_type",
           "trtllm_name", "qkv_rows", "qkv_rows_of_config", "match_names", "resolve_exclusions", "kept_linears", "unmatched_exclusions"]
