"""Pack: render a Triton model repository (tensorrtllm_backend conventions) for one engine.

Layout written to ``out_dir`` (the build output's ``model_repository/``), atomically::

    ensemble/                config.pbtxt, 1/          preprocessing -> tensorrt_llm_<h12> -> postprocessing
    preprocessing/           config.pbtxt, 1/model.py, tokenizer/  (tokenizer.json, tokenizer_config.json,
                                                                    special_tokens_map.json, chat_template.jinja)
    postprocessing/          config.pbtxt, 1/model.py
    tensorrt_llm_bls/        config.pbtxt, 1/model.py  (parameter tensorrt_llm_model_name = tensorrt_llm_<h12>)
    tensorrt_llm_<h12>/      config.pbtxt, 1/, engine/   one Triton model per engine ("engine unit"),
                             precision_path.json, routing.json (the profile's routing table, when it has one)
        engine/              the engine files (hard links of the engine stage's output) when it was built,
                             plus cpu_reference.json and checkpoint/ (hard links) for the CPU reference backend
    pack.json                what was rendered (engine hash, unit name, parameters, notes) and ``unit_files``:
                             {path in the unit: [size in bytes, sha256]} of every file of the unit

``<h12>`` is the first 12 hex digits of the unit's **content key** (``unit_key``): sha256 over every file
of the unit (engine files, checkpoint, ``cpu_reference.json``, ``precision_path.json``, the rendered
``config.pbtxt``) as written under a placeholder name (the name and the paths that contain it are not yet
known), so a change to anything in the unit -- the engine, the checkpoint or only what pack renders --
gives another name. The *engine hash* (sha256 of the engine directory's files when the engine was built,
else of the TRT-LLM checkpoint plus the plan's limits/effective settings) names the engine inside it.
The hard links stay inside the build output; a serving repository gets copies (``serving/release.py``
``install_unit``), verified against ``unit_files``.

Paths inside configs are *serving-side* paths: ``repo_root`` is where the build output (the parent of
``model_repository/``) will be inside the serving container (default: the output's absolute path):
``gpt_model_path = <repo_root>/model_repository/tensorrt_llm_<h12>/engine`` and
``tokenizer_dir = <repo_root>/model_repository/preprocessing/tokenizer``. The real tensorrtllm backend
takes the engine from ``gpt_model_path`` and ignores Triton's version directories, so an engine is
switched by switching *models* (see build/precision_pipeline/serving/release.py), never versions.

Chat template: the **preprocessing model applies it** when its parameter ``apply_chat_template`` is
"true" (rendered true when the tokenizer has a chat template). The request's ``text_input`` is then the
user message (or a JSON list of {"role","content"} messages), and the templated prompt is encoded with
``add_special_tokens=false`` (the template already carries the markers). Clients never template.

Every template placeholder ``${name}`` must be filled, every parameter given must exist in the template
(a misspelt key is an error, not a silent default; ``serving/templates.py``, style ``PBTXT``), and every
rendered config.pbtxt must parse with
``tritonclient.grpc.model_config_pb2`` (the 2.51 schema, same as the server). Failures raise
``UserError`` (exit 2).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from precision_pipeline.core.errors import Problem, UserError
from precision_pipeline.core.paths import REPO_ROOT, SOURCE_ROOT
from precision_pipeline.core.store import atomic_dir, hash_dir, hash_file, hash_obj, make_readable
from precision_pipeline.resolve.plan import ResolvedPlan
from precision_pipeline.serving import templates
from precision_pipeline.spec.formats import TRITON_DTYPE
from precision_pipeline.spec.routing import routing_table

TEMPLATES_DIR = REPO_ROOT / "triton_repo" / "all_models" / "inflight_batcher_llm"
BACKENDS_DIR = REPO_ROOT / "triton_repo" / "backends"
UNIT_PREFIX = "tensorrt_llm_"
FIXED_MODELS = ("ensemble", "preprocessing", "postprocessing", "tensorrt_llm_bls")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json")
ENGINE_ARGS_FILE = "trtllm-build.args.json"  # written by build/precision_pipeline/engine/trtllm_build.py next to the engine; not part of the hash
CPU_REFERENCE_FILE = "cpu_reference.json"
PRECISION_PATH_FILE = "precision_path.json"
ROUTING_FILE = "routing.json"
"""The unit's per-request routing table (spec/routing.py ``routing_table`` of the profile's ``routing`` section; only
when the profile has one). The BLS reads the current release's (tensorrt_llm_bls/1/model.py), so the table travels
with the unit through promote, rollout and rollback."""
"""``<unit>/precision_path.json``: the precision path of one engine unit (``precision_path``), read by
the BLS to label its metrics and each response (triton_repo/.../tensorrt_llm_bls/1/model.py)."""
PACK_FILE = "pack.json"

_DTYPE_TO_TRITON = TRITON_DTYPE  # logits dtype -> Triton data type (one home: spec/formats.py)


@dataclass
class PackResult:
    """What ``pack_repository`` wrote."""

    out_dir: Path
    models: list[str]
    engine_unit: str
    engine_hash: str
    engine_present: bool
    params: dict[str, dict[str, str]]
    chat_template_applied_by: str
    notes: list[str] = field(default_factory=list)
    unit_key: str = ""
    """sha256 over the unit's files as written under ``UNIT_PLACEHOLDER``; ``engine_unit`` is its first 12 digits."""
    unit_files: dict[str, list] = field(default_factory=dict)
    """{path in the unit: [size in bytes, sha256]}: what ``install_unit`` verifies each copy against."""

    def to_json(self) -> dict:
        return {
            "out_dir": str(self.out_dir), "models": self.models, "engine_unit": self.engine_unit,
            "engine_hash": self.engine_hash, "engine_present": self.engine_present, "params": self.params,
            "chat_template_applied_by": self.chat_template_applied_by, "notes": self.notes,
            "unit_key": self.unit_key, "unit_files": self.unit_files,
        }


