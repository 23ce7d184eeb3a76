"""Expert-parallel (EP) re-sharding of a TensorRT-LLM 1.2 MoE checkpoint written by ModelOpt 0.47.

ModelOpt's ``export_tensorrt_llm_checkpoint(..., inference_tensor_parallel=N)`` always writes
``mapping.moe_tp_size = tp_size = N`` and ``moe_ep_size = 1``: every rank file holds *all*
experts, each expert's FFN cut into N slices. When a profile asks for expert parallelism
(``parallel.moe_ep_size > 1``, ``moe_tp_size x moe_ep_size = tp_size``), the expert tensors must
be regrouped: rank r holds only the experts of its EP group, each with a ``1/moe_tp_size``
slice of its FFN. ``reshard_moe_checkpoint`` does that; ``reassemble_experts`` reads any
checkpoint (any moe_tp/moe_ep) back into full ``[num_experts, ...]`` tensors.

Input choice: the tp_size = N ModelOpt export (not a tp = 1 export). Everything that is not
an expert tensor (attention qkv/dense with GQA, embeddings, lm_head, dense MLPs, shared experts
and all their per-format scale tensors) is already split for tp_size = N by ModelOpt itself and
is copied unchanged; only the expert tensors, which follow one uniform rule, are rebuilt. So
export with ``inference_tensor_parallel = moe_tp_size * moe_ep_size`` and then call
``reshard_moe_checkpoint``. (A tp = 1 export works only for the trivial 1 x 1 layout.)

Rank formula (TensorRT-LLM ``tensorrt_llm/mapping.py``, class ``Mapping``, with cp_size = 1 and
moe_cluster_size = 1; properties ``tp_rank``, ``pp_rank``, ``moe_tp_rank``, ``moe_ep_rank`` and
method ``ep_experts``)::

    tp_rank     = rank % tp_size
    pp_rank     = rank // tp_size
    moe_tp_rank = tp_rank // moe_ep_size
    moe_ep_rank = tp_rank %  moe_ep_size
    experts     = range(moe_ep_rank * E/moe_ep_size, (moe_ep_rank + 1) * E/moe_ep_size)

(So with tp 4, moe_tp 2, moe_ep 2: ranks 0,1 hold FFN slice 0 of experts [0..E/2) and
[E/2..E); ranks 2,3 hold slice 1 of the same.) The Mapping constructor also requires
``moe_tp_size * moe_ep_size == tp_size``.

Per-rank expert layout (TensorRT-LLM ``tensorrt_llm/layers/moe.py``, ``MixtureOfExperts``:
``experts_per_node = E // moe_ep_size``, ``expert_inter_size = I // moe_tp_size``, ``fc`` =
``[w3 experts..., w1 experts...]`` concatenated on the output dim, ``proj`` = w2; FP8
``weights_scaling_factor`` has shape ``(experts_per_node, 1)``, ``activation_scaling_factor``
``(1,)``; the router is not split, ``tp_size=1``, FP32) and ModelOpt's own TP split of an
``ExpertConfig`` (``modelopt/torch/export/postprocess.py``, ``_split_model_config_for_tp``:
w3 and w1 halves of fc chunked separately on dim 1 and re-concatenated; proj and its 3-D scales
chunked on dim 2; proj's ``prequant_scaling_factor`` on its last dim). Per expert tensor of a
MoE layer (a layer with ``mlp.router.weight``), ``E`` = num_experts:

===================================  ===============================  ========================
tensor (observed ModelOpt 0.47)      moe_ep (dim 0, if shape[0]==E)   moe_tp
===================================  ===============================  ========================
mlp.fc.weight      [E, 2I(/pack), H] slice experts                    dim 1, w3|w1 halves
mlp.fc.weights_scaling_factor 3-D    slice experts                    dim 1, w3|w1 halves
  (AWQ [E,2I,H/g], NVFP4 [E,2I,H/16])
mlp.proj.weight    [E, H, I(/pack)]  slice experts                    dim 2
mlp.proj.weights_scaling_factor 3-D  slice experts                    dim 2
mlp.proj.prequant_scaling_factor     slice experts                    last dim
  (AWQ [E, I])
FP8 weights_scaling_factor [E, 1]    slice experts                    replicated
NVFP4 weights_scaling_factor_2 [E]   slice experts                    replicated
mlp.fc.prequant_scaling_factor [E,H] slice experts                    replicated
activation_scaling_factor [1]        replicated (one per layer)       replicated
mlp.router.weight [E, H] F32         replicated (not an expert tensor)
===================================  ===============================  ========================

Any other tensor under ``mlp.fc`` / ``mlp.proj`` of a MoE layer (e.g. an expert bias) is refused
rather than guessed. Refusals are ``UserError`` (exit 2) naming the profile field.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from precision_pipeline.core.errors import UserError
from precision_pipeline.core.store import atomic_dir

FIELD_EP = "parallel.moe_ep_size"
FIELD_TP = "parallel.moe_tp_size"

_RANK_FILE = re.compile(r"^rank(\d+)\.safetensors$")
_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.layers\.\d+\.mlp)\.(?P<part>fc|proj)\.(?P<suffix>[A-Za-z0-9_]+)$")
_ROUTER_SUFFIX = ".router.weight"

# suffix -> how it is split over moe_tp ("halves1": dim 1, w3|w1 halves; "dim2"; "last"; "rep")
_FC_RULES = {"weight": "halves1", "weights_scaling_factor": "halves1_if3d", "weights_scaling_factor_2": "rep",
             "activation_scaling_factor": "rep", "prequant_scaling_factor": "rep"}
_PROJ_RULES = {"weight": "dim2", "weights_scaling_factor": "dim2_if3d", "weights_scaling_factor_2": "rep",
               "activation_scaling_factor": "rep", "prequant_scaling_factor": "last"}


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits in the TensorRT-LLM Mapping (cp_size = moe_cluster_size = 1)."""

    rank: int
    tp_rank: int
    pp_rank: int
    moe_tp_rank: int
    moe_ep_rank: int


