"""The main job: resolve -> quantize -> gate -> engine -> pack -> deploy, as a list of stages and one loop.

``run_build`` is what ``invoke build`` calls. Each stage (``core/stage.py``) declares its typed
inputs, the upstream stages it needs and the code it depends on; ``StageRunner`` alone computes
its content key, reuses an unchanged stage's artifact, writes its folder atomically and records
its row in ``manifest.json``. So a repeated identical build takes seconds, and on a GPU node an
unchanged engine is not built again. Output layout (``artifacts/<profile>/`` by default)::

    plan.json  checkpoint/  gate/  engine/  model_repository/  k8s/  manifest.json  (.stages/: typed artifact records)

Errors: ``UserError`` (exit 2) before any heavy work for bad input or refused checks;
``GateFailed`` (exit 3); ``StrictSkip`` (exit 4) when a stage was skipped under ``strict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from precision_pipeline.core.errors import GateFailed, StrictSkip, UserError
from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.core.stage import Done, Manifest, Stage, StageRecord, StageRunner, execute
from precision_pipeline.core.store import atomic_write_json, clean_stale, locked, read_json
from precision_pipeline.engine.stage import EngineStage
from precision_pipeline.gate.stage import GateStage
from precision_pipeline.quantize.stage import QuantizeStage
from precision_pipeline.resolve.stage import BuildRequest, ResolveStage
from precision_pipeline.serving.stage import DeployStage, PackStage
from precision_pipeline.spec.profile import load_profile

STAGES: tuple[Stage, ...] = (ResolveStage(), QuantizeStage(), GateStage(), EngineStage(), PackStage(), DeployStage())


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
    try:
        cfg = read_json(p / "config.json", {})
    except ValueError as e:
        cfg = f"not valid JSON ({e})"
    if not isinstance(cfg, dict):
        raise UserError("--model", f"{p / 'config.json'} is not a JSON object" + (f": {cfg}" if isinstance(cfg, str) else "") + ".",
                        "give a Hugging Face model folder with a valid config.json.")
    return p.resolve()


def check_checkpoint_dir(checkpoint: str) -> Path:
    """``--checkpoint``: a folder with config.json and rank*.safetensors whose tensors are what it declares."""
    ck = Path(checkpoint).expanduser().resolve()
    if not (ck / "config.json").is_file() or not list(ck.glob("rank*.safetensors")):
        raise UserError("--checkpoint", f"{checkpoint} is not a TensorRT-LLM checkpoint (config.json + rank*.safetensors).",
                        "give a checkpoint directory written by a previous build, or leave --checkpoint out to quantize.")
    from precision_pipeline.checkpoint.reader import check_declared_formats

    check_declared_formats(ck)  # header-level: a broken checkpoint is refused before anything is written
    return ck


def build_request(profile_ref: str, model: str | None = None, out: str | None = None, strict: bool = False,
                  repo_root: str | None = None, golden_limit: int | None = None, checkpoint: str | None = None,
                  image: str | None = None) -> BuildRequest:
    """Load the profile and validate the paths (folders, files, JSON); profile/model rules run in resolve."""
    from precision_pipeline.serving.deploy import DEFAULT_IMAGE

    profile = load_profile(profile_ref)
    model_dir = _model_dir(model)
    out_dir = _validate_out_dir(Path(out) if out else default_out_dir(profile.name or "profile"))
    ck = check_checkpoint_dir(checkpoint) if checkpoint is not None else None
    return BuildRequest(profile=profile, profile_source=str(profile_ref), model_dir=model_dir, out_dir=out_dir,
                        checkpoint=ck, golden_limit=golden_limit, repo_root=repo_root or str(out_dir),
                        image=image or DEFAULT_IMAGE, strict=strict)


def run_build(profile_ref: str, model: str | None = None, out: str | None = None, strict: bool = False,
              repo_root: str | None = None, golden_limit: int | None = None, checkpoint: str | None = None,
              image: str | None = None, on_stage: Callable[[StageRecord], None] | None = None) -> BuildResult:
    """Run the main job for a profile. See the module docstring for stages and errors.

    ``checkpoint`` reuses an existing TensorRT-LLM checkpoint directory instead of quantizing;
    resolve then refuses it unless its mapping and quantization equal the profile's.
    ``golden_limit`` evaluates only the first prompts of each golden category (tests).
    ``on_stage`` is called after each stage (for live printing).
    """
    req = build_request(profile_ref, model, out, strict, repo_root, golden_limit, checkpoint, image)
    resolve, rest = STAGES[0], STAGES[1:]
    resolved = execute(resolve, None, req, {})  # refuses bad input before anything is written
    plan = resolved.artifact.plan
    out_dir = req.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    with locked(out_dir.parent / f".{out_dir.name}.lock"):
        clean_stale(out_dir)
        manifest = Manifest.open(out_dir / "manifest.json", profile=req.profile.name, profile_source=req.profile_source,
                                 model_dir=str(req.model_dir), out_dir=str(out_dir))
        runner = StageRunner(out_dir, manifest, on_stage)
        atomic_write_json(out_dir / "plan.json", plan.to_json())
        done: dict[str, Done] = {resolve.name: runner.record(resolved)}
        for stage in rest:
            d = done[stage.name] = runner.run(stage, plan, req, done)
            if stage.name == "quantize":  # plan.json shows the checkpoint layer by layer
                atomic_write_json(out_dir / "plan.json", plan.to_json(layers=d.artifact.layers))
            if stage.name == "gate" and not d.artifact.passed:
                raise GateFailed(f"accuracy gate failed for {req.profile.name}; see {out_dir / 'gate' / 'report.md'}")
        manifest.finish(engine_present=bool(done["engine"].artifact.built))
    skipped = [r for r in runner.records if r.status == "skipped"]
    if strict and skipped:
        raise StrictSkip("--strict: stage(s) skipped: " + "; ".join(f"{s.name} ({s.reason})" for s in skipped))
    return BuildResult(out_dir, runner.records, manifest.render())