# --------------------------------------------------------------------------------------------
# Rendering and validation


def render_template(text: str, params: Mapping[str, Any], where: str) -> str:
    """Fill the ``${name}`` placeholders of a config.pbtxt template (``templates.render`` in the ``PBTXT``
    style: unknown, missing and unused names are refused, values are one line, quotes are escaped)."""
    return templates.render(text, params, where, templates.PBTXT)


def parse_model_config(text: str, where: str):
    """Parse config.pbtxt text with the 2.51 schema; UserError with line/column on failure."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    cfg = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, cfg)
    except text_format.ParseError as e:
        raise UserError(where, f"does not parse as a Triton 2.51 ModelConfig: {e}.", "fix the template or the value.")
    return cfg


def config_params(cfg) -> dict[str, str]:
    """A parsed ModelConfig's ``parameters`` as a plain dict."""
    return {k: v.string_value for k, v in cfg.parameters.items()}


def unit_name(key: str) -> str:
    """Triton model name of an engine unit: ``tensorrt_llm_`` + the first 12 hex digits of its content key."""
    return f"{UNIT_PREFIX}{key[:12]}"


UNIT_PLACEHOLDER = f"{UNIT_PREFIX}000000000000"
"""The name a unit is rendered and written under to compute its content key (its real name is that key)."""


def is_unit(name: str) -> bool:
    return name.startswith(UNIT_PREFIX) and re.fullmatch(r"[0-9a-f]{12}", name[len(UNIT_PREFIX):]) is not None


def serving_path(repo_root: str, repo_name: str, *parts: str) -> str:
    """A path inside the serving container: ``<repo_root>/<repo_name>/<parts...>`` (POSIX)."""
    return str(repo_root).rstrip("/") + "/" + "/".join([repo_name, *parts])


# --------------------------------------------------------------------------------------------
# Token ids and tokenizer


def _read_json(p: Path) -> dict:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return {}


