"""The sensitivity analysis's evaluator: the FP32 HF model with the checkpoint's quantized modules swapped in
cell by cell (a cell: one decoder layer's linear kind, its KV cache, or lm_head), on golden prompts packed into
shared-prefix sequences, with every layer's FP32 input cached so a cell's run starts at its layer.
``Evaluator.measure(cells)`` gives the per-token KL / top-1 of the answer positions against the FP32 logits
(the gate's metric code, gate/metrics.py). Shapes and the packing: analysis/sensitivity.py's module doc."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from precision_pipeline.core.errors import UserError
from precision_pipeline.spec import formats as FMT
from precision_pipeline.spec.families import LLAMA

LINEAR_KINDS: dict[str, tuple[str, ...]] = {
    "attention.qkv": ("attention.qkv",),
    "attention.dense": ("attention.dense",),
    "mlp.fc_gate": ("mlp.fc", "mlp.gate"),
    "mlp.proj": ("mlp.proj",),
}
KV_KIND = "kv_cache"
HEAD_KIND = "lm_head"
KINDS: tuple[str, ...] = tuple(LINEAR_KINDS) + (KV_KIND,)
DEFAULT_PACK_TOKENS = 512


@dataclass(frozen=True, order=True)
class Cell:
    """One unit that is quantized alone: ``layer`` (None for lm_head) x ``kind``."""

    layer: int
    kind: str

    @property
    def name(self) -> str:
        return HEAD_KIND if self.kind == HEAD_KIND else f"L{self.layer:02d}.{self.kind}"

    @property
    def trt_linears(self) -> tuple[str, ...]:
        """TensorRT-LLM linear names this cell covers (empty for kv_cache)."""
        if self.kind == HEAD_KIND:
            return ("lm_head",)
        return tuple(f"transformer.layers.{self.layer}.{t}" for t in LINEAR_KINDS.get(self.kind, ()))

    @property
    def excludable(self) -> bool:
        return self.kind != KV_KIND

    @staticmethod
    def parse(name: str) -> "Cell":
        if name == HEAD_KIND:
            return Cell(1 << 30, HEAD_KIND)
        layer, kind = name.split(".", 1)
        return Cell(int(layer[1:]), kind)



# ==============================================================================================
# The evaluator: FP32 model, cached layer inputs, swap cells in and out


@dataclass
class Measurement:
    """KL / top-1 of one set of quantized cells vs the FP32 reference (answer positions)."""

    kl: np.ndarray
    top1: np.ndarray
    seconds: float

    def summary(self) -> dict[str, float]:
        from precision_pipeline.gate.metrics import kl_summary

        return {**kl_summary(self.kl), "top1": float(self.top1.mean()) if self.top1.size else float("nan")}


class Evaluator:
    """The FP32 HF model plus the checkpoint's quantized modules, cell by cell.

    ``ck``: the dequantized checkpoint (``checkpoint.dequantize_checkpoint``); tests may replace
    entries of ``ck.linears`` before measuring. ``encoded``: golden prompts (``golden.encode_golden``).
    """

    def __init__(self, model_dir: Path, ck: Any, encoded: Sequence[Any], pack_tokens: int = DEFAULT_PACK_TOKENS):
        from transformers import AutoModelForCausalLM

        from precision_pipeline.gate.model import ATTN_IMPL, act_fake_quant, register_attention

        self.ck = ck
        cfg = ck.config
        q = cfg.get("quantization") or {}
        self.quant_algo = FMT.gemm(q.get("quant_algo")).value
        self.kv_algo = getattr(ck, "kv_cache_quant_algo", None) or q.get("kv_cache_quant_algo")
        self.group_size = q.get("group_size")
        self.act_format = act_fake_quant(self.quant_algo)
        kvf = FMT.KV.get(self.kv_algo) if self.kv_algo else None
        self.kv_format = kvf.fake_quant if kvf is not None else None
        register_attention()
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        model.config._attn_implementation = ATTN_IMPL
        for layer in model.model.layers:
            layer.self_attn.config._attn_implementation = ATTN_IMPL
            layer.self_attn.kv_format = None
        self.model = model
        self.n_layers = len(model.model.layers)
        if int(cfg.get("num_hidden_layers", -1)) != self.n_layers:
            raise UserError("checkpoint", f"checkpoint has {cfg.get('num_hidden_layers')} layers, the model {self.n_layers}.",
                            "pass the HF folder the checkpoint was made from (--model).")
        self.hf_linear_names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        hd = int(cfg.get("head_size") or model.config.hidden_size // model.config.num_attention_heads)
        self.nq = model.config.num_attention_heads * hd
        self.nkv = model.config.num_key_value_heads * hd
        self.head_dim = hd
        self._pack(encoded, pack_tokens)
        self._reference()

    # ---- packing
    def _pack(self, encoded: Sequence[Any], pack_tokens: int) -> None:
        """Pack prompts (first-fit decreasing, at most ``pack_tokens`` tokens a pack) into sequences
        ``[shared prefix][prompt 1 rest][prompt 2 rest]...``: the chat template's system header
        that every prompt starts with is computed once per pack; each prompt attends to the prefix
        and to itself (block-diagonal causal mask), positions continue after the prefix as in the
        prompt alone. A pack of one prompt is the prompt itself (plain causal attention)."""
        encoded = list(encoded)
        if not encoded:
            raise UserError("golden set", "the prompt subset is empty.", "use prompts_per_category >= 1.")
        lcp = min(len(e.input_ids) for e in encoded)
        first = encoded[0].input_ids
        for e in encoded[1:]:
            n = 0
            while n < lcp and e.input_ids[n] == first[n]:
                n += 1
            lcp = n
        lcp = max(0, min([lcp] + [e.user_start - 1 for e in encoded]))
        self.prefix_tokens = lcp
        bins: list[list[Any]] = []
        sizes: list[int] = []
        for e in sorted(encoded, key=lambda e: -len(e.input_ids)):
            n = len(e.input_ids) - lcp
            for k in range(len(bins)):
                if sizes[k] + n <= pack_tokens:
                    bins[k].append(e)
                    sizes[k] += n
                    break
            else:
                bins.append([e])
                sizes.append(lcp + n)
        self.packs = []
        for p in bins:
            P = lcp if len(p) > 1 else 0
            ids, pos, seg, ans = list(p[0].input_ids[:P]), list(range(P)), [-1] * P, []
            for k, e in enumerate(p):
                off = len(ids)
                ids += list(e.input_ids[P:])
                pos += list(range(P, len(e.input_ids)))
                seg += [k] * (len(e.input_ids) - P)
                a = e.answer_positions
                ans += list(range(off + a.start - P, off + a.stop - P))
            mask = None
            if len(p) > 1:
                s = torch.tensor(seg)
                t = torch.arange(len(ids))
                mask = ((s[None, :] == s[:, None]) | (s[None, :] == -1)) & (t[None, :] <= t[:, None])
                mask = mask[None, None]
            self.packs.append({"ids": torch.tensor([ids], dtype=torch.long), "pos": torch.tensor([pos], dtype=torch.long),
                               "mask": mask, "answer": torch.tensor(ans, dtype=torch.long), "prompts": [e.id for e in p]})
        self.tokens = sum(int(p["ids"].shape[1]) for p in self.packs)
        self.answer_tokens = sum(int(p["answer"].numel()) for p in self.packs)

    # ---- running
    @torch.inference_mode()
    def _run(self, start: int, hidden: list[torch.Tensor], cache: bool = False) -> torch.Tensor:
        """Answer-position logits ``[A, V]`` from layer ``start`` on (``hidden``: per pack, its input)."""
        m = self.model.model
        outs, finals = [], []
        for pi, p in enumerate(self.packs):
            h = hidden[pi]
            pe = p["pe"]
            for i in range(start, self.n_layers):
                if cache:
                    self.layer_inputs[i].append(h)
                h = m.layers[i](h, attention_mask=p["mask"], position_ids=p["pos"], position_embeddings=pe,
                                cache_position=p["cache_position"])
            h = m.norm(h[0, p["answer"]])
            if cache:
                finals.append(h)
            outs.append(self.model.lm_head(h).float())
        if cache:
            self.final_hidden = torch.cat(finals)
        return torch.cat(outs)

    @torch.inference_mode()
    def _reference(self) -> None:
        t0 = time.perf_counter()
        m = self.model.model
        self.layer_inputs: list[list[torch.Tensor]] = [[] for _ in range(self.n_layers)]
        emb = []
        for p in self.packs:
            x = m.embed_tokens(p["ids"])
            p["pe"] = m.rotary_emb(x, p["pos"])
            p["cache_position"] = torch.arange(p["ids"].shape[1])
            emb.append(x)
        self.ref_logits = self._run(0, emb, cache=True)
        self.reference_seconds = time.perf_counter() - t0

    # ---- swapping
    def _spec(self, trt: str):
        spec = self.ck.linears.get(trt)
        if spec is None:
            raise UserError("checkpoint", f"the checkpoint has no {trt}.", "re-export the checkpoint.")
        return spec

    def quantized(self, cell: Cell) -> bool:
        """Whether the checkpoint quantizes this cell (kv_cache: the KV cache is quantized)."""
        if cell.kind == KV_KIND:
            return self.kv_format is not None
        if cell.kind == HEAD_KIND:
            s = self.ck.linears.get("lm_head")
            return bool(s is not None and s.quantized)
        return all(self._spec(t).quantized for t in cell.trt_linears)

    def _replacements(self, cell: Cell) -> list[tuple[nn.Module, str, nn.Module]]:
        from precision_pipeline.gate.model import QuantLinear, act_fake_quant, split_qkv

        def act_of(spec: Any) -> Optional[str]:  # per linear (MIXED_PRECISION layers differ)
            algo = getattr(spec, "quant_algo", None)
            return act_fake_quant(algo) if FMT.gemm(algo).is_quantized else self.act_format

        if cell.kind == HEAD_KIND:
            spec = self._spec("lm_head")
            return [(self.model, "lm_head", QuantLinear(spec, act_of(spec), torch.float32))]
        layer = self.model.model.layers[cell.layer]
        out = []
        for trt in cell.trt_linears:
            spec = self._spec(trt)
            short = trt.split(".", 3)[3]
            if short == "attention.qkv":
                for name, sub in split_qkv(spec, self.nq, self.nkv):
                    out.append((layer.self_attn, name, QuantLinear(sub, act_of(spec) if sub.quantized else None,
                                                                   torch.float32)))
            else:
                parent, attr = LLAMA.gemm_hf(short)[0].split(".")
                mod = getattr(layer, parent)
                old = getattr(mod, attr)
                if tuple(old.weight.shape) != tuple(spec.weight.shape):
                    raise UserError("checkpoint", f"{trt} has shape {tuple(spec.weight.shape)}; the model expects "
                                    f"{tuple(old.weight.shape)}.", "pass the HF folder the checkpoint was made from.")
                out.append((mod, attr, QuantLinear(spec, act_of(spec) if spec.quantized else None, torch.float32)))
        return out

    @contextlib.contextmanager
    def swapped(self, cells: Iterable[Cell]):
        """Quantize ``cells`` (and only them) for the duration; the FP32 modules come back afterwards."""
        saved: list[tuple[nn.Module, str, Any]] = []
        kv_layers: list[int] = []
        try:
            for c in cells:
                if c.kind == KV_KIND:
                    attn = self.model.model.layers[c.layer].self_attn
                    ks, vs = self.ck.kv_scales[c.layer]
                    attn.kv_format = self.kv_format
                    attn.k_scale, attn.v_scale = ks.to(torch.float32), vs.to(torch.float32)
                    kv_layers.append(c.layer)
                    continue
                for parent, attr, new in self._replacements(c):
                    saved.append((parent, attr, getattr(parent, attr)))
                    setattr(parent, attr, new)
            yield
        finally:
            for parent, attr, old in reversed(saved):
                setattr(parent, attr, old)
            for i in kv_layers:
                self.model.model.layers[i].self_attn.kv_format = None

    def measure(self, cells: Sequence[Cell]) -> Measurement:
        """KL / top-1 with ``cells`` quantized and everything else FP32."""
        from precision_pipeline.gate.metrics import token_metrics

        t0 = time.perf_counter()
        cells = list(cells)
        start = min([c.layer for c in cells if c.kind != HEAD_KIND] or [self.n_layers])
        with self.swapped(cells), torch.inference_mode():
            if start < self.n_layers:
                logits = self._run(start, self.layer_inputs[start])
            else:  # lm_head only: the FP32 final hidden states are cached
                logits = self.model.lm_head(self.final_hidden).float()
        tm = token_metrics(self.ref_logits, logits)
        return Measurement(tm.kl, tm.top1, time.perf_counter() - t0)

    # ---- cost
    def cell_bytes(self, cell: Cell) -> dict[str, float]:
        """Checkpoint bytes of the cell in BF16 and quantized; excluding it costs the difference.
        kv_cache: KV bytes per token of that layer (BF16 vs quantized)."""
        if cell.kind == KV_KIND:
            elems = 2 * self.nkv
            kvf = FMT.KV.get(self.kv_algo) if self.kv_algo else FMT.kv(None)
            q = elems * (kvf.bytes_per_element if kvf is not None else 2.0)
            return {"kv_bytes_per_token_bf16": elems * 2.0, "kv_bytes_per_token_quantized": q}
        bf16 = quant = 0.0
        for t in cell.trt_linears:
            spec = self._spec(t)
            n_out, n_in = spec.weight.shape
            bf16 += 2.0 * n_in * n_out
            # MIXED_PRECISION: each linear's own format and group size (from quant_cfg.json)
            algo = getattr(spec, "quant_algo", None)
            algo = algo if FMT.gemm(algo).is_quantized or FMT.gemm(self.quant_algo).per_layer else self.quant_algo
            group = getattr(spec, "group_size", None) or self.group_size
            quant += FMT.linear_weight_bytes(algo, n_in, n_out, group, dtype_bytes=2)
        return {"bf16_bytes": bf16, "quantized_bytes": quant, "cost_bytes": bf16 - quant}


__all__ = ["LINEAR_KINDS", "KV_KIND", "HEAD_KIND", "KINDS", "DEFAULT_PACK_TOKENS", "Cell", "Measurement", "Evaluator"]
