"""The main job: resolve -> quantize -> gate -> engine -> pack -> deploy, with content-keyed stages.

``run_build`` is what ``invoke build`` calls. Each stage is a function of typed inputs that
writes one artifact directory atomically; its *content key* (sha256 of its inputs, upstream
keys and the stage's own source code) is recorded in ``manifest.json``. A stage whose key is
unchanged and whose artifact is present is not redone, so a repeated identical build takes
seconds. Output layout (``artifacts/<profile>/`` by default)::

    plan.json  checkpoint/  gate/  engine/  model_repository/  k8s/  manifest.json

Errors: ``UserError`` (exit 2) before any heavy work for bad input or refused checks;
``GateFailed`` (exit 3); ``StrictSkip`` (exit 4) when a stage was skipped under ``strict``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from precision_pipeline.core.errors import GateFailed, StrictSkip, UserError
from precision_pipeline.spec.formats import GEMM
from precision_pipeline.spec.profile import load_profile
from precision_pipeline.core.store import atomic_dir, atomic_write_json, clean_stale, hash_dir, hash_file, hash_obj, locked, read_json
from precision_pipeline.core.paths import PACKAGE_DIR, REPO_ROOT



def code_key(*packages: str) -> str:
    """sha256 over the source files of sub-packages (a code change invalidates a stage)."""
    return hash_obj({p: hash_dir(PACKAGE_DIR / p, suffixes=(".py", ".jsonl")) for p in packages})


@dataclass
class StageRecord:
    """One row of the build summary."""

    name: str
    status: str = "pending"  # done | cached | skipped | failed | pending
    seconds: float = 0.0
    reason: str = ""
    key: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"status": self.status, "seconds": round(self.seconds, 3), "reason": self.reason,
                "key": self.key, "numbers": self.numbers}


@dataclass
class BuildResult:
    """What ``run_build`` produced: the stage rows and the output directory."""

    out_dir: Path
    stages: list[StageRecord]
    manifest: dict


def default_out_dir(profile_name: str) -> Path:
    return REPO_ROOT / "artifacts" / profile_name


def _validate_out_dir(out: Path) -> Path:
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError("--out", f"{out} exists and is not a directory.", "give a directory path.")
    if out.is_dir() and any(out.iterdir()) and not (out / "manifest.json").exists() and not (out / "plan.json").exists():
        raise UserError("--out", f"{out} is a non-empty directory that is not a build output.",
                        "give an empty or new directory, or a previous build's output.")
    return out.resolve()


def _model_dir(model: str | None) -> Path:
    if model is None:
        from precision_pipeline.spec.default_model import ensure_default_model

        return ensure_default_model()
    p = Path(model).expanduser()
    need = "give a local folder with config.json, *.safetensors and the tokenizer files."
    if not (p / "config.json").is_file():
        raise UserError("--model", f"{model} is not a Hugging Face model folder (no config.json).", need)
    if not list(p.glob("*.safetensors")):
        raise UserError("--model", f"{model} has no *.safetensors weights (only safetensors are loaded).", need)
    if not ((p / "tokenizer.json").is_file() or (p / "tokenizer.model").is_file()):
        raise UserError("--model", f"{model} has no tokenizer (tokenizer.json or tokenizer.model); calibration "
                        "and the gate encode real text with it.", need)
    return p.resolve()


def run_build(profile_ref: str, model: str | None = None, out: str | None = None, strict: bool = False,
              repo_root: str | None = None, golden_limit: int | None = None, checkpoint: str | None = None,
              image: str | None = None, on_stage: Callable[[StageRecord], None] | None = None) -> BuildResult:
    """Run the main job for a profile. See the module docstring for stages and errors.

    ``checkpoint`` reuses an existing TensorRT-LLM checkpoint directory instead of quantizing;
    resolve then refuses it unless its mapping and quantization equal the profile's.

    ``golden_limit`` evaluates only the first prompts of each golden category (tests).
    ``on_stage`` is called after each stage (for live printing).
    """
    from precision_pipeline.resolve import plan as plan_mod

    profile = load_profile(profile_ref)
    q = profile.quantization
    if q.auto_quantize_bits is not None and not GEMM[q.quant_algo].per_layer:
        raise UserError("quantization.auto_quantize_bits",
                        f"an effective-bits budget is set but quant_algo is {q.quant_algo.value}; the per-layer "
                        "search runs only for quant_algo MIXED_PRECISION.",
                        "set quant_algo: MIXED_PRECISION (with auto_quantize_formats), or remove auto_quantize_bits.")
    model_dir = _model_dir(model)
    try:
        hf_cfg = read_json(model_dir / "config.json", {})
    except ValueError as e:
        hf_cfg = f"not valid JSON ({e})"
    if not isinstance(hf_cfg, dict):
        raise UserError("--model", f"{model_dir / 'config.json'} is not a JSON object"
                        + (f": {hf_cfg}" if isinstance(hf_cfg, str) else "") + ".",
                        "give a Hugging Face model folder with a valid config.json.")
    model_type = hf_cfg.get("model_type")
    if model_type is None:
        raise UserError("--model", f"{model_dir / 'config.json'} has no model_type.",
                        "give a Hugging Face model folder whose config.json names its model_type (e.g. llama).")
    if model_type != "llama":
        raise UserError("--model", f"{model_dir} is a {model_type!r} model; the accuracy gate reads Llama-architecture "
                        "checkpoints only, so the build would stop after quantizing.",
                        "use a Llama-family model; a Mixtral MoE can be quantized and exported with expert "
                        "parallelism by precision_pipeline.quantize.ptq.run_quantize, but not gated yet.")
    out_dir = _validate_out_dir(Path(out) if out else default_out_dir(profile.name or "profile"))
    stages: list[StageRecord] = []

    def emit(rec: StageRecord) -> None:
        stages.append(rec)
        if on_stage:
            on_stage(rec)

    # ---- 1. resolve (fast; refuses bad profiles before anything is written)
    t0 = time.perf_counter()
    reused_ckpt = None
    if checkpoint is not None:
        reused_ckpt = Path(checkpoint).expanduser().resolve()
        if not (reused_ckpt / "config.json").is_file() or not list(reused_ckpt.glob("rank*.safetensors")):
            raise UserError("--checkpoint", f"{checkpoint} is not a TensorRT-LLM checkpoint (config.json + rank*.safetensors).",
                            "give a checkpoint directory written by a previous build, or leave --checkpoint out to quantize.")
        from precision_pipeline.checkpoint.reader import check_declared_formats

        check_declared_formats(reused_ckpt)  # header-level: a broken checkpoint is refused before anything is written
    plan_obj = plan_mod.resolve(profile, model_dir, checkpoint_dir=reused_ckpt)
    plan = plan_obj.to_json()
    rec = StageRecord("resolve", "done", time.perf_counter() - t0, key=hash_obj(plan))
    mem = plan.get("memory", {})
    rec.numbers = {
        "weight_gib_per_gpu": round(float(mem.get("weight_gib_per_gpu", 0.0)), 3),
        "kv_bytes_per_token": mem.get("kv_bytes_per_token"),
        "kv_tokens_capacity": mem.get("kv_tokens_capacity"),
        "warnings": len(plan.get("warnings", [])),
    }

    out_dir.mkdir(parents=True, exist_ok=True)
    with locked(out_dir.parent / f".{out_dir.name}.lock"):
        clean_stale(out_dir)
        manifest = read_json(out_dir / "manifest.json", default={}) or {}
        old_stages = manifest.get("stages", {})
        manifest = {
            "profile": profile.name, "profile_source": str(profile_ref), "model_dir": str(model_dir),
            "out_dir": str(out_dir), "stages": dict(old_stages), "started": time.time(),
        }

        def save(rec: StageRecord) -> None:
            manifest["stages"][rec.name] = rec.to_json()
            atomic_write_json(out_dir / "manifest.json", manifest)

        atomic_write_json(out_dir / "plan.json", plan)
        save(rec)
        emit(rec)

        model_hash = hash_dir(model_dir)

        def cached(name: str, key: str, artifact: Path) -> bool:
            old = old_stages.get(name, {})
            return old.get("key") == key and old.get("status") in ("done", "cached") and artifact.exists()

        # ---- 2. quantize
        from precision_pipeline.quantize import ptq as quant_mod

        qkey = hash_obj({
            "model": model_hash, "quantization": profile.quantization.model_dump(mode="json"),
            "calibration": profile.calibration.model_dump(mode="json"),
            "tp_size": profile.parallel.tp_size, "pp_size": profile.parallel.pp_size,
            "moe": [profile.parallel.moe_tp_size, profile.parallel.moe_ep_size],
            "logits_dtype": profile.build.logits_dtype, "code": code_key("quantize", "spec"),
        })
        ckpt_dir = out_dir / "checkpoint"
        t0 = time.perf_counter()
        if reused_ckpt is not None:
            qkey = hash_obj({"reused": hash_dir(reused_ckpt)})
        if cached("quantize", qkey, ckpt_dir / "config.json"):
            rec = StageRecord("quantize", "cached", 0.0, key=qkey, numbers=old_stages["quantize"].get("numbers", {}))
        else:
            if reused_ckpt is not None:
                import shutil

                with atomic_dir(ckpt_dir) as tmp:
                    shutil.copytree(reused_ckpt, tmp, dirs_exist_ok=True)
                qres = None
            else:
                qres = quant_mod.run_quantize(profile, model_dir, ckpt_dir)
            ck_cfg = json.loads((ckpt_dir / "config.json").read_text())
            qz = ck_cfg.get("quantization", {})
            rec = StageRecord("quantize", "done", time.perf_counter() - t0, key=qkey, numbers={
                "quant_algo": qz.get("quant_algo"), "kv_cache_quant_algo": qz.get("kv_cache_quant_algo"),
                "logits_dtype": ck_cfg.get("logits_dtype"),
                "checkpoint_bytes": sum(p.stat().st_size for p in ckpt_dir.glob("rank*.safetensors")),
                "calibration": getattr(qres, "calibration", None),
            })
            if reused_ckpt is not None:
                rec.reason = f"reused {reused_ckpt}"
            if getattr(GEMM.get(qz.get("quant_algo")), "per_layer", False):
                aq = read_json(ckpt_dir / "autoquant.json", {}) or {}
                rec.numbers["effective_bits"] = aq.get("effective_bits_achieved")
                rec.numbers["per_layer_counts"] = aq.get("counts")
        save(rec)
        emit(rec)
        ckpt_key = qkey
        # the plan, layer by layer: each GEMM's format and bytes as exported (for MIXED_PRECISION,
        # the search's decisions); written into plan.json next to the resolve-time plan
        from precision_pipeline.checkpoint.reader import layer_table

        plan["layers"] = layer_table(ckpt_dir, read_json(ckpt_dir / "autoquant.json", None))
        atomic_write_json(out_dir / "plan.json", plan)

        # ---- 3. gate
        from precision_pipeline.gate import checkpoint_gate as gate_mod

        thresholds = profile.gate.for_model(model_dir.name)
        gkey = hash_obj({"ckpt": ckpt_key, "thresholds": thresholds.model_dump(mode="json"),
                         "golden_limit": golden_limit, "code": code_key("gate", "checkpoint")})
        gate_dir = out_dir / "gate"
        t0 = time.perf_counter()
        if cached("gate", gkey, gate_dir / "metrics.json"):
            rec = StageRecord("gate", "cached", 0.0, key=gkey, numbers=old_stages["gate"].get("numbers", {}))
            passed = read_json(gate_dir / "metrics.json", {}).get("passed", False)
        else:
            gres = gate_mod.gate_checkpoint(ckpt_dir, model_dir, thresholds, gate_dir, golden_limit=golden_limit)
            passed = bool(gres.passed)
            rec = StageRecord("gate", "done" if passed else "failed", time.perf_counter() - t0, key=gkey,
                              numbers=gres.summary())
            if not passed:
                rec.reason = "accuracy gate failed: " + ", ".join(gres.failed_metrics())
        save(rec)
        emit(rec)
        if not passed:
            raise GateFailed(f"accuracy gate failed for {profile.name}; see {gate_dir / 'report.md'}")

        # ---- 4. engine
        from precision_pipeline.engine import trtllm_build as engine_mod

        eng_dir = out_dir / "engine"
        t0 = time.perf_counter()
        eres = engine_mod.run_engine(plan, ckpt_dir, eng_dir)
        ekey = hash_obj({"ckpt": ckpt_key, "argv": eres.argv, "status": eres.status})
        rec = StageRecord("engine", eres.status, time.perf_counter() - t0, reason=eres.reason, key=ekey,
                          numbers={"args": str(eng_dir / engine_mod.ARGS_FILE)})
        save(rec)
        emit(rec)
        engine_built = eres.status == "done"

        # ---- 5. pack
        from precision_pipeline.serving import pack as pack_mod

        root = repo_root or str(out_dir)
        pkey = hash_obj({"plan": plan, "ckpt": ckpt_key, "engine": ekey, "repo_root": root,
                         "profile": profile.model_dump(mode="json"),
                         "templates": hash_dir(REPO_ROOT / "triton_repo"), "code": code_key("serving")})
        repo_dir = out_dir / "model_repository"
        t0 = time.perf_counter()
        if cached("pack", pkey, repo_dir):
            rec = StageRecord("pack", "cached", 0.0, key=pkey, numbers=old_stages["pack"].get("numbers", {}))
        else:
            pres = pack_mod.pack_repository(plan=plan, profile=profile, model_dir=model_dir, checkpoint_dir=ckpt_dir,
                                            engine_dir=eng_dir, engine_built=engine_built, out_dir=repo_dir,
                                            repo_root=root)
            rec = StageRecord("pack", "done", time.perf_counter() - t0, key=pkey, numbers={
                "models": getattr(pres, "models", None), "engine_present": engine_built,
            })
        save(rec)
        emit(rec)

        # ---- 6. deploy (Kubernetes manifests)
        from precision_pipeline.serving import deploy as deploy_mod

        img = image or deploy_mod.DEFAULT_IMAGE
        dkey = hash_obj({**deploy_mod.stage_inputs(plan, profile, root, img), "pack": pkey, "code": code_key("serving")})
        k8s_dir = out_dir / "k8s"
        t0 = time.perf_counter()
        if cached("deploy", dkey, k8s_dir):
            rec = StageRecord("deploy", "cached", 0.0, key=dkey, numbers=old_stages["deploy"].get("numbers", {}))
        else:
            dres = deploy_mod.render_manifests(plan, profile, repo_dir, out_dir, root, img)
            rec = StageRecord("deploy", "done", time.perf_counter() - t0, key=dkey, numbers={
                "manifests": len(dres.files), "gpus_per_replica": dres.gpus_per_replica, "replicas": dres.replicas,
                "launcher": dres.launcher,
            })
        save(rec)
        emit(rec)
        manifest["finished"] = time.time()
        manifest["engine_present"] = engine_built
        atomic_write_json(out_dir / "manifest.json", manifest)

    if strict:
        skipped = [s for s in stages if s.status == "skipped"]
        if skipped:
            raise StrictSkip("--strict: stage(s) skipped: " + "; ".join(f"{s.name} ({s.reason})" for s in skipped))
    return BuildResult(out_dir, stages, manifest)