def token_ids(model_dir: Path) -> tuple[int, int, list[str]]:
    """(end_id, pad_id, extra stop words) from generation_config.json, then config.json.

    The tokenizer's own eos_token is *not* used: for SmolLM2's GGUF-derived tokenizer it is
    ``<|im_start|>`` (id 1), while the model ends a turn with ``<|im_end|>`` (id 2), which is what
    generation_config.json says. Extra eos ids become stop words (their token strings).
    """
    gen = _read_json(model_dir / "generation_config.json")
    cfg = _read_json(model_dir / "config.json")
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    if eos is None:
        raise UserError("model.eos_token_id", f"neither generation_config.json nor config.json in {model_dir} names an eos token.",
                        "add eos_token_id to the model's generation_config.json.")
    eos_list = [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    pad = gen.get("pad_token_id", cfg.get("pad_token_id"))
    pad_id = int(pad[0] if isinstance(pad, list) else pad) if pad is not None else eos_list[0]
    stop_words: list[str] = []
    if len(eos_list) > 1:
        vocab = _id_to_token(model_dir)
        stop_words = [vocab[i] for i in eos_list[1:] if i in vocab]
    return eos_list[0], pad_id, stop_words


def _id_to_token(model_dir: Path) -> dict[int, str]:
    tj = _read_json(model_dir / "tokenizer.json")
    out = {int(t["id"]): t["content"] for t in tj.get("added_tokens", [])}
    return out


def _chat_template(model_dir: Path) -> str | None:
    p = model_dir / "chat_template.jinja"
    if p.is_file():
        return p.read_text()
    tc = _read_json(model_dir / "tokenizer_config.json").get("chat_template")
    return tc if isinstance(tc, str) else None


# --------------------------------------------------------------------------------------------
# Parameters


def compute_params(plan: ResolvedPlan, profile, model_dir: Path, engine_hash: str, repo_root: str,
                   repo_name: str = "model_repository", unit: str | None = None) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Template parameters for each model, from the typed plan, the profile's runtime section and the model's files.

    Limits, mapping, the effective per-phase settings and the KV-cache capacity are read from
    ``plan`` only (no profile fallbacks). Raises UserError when the plan has no memory plan
    (unknown GPU) or names a logits type Triton does not have.
    """
    notes: list[str] = []
    limits, eff, mapping = plan.limits, plan.effective, plan.mapping
    rt = profile.runtime
    _check_packable(plan, rt)
    max_batch = int(limits.max_batch_size)
    max_beam = int(limits.max_beam_width)
    world = int(mapping.world_size)
    kv_tokens = plan.memory.kv_tokens_capacity
    logits_dt = eff.triton_logits_datatype
    decoupled = bool(rt.decoupled_mode)
    has_template = _chat_template(model_dir) is not None
    tok_dir = serving_path(repo_root, repo_name, "preprocessing", "tokenizer")
    unit = unit or unit_name(engine_hash)
    common = {"triton_max_batch_size": max_batch}

    trt = {
        **common,
        "model_name": unit,
        "triton_backend": "tensorrtllm",
        "decoupled_mode": decoupled,
        "max_queue_delay_microseconds": int(rt.max_queue_delay_microseconds),
        "max_queue_size": 0,
        "logits_datatype": logits_dt,
        "batching_strategy": "inflight_fused_batching",
        "engine_dir": serving_path(repo_root, repo_name, unit, "engine"),
        "max_beam_width": max_beam,
        "max_tokens_in_paged_kv_cache": int(kv_tokens),
        "kv_cache_free_gpu_mem_fraction": float(rt.kv_cache_free_gpu_mem_fraction),
        "enable_kv_cache_reuse": bool(eff.enable_kv_cache_reuse),
        "enable_chunked_context": bool(eff.enable_chunked_context),
        "batch_scheduler_policy": rt.batch_scheduler_policy,
        "exclude_input_in_output": True,
        "multi_block_mode": bool(eff.multi_block_mode),
        "gpu_device_ids": ",".join(str(i) for i in range(world)),
        # guided decoding off: the backend reads these three without a default (serving/backend_contract.py)
        "tokenizer_dir": "",
        "xgrammar_tokenizer_info_path": "",
        "guided_decoding_backend": "",
        "cpu_reference": True,
        "cpu_reference_threads": 1,
    }
    pre, post = _tokenizer_params(common, rt, model_dir, tok_dir, has_template)
    ens = {**common, "tensorrt_llm_model_name": unit}
    bls = {
        **common,
        "decoupled_mode": decoupled,
        "bls_instance_count": int(rt.instance_count),
        "logits_datatype": logits_dt,
        "accumulate_tokens": False,
        "tensorrt_llm_model_name": unit,
        "otlp_traces_url": profile.deployment.otlp_traces_url or "",
        "gen_ai_operation_name": "chat" if has_template else "text_completion",
    }
    return {"tensorrt_llm": trt, "preprocessing": pre, "postprocessing": post, "ensemble": ens,
            "tensorrt_llm_bls": bls}, notes


def _check_packable(plan: ResolvedPlan, rt) -> None:
    """UserError unless ``plan`` has a memory plan and a Triton logits type and ``rt`` streams only when decoupled."""
    if plan.memory is None:
        raise UserError("plan.memory", "is missing: the plan was resolved without a known, supported GPU.",
                        "resolve the plan (build/precision_pipeline/resolve/plan.py) on a catalog GPU before packing.")
    logits_dt = plan.effective.triton_logits_datatype
    if logits_dt not in _DTYPE_TO_TRITON.values():
        raise UserError("plan.effective.triton_logits_datatype", f"{logits_dt!r} is not a Triton logits type.",
                        "use TYPE_FP32, TYPE_FP16 or TYPE_BF16.")
    if rt.streaming and not bool(rt.decoupled_mode):
        raise UserError("runtime.streaming", "needs runtime.decoupled_mode: true (tensorrtllm_backend streams only in decoupled mode).",
                        "set runtime.decoupled_mode: true or runtime.streaming: false.")


def _tokenizer_params(common: dict[str, Any], rt, model_dir: Path, tok_dir: str,
                      has_template: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The preprocessing and postprocessing models' parameters (the tokenizer's ids and stop words from ``model_dir``)."""
    end_id, pad_id, stop_words = token_ids(model_dir)
    pre = {
        **common,
        "max_queue_delay_microseconds": int(rt.max_queue_delay_microseconds),
        "max_queue_size": 0,
        "preprocessing_instance_count": int(rt.instance_count),
        "tokenizer_dir": tok_dir,
        "add_special_tokens": not has_template,
        "apply_chat_template": has_template,
        "end_id": end_id,
        "pad_id": pad_id,
        "stop_words": json.dumps(stop_words),
    }
    post = {
        **common,
        "postprocessing_instance_count": int(rt.instance_count),
        "tokenizer_dir": tok_dir,
        "skip_special_tokens": True,
    }
    return pre, post


def render_all(params: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Render and parse every template. Returns {template model name: config text}."""
    out = {}
    for model, p in params.items():
        tpath = TEMPLATES_DIR / model / "config.pbtxt"
        text = render_template(tpath.read_text(), p, f"{model}/config.pbtxt")
        cfg = parse_model_config(text, f"{model}/config.pbtxt")
        want = p.get("model_name", model)
        if cfg.name != want:
            raise UserError(f"{model}/config.pbtxt", f"renders name {cfg.name!r}, expected {want!r}.", "fix the template's name.")
        out[model] = text
    return out


# --------------------------------------------------------------------------------------------
# Engine cross-check


def cross_check_engine(engine_config: dict, trt_params: Mapping[str, Any]) -> list[Problem]:
    """Compare an engine's config.json with the rendered tensorrt_llm parameters.

    Checks: world size vs gpu_device_ids; KV-cache reuse / chunked context vs paged KV cache and
    paged context FMHA; logits dtype vs logits_datatype; batch/beam/length limits vs the config.
    Returns the problems found (empty = consistent).
    """
    pc = engine_config.get("pretrained_config") or {}
    bc = engine_config.get("build_config") or {}
    plug = bc.get("plugin_config") or {}
    problems: list[Problem] = []
    f = "engine/config.json"

    world = (pc.get("mapping") or {}).get("world_size")
    if world is None:
        m = pc.get("mapping") or {}
        world = int(m.get("tp_size", 1)) * int(m.get("pp_size", 1))
    ids = [s for s in str(trt_params.get("gpu_device_ids", "")).split(",") if s.strip()]
    if ids and int(world) != len(ids):
        problems.append(Problem(f"{f}: pretrained_config.mapping.world_size", f"is {world} but gpu_device_ids lists {len(ids)} GPU(s) ({','.join(ids)}).",
                                "pack with the plan of this engine (parallel.tp_size x pp_size GPUs).", rule="pack.world_size"))
    kv_type = str(bc.get("kv_cache_type") or ("PAGED" if plug.get("paged_kv_cache", True) else "CONTINUOUS")).upper()
    paged_ctx = plug.get("use_paged_context_fmha")
    for key in ("enable_kv_cache_reuse", "enable_chunked_context"):
        if _truthy(trt_params.get(key)):
            if paged_ctx is not None and not paged_ctx:
                problems.append(Problem(f"{f}: build_config.plugin_config.use_paged_context_fmha",
                                        f"is false but {key} is true; TensorRT-LLM needs paged context FMHA for it.",
                                        f"rebuild with --use_paged_context_fmha enable or set {key}: false.", rule=f"pack.{key}"))
            if kv_type != "PAGED":
                problems.append(Problem(f"{f}: build_config.kv_cache_type", f"is {kv_type} but {key} needs the paged KV cache.",
                                        "rebuild with --kv_cache_type paged.", rule=f"pack.{key}"))
    ldt = pc.get("logits_dtype")
    want = trt_params.get("logits_datatype")
    if ldt and want and _DTYPE_TO_TRITON.get(ldt) != want:
        problems.append(Problem(f"{f}: pretrained_config.logits_dtype", f"is {ldt} but the configs say logits_datatype {want}.",
                                "pack with the engine's logits dtype or rebuild with --logits_dtype.", rule="pack.logits_dtype"))
    checks = [("max_batch_size", "triton_max_batch_size", "triton_max_batch_size exceeds the engine's max_batch_size"),
              ("max_beam_width", "max_beam_width", "max_beam_width exceeds the engine's max_beam_width")]
    for ek, pk, why in checks:
        ev, pv = bc.get(ek), trt_params.get(pk)
        if ev is not None and pv is not None and int(pv) > int(ev):
            problems.append(Problem(f"{f}: build_config.{ek}", f"is {ev} but {pk} is {pv}: {why}.",
                                    "pack with the engine's plan or rebuild the engine.", rule=f"pack.{ek}"))
    return problems


def cross_check_plan(engine_config: dict, plan: ResolvedPlan) -> list[Problem]:
    """Compare the engine's build_config limits with the plan's limits (equal is expected)."""
    bc = engine_config.get("build_config") or {}
    problems = []
    for k, v in plan.limits.model_dump(exclude={"derived"}).items():
        if k not in bc or bc[k] is None:
            continue
        if int(bc[k]) != int(v):
            problems.append(Problem(f"engine/config.json: build_config.{k}", f"is {bc[k]} but plan.json says {v}.",
                                    "rebuild the engine from this plan, or pack with the plan it was built from.", rule="pack.limits"))
    return problems


def unit_limits(repo_dir: Path, unit: str) -> dict[str, int]:
    """max_batch_size / max_beam_width a packed unit's config.pbtxt was rendered with."""
    path = Path(repo_dir) / unit / "config.pbtxt"
    cfg = parse_model_config(path.read_text(), str(path))
    beam = config_params(cfg).get("max_beam_width", "")
    return {"max_batch_size": int(cfg.max_batch_size), **({"max_beam_width": int(beam)} if beam.isdigit() else {})}


def unit_gpus(repo_dir: Path, unit: str) -> int:
    """GPUs a packed unit runs on (the count of its ``gpu_device_ids``; 1 when empty)."""
    path = Path(repo_dir) / unit / "config.pbtxt"
    ids = [s for s in str(config_params(parse_model_config(path.read_text(), str(path))).get("gpu_device_ids", "")).split(",")
           if s.strip()]
    return len(ids) or 1


def _truthy(v: Any) -> bool:
    return v is True or str(v).lower() in ("true", "1", "yes")


def check_engine_dir(engine_dir: Path, trt_params: Mapping[str, Any], plan: ResolvedPlan | None = None) -> None:
    """Raise UserError when the engine's config.json contradicts the rendered parameters or the plan."""
    cfg_path = Path(engine_dir) / "config.json"
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(str(cfg_path), f"cannot read the engine's config.json: {e}.", "rebuild the engine.")
    problems = cross_check_engine(cfg, trt_params) + (cross_check_plan(cfg, plan) if plan else [])
    if problems:
        raise UserError(problems)


# --------------------------------------------------------------------------------------------
# Files


def link_tree(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> None:
    """Recreate ``src`` under ``dst`` with hard links (copies across filesystems). Only inside one build output
    (pack links the build's own engine and checkpoint into its unit); a serving repository never shares an inode
    with a build output (``copy_tree``, ``serving/release.py`` ``install_unit``)."""
    src, dst = Path(src), Path(dst)
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src)
        if rel.parts[0] in skip:
            continue
        q = dst / rel
        if p.is_dir():
            q.mkdir(parents=True, exist_ok=True)
        elif p.is_file():
            q.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(p, q)
            except OSError:
                shutil.copy2(p, q)


def copy_tree(src: Path, dst: Path) -> None:
    """Recreate ``src`` under ``dst`` with copies (``shutil.copyfile``: in-kernel copy where Linux offers it),
    never hard links: an edit of ``src`` afterwards leaves ``dst`` as it was."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.rglob("*")):
        q = dst / p.relative_to(src)
        if p.is_dir():
            q.mkdir(parents=True, exist_ok=True)
        elif p.is_file():
            q.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, q)


def file_digests(folder: Path, exclude: tuple[str, ...] = ()) -> list[tuple[str, int, str]]:
    """[(relative POSIX path, size in bytes, sha256)] of every regular file under ``folder`` (top-level names in
    ``exclude`` skipped), in ``core.store.hash_dir``'s order; each file is read once."""
    folder = Path(folder)
    out = []
    for p in sorted(q for q in folder.rglob("*") if q.is_file()):
        rel = p.relative_to(folder).as_posix()
        if rel.split("/")[0] in exclude:
            continue
        out.append((rel, p.stat().st_size, hash_file(p)))
    return out


def _hash_digests(digests: list[tuple[str, int, str]]) -> str:
    """``core.store.hash_dir`` of a folder from its ``file_digests`` (same value, no second read)."""
    h = hashlib.sha256()
    for rel, _size, sha in digests:
        h.update(rel.encode() + b"\0")
        h.update(sha.encode())
    return h.hexdigest()


def engine_hash_of(plan: ResolvedPlan, checkpoint_dir: Path, engine_dir: Path, engine_built: bool, *,
                   digests: Mapping[str, list] | None = None) -> str:
    """sha256 naming the engine of a unit (engine files when built; checkpoint + the plan's limits,
    effective settings, mapping and profile name otherwise). ``digests``: {"engine": file_digests,
    "checkpoint": file_digests} already computed (else the folders are read)."""
    digests = digests or {}
    if engine_built:
        eng = digests.get("engine")
        return _hash_digests(eng) if eng is not None else hash_dir(engine_dir, exclude=(ENGINE_ARGS_FILE,))
    ck = None
    if Path(checkpoint_dir).is_dir():
        ckd = digests.get("checkpoint")
        ck = _hash_digests(ckd) if ckd is not None else hash_dir(checkpoint_dir)
    return hash_obj({"checkpoint": ck, "limits": plan.limits, "effective": plan.effective,
                     "mapping": plan.mapping, "profile": plan.profile.name})


def precision_path(plan: ResolvedPlan, engine_hash: str, unit: str | None = None) -> dict[str, str]:
    """The precision path one engine unit serves, as strings (metric labels, the ``precision_path`` output and
    the attributes of the BLS's per-request span, all read from this one dict):

    ``model`` (the served model's name), ``profile``, ``unit``, ``engine_hash``, ``gemm`` (checkpoint ``quant_algo``), ``kv`` (generation-phase
    ``kv_cache_quant_algo``), ``context_fmha`` (context-phase attention: ``fp8`` when
    ``use_fp8_context_fmha``, else the model dtype, ``off`` without ``context_fmha``; ``+paged`` with
    ``use_paged_context_fmha``), ``logits_dtype`` (``--logits_dtype``), ``dtype`` (unquantized tensors),
    ``serving_route`` (``engine``; an LLM-API unit's says ``llm_api``, serving/llmapi_unit.py). Values are the plan's *effective* settings (after trtllm-build's own overrides, resolve/rules.py)."""
    q, e = plan.profile.quantization, plan.effective
    fmha = "off" if not e.context_fmha else ("fp8" if e.use_fp8_context_fmha else q.dtype)
    if e.context_fmha and e.use_paged_context_fmha:
        fmha += "+paged"
    return {"model": plan.model.name, "profile": plan.profile.name, "unit": unit or unit_name(engine_hash), "engine_hash": engine_hash,
            "gemm": q.quant_algo.value, "kv": q.kv_cache_quant_algo.value, "context_fmha": fmha,
            "logits_dtype": e.logits_dtype, "dtype": q.dtype, "serving_route": "engine"}


def unit_meta(plan: ResolvedPlan, engine_hash: str, unit: str) -> dict[str, dict]:
    """The JSON files of a unit beside its config: ``PRECISION_PATH_FILE`` (``precision_path``) and, when the profile
    has a ``routing`` section, ``ROUTING_FILE`` (its table; part of the content key: another table, another unit)."""
    return {PRECISION_PATH_FILE: precision_path(plan, engine_hash, unit), **routing_files(plan.profile)}


def routing_files(profile) -> dict[str, dict]:
    """``{ROUTING_FILE: table}`` (spec/routing.py ``routing_table``) when ``profile`` has a ``routing`` section, else
    ``{}``: the unit's routing table, for both unit kinds (engine units here, LLM-API units in
    serving/llmapi_unit.py ``pack_llm_api_unit``); the BLS reads it from whichever unit is the current release."""
    return {} if profile.routing is None else {ROUTING_FILE: routing_table(profile.routing)}


def write_unit(unit_dir: Path, config_text: str, *, engine_dir: Path, engine_built: bool, checkpoint_dir: Path,
               model_dir: Path, plan: ResolvedPlan, engine_hash: str, meta: dict | None = None) -> None:
    """Write one engine unit: config.pbtxt, 1/, engine/ (engine files + CPU reference pointer), and ``meta``
    ({file name: JSON object}, ``unit_meta``: precision_path.json, routing.json). ``plan``'s limits go to the CPU
    stand-in, which applies them per request as the real backend does (hostile s15b F10)."""
    (unit_dir / "1").mkdir(parents=True, exist_ok=True)
    for name, obj in (meta or {}).items():
        (unit_dir / name).write_text(json.dumps(obj, indent=2) + "\n")
    (unit_dir / "1" / ".keep").write_text("Triton version directory; the engine is at gpt_model_path (../engine).\n")
    (unit_dir / "config.pbtxt").write_text(config_text)
    (eng := unit_dir / "engine").mkdir()
    if engine_built:
        link_tree(engine_dir, eng, skip=(ENGINE_ARGS_FILE,))
    has_ck = Path(checkpoint_dir).is_dir()
    if has_ck:
        link_tree(checkpoint_dir, eng / "checkpoint")
    lim = plan.limits
    (eng / CPU_REFERENCE_FILE).write_text(json.dumps({
        "note": "Read only by the CPU reference stand-in backend (triton_repo/backends/tensorrtllm); "
                "the real tensorrtllm backend reads config.json and rank*.engine here.",
        "engine_hash": engine_hash, "engine_present": bool(engine_built), "profile": plan.profile.name,
        "checkpoint_dir": "checkpoint" if has_ck else None, "hf_model_dir": str(Path(model_dir).resolve()),
        "project_root": str(SOURCE_ROOT), "limits": {"max_input_len": lim.max_input_len, "max_seq_len": lim.max_seq_len},
    }, indent=2) + "\n")


def copy_python_models(dst_repo: Path) -> None:
    """Copy preprocessing/postprocessing/BLS model code (1/model.py) into a repository."""
    for m in ("preprocessing", "postprocessing", "tensorrt_llm_bls"):
        src = TEMPLATES_DIR / m / "1"
        (dst_repo / m / "1").mkdir(parents=True, exist_ok=True)
        for p in src.glob("*.py"):
            shutil.copy2(p, dst_repo / m / "1" / p.name)
    (dst_repo / "ensemble" / "1").mkdir(parents=True, exist_ok=True)


def _check_built_engine(engine_dir: Path, trt_params: dict[str, Any], plan: ResolvedPlan, image: str | None) -> list[str]:
    """A built engine against the rendered parameters (``check_engine_dir``), its rank files and ``serving/skew.py``;
    UserError when it does not hold. Returns skew's warnings."""
    from precision_pipeline.serving import skew

    check_engine_dir(engine_dir, trt_params, plan)
    world = int(trt_params["gpu_device_ids"].count(",") + 1)
    missing = [f"rank{i}.engine" for i in range(world) if not (engine_dir / f"rank{i}.engine").is_file()]
    if missing:
        raise UserError("engine", f"{engine_dir} lacks {', '.join(missing)}.", "rebuild the engine.")
    return skew.check_engine(engine_dir, image=image, sm=plan.gpu.sm if plan.gpu else None, world_size=world,
                             limits={"max_batch_size": plan.limits.max_batch_size, "max_seq_len": plan.limits.max_seq_len,
                                     "max_beam_width": plan.limits.max_beam_width})


def _copy_tokenizer(model_dir: Path, tok: Path) -> None:
    """The model's tokenizer files (``TOKENIZER_FILES`` that exist) into ``tok`` (created)."""
    tok.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, tok / name)


def pack_repository(plan: ResolvedPlan, profile, model_dir: Path, checkpoint_dir: Path, engine_dir: Path, engine_built: bool,
                    out_dir: Path, repo_root: str, *, workdir: Path | None = None, image: str | None = None) -> PackResult:
    """Render the model repository for this build into ``out_dir`` (atomic replace).

    ``repo_root``: where the build output (``out_dir``'s parent) will be inside the serving container.
    When the engine was built, its config.json is cross-checked against the rendered parameters and
    ``serving/skew.py`` refuses it unless its provenance verifies and its SM, world size, limits and
    (with ``image``, the serving image) TensorRT-LLM / TensorRT versions match; its warnings go to the notes.
    ``workdir``: write the repository there instead (the stage runner renames it onto ``out_dir``).
    """
    model_dir, checkpoint_dir, engine_dir, out_dir = Path(model_dir), Path(checkpoint_dir), Path(engine_dir), Path(out_dir)
    if not (model_dir / "tokenizer.json").is_file():
        raise UserError("model", f"{model_dir} has no tokenizer.json.", "use an HF model folder with a fast tokenizer.")
    if engine_built and not (engine_dir / "config.json").is_file():
        raise UserError("engine", f"engine_built is true but {engine_dir}/config.json is missing.", "rebuild the engine.")
    if not str(repo_root).startswith("/"):
        raise UserError("--repo-root", f"{repo_root!r} is not an absolute path.", "give the absolute path the output will have in the serving container.")
    # every file of the unit is read once here: the engine hash, the content key and pack.json's unit_files
    digests = {"engine": file_digests(engine_dir, exclude=(ENGINE_ARGS_FILE,)) if engine_built else None,
               "checkpoint": file_digests(checkpoint_dir) if checkpoint_dir.is_dir() else None}
    ehash = engine_hash_of(plan, checkpoint_dir, engine_dir, engine_built, digests=digests)
    params, notes = compute_params(plan, profile, model_dir, ehash, repo_root, out_dir.name, unit=UNIT_PLACEHOLDER)
    texts = render_all(params)
    if engine_built:
        notes += _check_built_engine(engine_dir, params["tensorrt_llm"], plan, image)
    else:
        notes.append("engine absent: configs are rendered, gpt_model_path names where the engine must be placed; "
                     "only the CPU reference backend can serve this repository.")
    has_template = params["preprocessing"]["apply_chat_template"]
    with (contextlib.nullcontext(Path(workdir)) if workdir is not None else atomic_dir(out_dir)) as tmp:
        # the unit is written under a placeholder name first: its content key (over every file) is its name
        staged = tmp / UNIT_PLACEHOLDER
        write_unit(staged, texts["tensorrt_llm"], engine_dir=engine_dir, engine_built=engine_built,
                   checkpoint_dir=checkpoint_dir, model_dir=model_dir, plan=plan, engine_hash=ehash,
                   meta=unit_meta(plan, ehash, UNIT_PLACEHOLDER))
        key = hash_obj(unit_digests(staged, digests))
        unit = unit_name(key)
        params, _ = compute_params(plan, profile, model_dir, ehash, repo_root, out_dir.name, unit=unit)
        texts = render_all(params)
        (staged / "config.pbtxt").write_text(texts["tensorrt_llm"])
        (staged / PRECISION_PATH_FILE).write_text(json.dumps(precision_path(plan, ehash, unit), indent=2) + "\n")
        os.rename(staged, tmp / unit)
        copy_python_models(tmp)
        for m in FIXED_MODELS:
            (tmp / m / "config.pbtxt").write_text(texts[m])
        _copy_tokenizer(model_dir, tmp / "preprocessing" / "tokenizer")
        res = PackResult(out_dir=out_dir, models=sorted([*FIXED_MODELS, unit]), engine_unit=unit, engine_hash=ehash,
                         engine_present=bool(engine_built),
                         params={k: {pk: templates.pbtxt_text(pv) for pk, pv in v.items()} for k, v in params.items()},
                         chat_template_applied_by="preprocessing" if has_template else "client (tokenizer has no chat template)",
                         notes=notes, unit_key=key, unit_files=unit_digests(tmp / unit, digests))
        (tmp / PACK_FILE).write_text(json.dumps(res.to_json(), indent=2, sort_keys=True) + "\n")
        make_readable(tmp)  # a Triton container running as another user reads it (hard-linked 0600 files too)
    return res


def unit_digests(unit_dir: Path, known: Mapping[str, list | None] | None = None) -> dict[str, list]:
    """{path in the unit: [size in bytes, sha256]} of every file of a written unit. ``known``: ``file_digests`` of
    the engine folder (``"engine"``, files under ``engine/``) and the checkpoint (``"checkpoint"``, under
    ``engine/checkpoint/``) that pack linked in, so those large files are not read a second time."""
    unit_dir = Path(unit_dir)
    known = known or {}
    have: dict[str, list] = {}
    for prefix, rows in (("engine/", known.get("engine")), ("engine/checkpoint/", known.get("checkpoint"))):
        for rel, size, sha in rows or ():
            have[prefix + rel] = [size, sha]
    out: dict[str, list] = {}
    for p in sorted(q for q in unit_dir.rglob("*") if q.is_file()):
        rel = p.relative_to(unit_dir).as_posix()
        row = have.get(rel)
        out[rel] = row if row is not None and p.stat().st_size == row[0] else [p.stat().st_size, hash_file(p)]
    return out


def check_repository(repo_dir: Path) -> dict[str, Any]:
    """Parse every config.pbtxt of a repository and check that the ensemble's and BLS's model names exist.

    Returns {model name: parsed ModelConfig}. Raises UserError on the first inconsistency.
    """
    repo_dir = Path(repo_dir)
    cfgs = {}
    for d in sorted(p for p in repo_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        c = d / "config.pbtxt"
        if not c.is_file():
            continue
        cfg = parse_model_config(c.read_text(), f"{d.name}/config.pbtxt")
        if cfg.name != d.name:
            raise UserError(f"{d.name}/config.pbtxt", f"names the model {cfg.name!r}, not its directory {d.name!r}.", "fix the name.")
        cfgs[d.name] = cfg
    problems = []
    if "ensemble" in cfgs:
        for step in cfgs["ensemble"].ensemble_scheduling.step:
            if step.model_name not in cfgs:
                problems.append(Problem("ensemble/config.pbtxt", f"step model {step.model_name!r} is not in the repository.", "restore it."))
    if "tensorrt_llm_bls" in cfgs:
        name = config_params(cfgs["tensorrt_llm_bls"]).get("tensorrt_llm_model_name", "")
        if name not in cfgs:
            problems.append(Problem("tensorrt_llm_bls/config.pbtxt", f"tensorrt_llm_model_name {name!r} is not in the repository.", "restore it."))
    if problems:
        raise UserError(problems)
    return cfgs