def rank_coords(rank: int, tp_size: int, moe_tp_size: int, moe_ep_size: int) -> RankCoords:
    """``tensorrt_llm/mapping.py`` Mapping properties for ``rank`` (see the module docstring)."""
    if moe_tp_size * moe_ep_size != tp_size:
        raise ValueError(f"moe_tp_size {moe_tp_size} x moe_ep_size {moe_ep_size} != tp_size {tp_size}")
    tp_rank = rank % tp_size
    return RankCoords(rank, tp_rank, rank // tp_size, tp_rank // moe_ep_size, tp_rank % moe_ep_size)


def ep_experts(moe_ep_rank: int, num_experts: int, moe_ep_size: int) -> list[int]:
    """``Mapping.ep_experts``: the contiguous block of experts an EP rank holds."""
    per = num_experts // moe_ep_size
    return list(range(moe_ep_rank * per, (moe_ep_rank + 1) * per))


# --------------------------------------------------------------------------------------------
# Reading


def _rank_files(ckpt_dir: Path) -> dict[int, Path]:
    files = {}
    for p in Path(ckpt_dir).iterdir():
        m = _RANK_FILE.match(p.name)
        if m:
            files[int(m.group(1))] = p
    return dict(sorted(files.items()))


def _read_config(ckpt_dir: Path) -> dict:
    path = Path(ckpt_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError("checkpoint", f"{ckpt_dir} has no config.json.", "give a TensorRT-LLM checkpoint directory.")
    except json.JSONDecodeError as e:
        raise UserError("checkpoint", f"{path} is not valid JSON: {e}.", "re-export the checkpoint.")


def _mapping(cfg: dict) -> tuple[int, int, int, int, int]:
    m = cfg.get("mapping") or {}
    tp = int(m.get("tp_size", 1))
    pp = int(m.get("pp_size", 1))
    world = int(m.get("world_size", tp * pp))
    ep = int(m.get("moe_ep_size", 1) or 1)
    mtp = int(m.get("moe_tp_size", tp // ep) or tp // ep)
    if int(m.get("cp_size", 1) or 1) != 1 or int(m.get("moe_cluster_size", 1) or 1) not in (1, -1):
        raise UserError("checkpoint", "context parallelism / MoE clusters are not supported here.",
                        "export without cp_size / moe_cluster_size.")
    return world, tp, pp, mtp, ep


def _classify(name: str, routers: set[str]) -> tuple[str, str, str] | None:
    """(mlp_prefix, 'fc'|'proj', suffix) for a tensor of a MoE layer's experts, else None."""
    m = _EXPERT_NAME.match(name)
    if not m or m.group("prefix") not in routers:
        return None
    return m.group("prefix"), m.group("part"), m.group("suffix")


def _rule(part: str, suffix: str, ndim: int, name: str) -> str:
    rules = _FC_RULES if part == "fc" else _PROJ_RULES
    rule = rules.get(suffix)
    if rule is None:
        raise UserError(FIELD_EP, f"expert tensor {name!r} ({suffix}) has no known expert-parallel split rule.",
                        "leave parallel.moe_ep_size at 1 for this model/format, or extend build/precision_pipeline/quantize/moe_reshard.py with a verified rule.")
    if rule.endswith("_if3d"):
        rule = rule[: -len("_if3d")] if ndim == 3 else "rep"
    return rule


def _tp_split_dim(rule: str, ndim: int) -> int | None:
    return {"halves1": 1, "dim2": 2, "last": ndim - 1}.get(rule)


def _is_per_expert(name: str, suffix: str, t_shape: tuple[int, ...], num_experts_here: int) -> bool:
    """Whether a MoE-layer fc/proj tensor is stacked over experts (leading dim = experts held).

    Every such tensor ModelOpt 0.47 writes is per expert except ``activation_scaling_factor``
    ([1], one per layer: TensorRT-LLM's ``MOEWeightWrapper`` has shape (1,)). An activation scale
    of shape [E_local] with E_local > 1 would be taken as per expert.
    """
    if suffix == "activation_scaling_factor":
        return len(t_shape) >= 1 and t_shape[0] == num_experts_here and num_experts_here > 1
    if len(t_shape) < 1 or t_shape[0] != num_experts_here:
        raise ValueError(f"{name}: shape {list(t_shape)} is not stacked over the {num_experts_here} experts "
                         "this rank should hold")
    return True


class _Ckpt:
    """Lazy view of a checkpoint's rank files (safetensors opened once)."""

    def __init__(self, ckpt_dir: Path):
        self.dir = Path(ckpt_dir)
        self.config = _read_config(self.dir)
        self.world, self.tp, self.pp, self.moe_tp, self.moe_ep = _mapping(self.config)
        moe = self.config.get("moe") or {}
        self.num_experts = int(moe.get("num_experts", 0) or 0)
        files = _rank_files(self.dir)
        if sorted(files) != list(range(self.world)):
            raise UserError("checkpoint", f"{self.dir} has rank files {sorted(files)}, expected 0..{self.world - 1}.",
                            "re-export the checkpoint.")
        self.handles = {r: safe_open(str(p), framework="pt") for r, p in files.items()}
        self.keys = {r: list(h.keys()) for r, h in self.handles.items()}
        self.routers = {k[: -len(_ROUTER_SUFFIX)] for ks in self.keys.values() for k in ks if k.endswith(_ROUTER_SUFFIX)}
        self.coords = {r: rank_coords(r, self.tp, self.moe_tp, self.moe_ep) for r in self.handles}

    def get(self, rank: int, name: str) -> torch.Tensor:
        return self.handles[rank].get_tensor(name)

    def expert_names(self) -> list[str]:
        seen: dict[str, None] = {}
        for ks in self.keys.values():
            for k in ks:
                if _classify(k, self.routers):
                    seen.setdefault(k)
        return list(seen)

    def full_expert_tensor(self, name: str) -> torch.Tensor:
        """The [num_experts, ...] tensor rebuilt from every rank that holds a piece of it."""
        prefix, part, suffix = _classify(name, self.routers)
        holders = [r for r, ks in self.keys.items() if name in ks]
        # pieces[(moe_ep_rank, moe_tp_rank)] -> tensor; ranks of one pp stage only hold it
        pieces: dict[tuple[int, int], torch.Tensor] = {}
        for r in holders:
            c = self.coords[r]
            t = self.get(r, name)
            key = (c.moe_ep_rank, c.moe_tp_rank)
            if key in pieces:
                if not _bitwise_equal(pieces[key], t):
                    raise ValueError(f"{name}: ranks disagree on the piece for (moe_ep, moe_tp) = {key}")
                continue
            pieces[key] = t
        want = {(e, p) for e in range(self.moe_ep) for p in range(self.moe_tp)}
        if set(pieces) != want:
            raise ValueError(f"{name}: pieces {sorted(pieces)} do not cover (moe_ep, moe_tp) = {sorted(want)}")
        sample = pieces[(0, 0)]
        e_local = self.num_experts // self.moe_ep
        per_expert = _is_per_expert(name, suffix, tuple(sample.shape), e_local)
        rule = _rule(part, suffix, sample.dim(), name)
        dim = _tp_split_dim(rule, sample.dim())
        ep_parts = []
        for e in range(self.moe_ep if per_expert else 1):
            tps = [pieces[(e, p)] for p in range(self.moe_tp)]
            if dim is None:
                for p, t in enumerate(tps[1:], 1):
                    if not _bitwise_equal(t, tps[0]):
                        raise ValueError(f"{name}: replicated tensor differs between moe_tp ranks 0 and {p}")
                ep_parts.append(tps[0])
            elif rule == "halves1":
                w3 = [t.chunk(2, dim=1)[0] for t in tps]
                w1 = [t.chunk(2, dim=1)[1] for t in tps]
                ep_parts.append(torch.cat(w3 + w1, dim=1))
            else:
                ep_parts.append(torch.cat(tps, dim=dim))
        if not per_expert:
            for e in range(1, self.moe_ep):
                if not _bitwise_equal(pieces[(e, 0)], ep_parts[0]):
                    raise ValueError(f"{name}: shared tensor differs between moe_ep ranks 0 and {e}")
            return ep_parts[0]
        return torch.cat(ep_parts, dim=0)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.itemsize == 1:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def reassemble_experts(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Full expert tensors of a TRT-LLM MoE checkpoint, whatever its moe_tp/moe_ep layout.

    Returns ``{name: tensor}`` for every ``*.layers.N.mlp.{fc,proj}.*`` tensor of a layer that has
    a router: per-expert tensors come back as ``[num_experts, ...]`` with the full FFN width
    (fc = [w3 | w1] on dim 1), shared ones (``activation_scaling_factor``) as stored.
    """
    ck = _Ckpt(Path(ckpt_dir))
    if ck.num_experts < 2:
        raise UserError("checkpoint", f"{ckpt_dir} is not a MoE checkpoint (config.json has no moe.num_experts > 1).",
                        "use a MoE model (e.g. Mixtral).")
    return {name: ck.full_expert_tensor(name) for name in ck.expert_names()}


# --------------------------------------------------------------------------------------------
# Re-sharding


def resolve_moe_layout(tp_size: int, moe_tp_size: int | None, moe_ep_size: int | None,
                       num_experts: int | None = None, intermediate_size: int | None = None) -> tuple[int, int]:
    """(moe_tp_size, moe_ep_size) for a profile's ``parallel`` section, checked before any heavy work.

    Defaults as TensorRT-LLM's ``Mapping.__init__``: neither given -> (tp_size, 1); only
    moe_ep_size -> moe_tp_size = tp_size // moe_ep_size; only moe_tp_size -> moe_ep_size =
    tp_size // moe_tp_size. Raises ``UserError`` naming ``parallel.moe_ep_size`` when
    moe_tp_size x moe_ep_size != tp_size or num_experts % moe_ep_size != 0, and
    ``parallel.moe_tp_size`` when intermediate_size % moe_tp_size != 0.
    """
    if moe_tp_size is None and moe_ep_size is None:
        mtp, mep = tp_size, 1
    elif moe_tp_size is None:
        mep = int(moe_ep_size)
        mtp = tp_size // mep if mep and tp_size % mep == 0 else 0
    elif moe_ep_size is None:
        mtp = int(moe_tp_size)
        mep = tp_size // mtp if mtp and tp_size % mtp == 0 else 0
    else:
        mtp, mep = int(moe_tp_size), int(moe_ep_size)
    if mtp < 1 or mep < 1 or mtp * mep != tp_size:
        shown_tp = moe_tp_size if moe_tp_size is not None else "(default)"
        shown_ep = moe_ep_size if moe_ep_size is not None else "(default)"
        raise UserError(FIELD_EP, f"moe_tp_size {shown_tp} x moe_ep_size {shown_ep} does not give tp_size {tp_size} "
                        "(TensorRT-LLM's Mapping requires moe_tp_size x moe_ep_size == tp_size).",
                        f"choose sizes whose product is {tp_size}, e.g. moe_ep_size {tp_size} with moe_tp_size 1.")
    if num_experts is not None and num_experts % mep:
        raise UserError(FIELD_EP, f"{num_experts} experts cannot be split evenly over moe_ep_size {mep}.",
                        f"use a moe_ep_size that divides {num_experts} (and tp_size {tp_size}).")
    if intermediate_size and intermediate_size % mtp:
        raise UserError(FIELD_TP, f"the expert intermediate size {intermediate_size} is not divisible by "
                        f"moe_tp_size {mtp} (with {FIELD_EP} {mep}).",
                        f"use a moe_tp_size that divides {intermediate_size} (raise moe_ep_size instead).")
    return mtp, mep


def _check_layout(ck: _Ckpt, moe_tp_size: int, moe_ep_size: int) -> None:
    if ck.num_experts < 2:
        raise UserError(FIELD_EP, f"{ck.dir} is not a MoE checkpoint (no moe.num_experts > 1 in config.json); "
                        "expert parallelism does not apply.", "remove parallel.moe_ep_size / moe_tp_size.")
    inter = int(ck.config.get("moe_intermediate_size") or ck.config.get("intermediate_size") or 0)
    resolve_moe_layout(ck.tp, moe_tp_size, moe_ep_size, ck.num_experts, inter)


def _slice_for(full: torch.Tensor, name: str, part: str, suffix: str, num_experts: int, moe_tp_size: int,
               moe_ep_size: int, c: RankCoords) -> torch.Tensor:
    per_expert = _is_per_expert(name, suffix, tuple(full.shape), num_experts)
    t = full
    if per_expert:
        ex = ep_experts(c.moe_ep_rank, num_experts, moe_ep_size)
        t = t[ex[0]: ex[-1] + 1]
    rule = _rule(part, suffix, full.dim(), name)
    dim = _tp_split_dim(rule, full.dim())
    if dim is None or moe_tp_size == 1:
        return t.contiguous()
    if rule == "halves1":
        if t.shape[1] % (2 * moe_tp_size):
            raise UserError(FIELD_TP, f"{name} has {t.shape[1]} rows on dim 1 (w3|w1), not divisible into "
                            f"2 x moe_tp_size {moe_tp_size} slices.", "use a smaller moe_tp_size.")
        w3, w1 = t.chunk(2, dim=1)
        return torch.cat([w3.chunk(moe_tp_size, dim=1)[c.moe_tp_rank], w1.chunk(moe_tp_size, dim=1)[c.moe_tp_rank]],
                         dim=1).contiguous()
    if t.shape[dim] % moe_tp_size:
        raise UserError(FIELD_TP, f"{name} has {t.shape[dim]} columns on dim {dim}, not divisible by moe_tp_size "
                        f"{moe_tp_size} (quantization groups must not straddle ranks).", "use a smaller moe_tp_size.")
    return t.chunk(moe_tp_size, dim=dim)[c.moe_tp_rank].contiguous()


def reshard_moe_checkpoint(ckpt_dir: Path, moe_tp_size: int, moe_ep_size: int, out_dir: Path) -> dict:
    """Write a copy of ``ckpt_dir`` whose expert tensors follow (moe_tp_size, moe_ep_size).

    ``ckpt_dir`` is a TRT-LLM checkpoint with ``tp_size = moe_tp_size x moe_ep_size`` (ModelOpt's
    export with ``inference_tensor_parallel`` = that product; any existing moe layout is read).
    Non-expert tensors are copied unchanged per rank; expert tensors are rebuilt and re-cut
    (module docstring); ``config.json`` ``mapping`` gets the new ``moe_tp_size``/``moe_ep_size``.
    Other files (``quant_cfg.json`` ...) are copied. ``out_dir`` is written atomically.

    Returns ``{"tp_size", "pp_size", "world_size", "moe_tp_size", "moe_ep_size", "num_experts",
    "experts_per_rank", "expert_tensors", "ranks": [{"rank", "tp_rank", "pp_rank",
    "moe_tp_rank", "moe_ep_rank", "experts"}...]}``.

    Raises ``UserError`` (exit 2) naming ``parallel.moe_ep_size`` when num_experts % moe_ep_size
    != 0 or moe_tp_size x moe_ep_size != tp_size, and ``parallel.moe_tp_size`` when the expert
    intermediate size (or a quantized block dim) is not divisible by moe_tp_size.
    """
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if ckpt_dir.resolve() == out_dir.resolve():
        raise UserError("out_dir", "the output directory is the input checkpoint.", "write to another directory.")
    ck = _Ckpt(ckpt_dir)
    _check_layout(ck, moe_tp_size, moe_ep_size)
    names = ck.expert_names()
    new_coords = {r: rank_coords(r, ck.tp, moe_tp_size, moe_ep_size) for r in range(ck.world)}
    full_cache: dict[str, torch.Tensor] = {}

    with atomic_dir(out_dir) as tmp:
        for r in range(ck.world):
            out: dict[str, torch.Tensor] = {}
            c = new_coords[r]
            for key in ck.keys[r]:
                cls = _classify(key, ck.routers)
                if cls is None:
                    out[key] = ck.get(r, key)
                    continue
                if key not in full_cache:
                    full_cache.clear()  # one full tensor in memory at a time (ranks read in order)
                    full_cache[key] = ck.full_expert_tensor(key)
                _, part, suffix = cls
                out[key] = _slice_for(full_cache[key], key, part, suffix, ck.num_experts, moe_tp_size, moe_ep_size, c)
            full_cache.clear()
            save_file(out, str(tmp / f"rank{r}.safetensors"), metadata={"format": "pt"})
        for p in ckpt_dir.iterdir():
            if p.name == "config.json" or _RANK_FILE.match(p.name):
                continue
            if p.is_file():
                shutil.copy2(p, tmp / p.name)
            elif p.is_dir():
                shutil.copytree(p, tmp / p.name)
        cfg = dict(ck.config)
        mapping = dict(cfg.get("mapping") or {})
        mapping.update(moe_tp_size=moe_tp_size, moe_ep_size=moe_ep_size)
        cfg["mapping"] = mapping
        (tmp / "config.json").write_text(json.dumps(cfg, indent=4) + "\n")

    per = ck.num_experts // moe_ep_size
    return {
        "tp_size": ck.tp,
        "pp_size": ck.pp,
        "world_size": ck.world,
        "moe_tp_size": moe_tp_size,
        "moe_ep_size": moe_ep_size,
        "num_experts": ck.num_experts,
        "experts_per_rank": per,
        "expert_tensors": len(names),
        "ranks": [
            {"rank": c.rank, "tp_rank": c.tp_rank, "pp_rank": c.pp_rank, "moe_tp_rank": c.moe_tp_rank,
             "moe_ep_rank": c.moe_ep_rank, "experts": ep_experts(c.moe_ep_rank, ck.num_experts, moe_ep_size)}
            for c in new_coords.values()
        ],
    }


__all__ = ["RankCoords", "rank_coords", "ep_experts", "resolve_moe_layout", "reassemble_experts", "reshard_moe_checkpoint"]
