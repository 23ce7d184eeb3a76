"""The engine stages alone, for the Kubernetes build Job: ``python3 -m precision_pipeline.engine.job --out OUT [--strict]``.

Reads the build output that ``invoke build`` wrote on the CPU side (``.stages/resolve.json``: the
resolved plan; ``.stages/quantize.json`` and ``.stages/gate.json``: the checkpoint and its verdict,
read as typed records), refuses (exit 2) unless the gate passed, and runs ``JOB_STAGES`` (the engine
route's ``EngineStage`` then ``EngineGateStage``) through the same loop as ``invoke build``
(``core.route``: preflight first, then the ``StageRunner``: cached when unchanged; provenance, failure
handling as in engine/trtllm_build.py; the engine gate as in engine/gate_stage.py). It never
quantizes. Exit codes as everywhere (``core.errors.exit_code_for``): 0, 2 refused, 3 the engine gate
failed, 4 skipped under ``--strict``, 5 trtllm-build failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from precision_pipeline.core.errors import EXIT_INTERNAL, UserError, error_text, exit_code_for
from precision_pipeline.core.route import manifest_facts, prepare, run_stages
from precision_pipeline.core.stage import RECORDS_DIR, Done, Manifest, StageRunner, read_manifest, unfinished_build
from precision_pipeline.engine.gate_stage import EngineGateStage
from precision_pipeline.engine.stage import EngineStage

JOB_STAGES = (EngineStage(), EngineGateStage())
"""What the build Job runs: the engine route's stages that need the build node (``pipeline.ROUTES``)."""


def _record(out: Path, name: str, fix: str = "run `invoke build --profile P --out OUT` on the CPU side first "
            "(quantize + gate), then the Job.") -> dict:
    p = out / RECORDS_DIR / f"{name}.json"
    try:
        rec = json.loads(p.read_text())
    except (OSError, ValueError):
        rec = None
    if not isinstance(rec, dict):
        raise UserError("--out", f"{p} is missing or unreadable: {out} holds no gated build.", fix)
    return rec


def check_gated_output(out: Path, profile: Optional[str] = None, field: str = "--out") -> Path:
    """``out`` resolved, when it holds a CPU-side build whose checkpoint passed its accuracy gate: not a
    filesystem root, a build output (its ``.precision-build.json`` marker), with the resolve, quantize and
    gate records, the gate ``done`` and passed, (``profile`` given) the build of that profile, and its checkpoint the
    files the quantize record's inventory describes (``core.fingerprint.inventory_problem``: truncated, rewritten,
    added or removed after the build is refused, as promote refuses it), and its ``manifest.json`` readable
    (``core.stage.read_manifest``).

    The one rule for both sides of the engine build Job: ``invoke build --on k8s`` checks it before it renders
    (or applies) a Job, and the Job itself (``run_engine_job``) before it builds. Raises UserError (exit 2)
    naming ``field`` otherwise."""
    from precision_pipeline.core.outputs import read_output_marker, refuse_filesystem_root

    out = refuse_filesystem_root(out, field)
    cpu_side = f"run `invoke build --profile {profile or 'P'} --out {out}` on the CPU side first (quantize + gate), then the Job."
    if read_output_marker(out) is None:
        raise UserError(field, f"{out} is not a build output (no .precision-build.json): nothing was built there.", cpu_side)
    rec = {name: _record(out, name, cpu_side) for name in ("resolve", "quantize", "gate")}
    built = ((rec["resolve"].get("artifact") or {}).get("plan") or {}).get("profile", {}).get("name") \
        if isinstance(rec["resolve"].get("artifact"), dict) else None
    if profile is not None and built != profile:
        raise UserError(field, f"{out} holds the build of profile {built!r}, not {profile!r}.",
                        f"give the output of {profile}'s build, or build it there first.")
    g = rec["gate"].get("artifact") if isinstance(rec["gate"].get("artifact"), dict) else {}
    if g.get("status") != "done" or not g.get("passed"):
        raise UserError("gate", f"the checkpoint in {out} did not pass its accuracy gate; no engine is built from it.",
                        "fix the profile and rebuild on the CPU side.")
    from precision_pipeline.core.fingerprint import inventory_problem
    from precision_pipeline.core.stage import VIEW_SUFFIXES
    from precision_pipeline.quantize.stage import QuantizeStage

    ckpt = out / QuantizeStage.output  # the gated checkpoint must still be the files its record vouches for
    files = rec["quantize"].get("files")  # every record a build writes has it (hand-made test outputs may not)
    why = inventory_problem(ckpt, files, VIEW_SUFFIXES) if files is not None else None
    if why is not None:
        raise UserError(field, f"{ckpt} is not the checkpoint its quantize record describes ({why}): the gate's "
                        "verdict is not about these files; no engine is built from it.", cpu_side)
    why = unfinished_build(read_manifest(out / "manifest.json"))  # a damaged one is refused here, not in the pod (s12 F-F)
    if why is not None:  # its records may mix two builds (hostile s15 F5)
        raise UserError(field, f"{out}: {why}; its checkpoint and gate records may not belong to its plan.", cpu_side)
    return out


def run_engine_job(out: Path, strict: bool = False, model_dir: Optional[Path] = None,
                   golden_limit: Optional[int] = None) -> Done:
    """Run ``JOB_STAGES`` (the engine, then the engine gate) for build output ``out`` (see the module docstring).

    ``model_dir``: the reference model folder the engine gate scores against (default: the one the
    CPU build recorded in ``manifest.json``; it must be readable at that path in the pod).
    ``golden_limit``: as ``invoke build --golden-limit``. Returns the engine stage's ``Done``; raises
    ``GateFailed`` (exit 3) when the engine gate fails, ``StrictSkip`` (exit 4) under ``strict`` when
    either stage was skipped, ``UserError`` (exit 2) for a missing model folder or unreadable records."""
    from precision_pipeline.gate.stage import GateStage
    from precision_pipeline.quantize.stage import QuantizeStage
    from precision_pipeline.resolve.stage import BuildRequest, PlanArtifact

    out = check_gated_output(out)
    plan = PlanArtifact.model_validate(_record(out, "resolve")["artifact"]).plan
    old = read_manifest(out / "manifest.json")
    manifest = Manifest.open(out / "manifest.json", keep_finished=True, profile=plan.profile.name, profile_source=old.get("profile_source", ""),
                             model_dir=old.get("model_dir", ""), out_dir=str(out))
    model = Path(model_dir) if model_dir is not None else (Path(old["model_dir"]) if old.get("model_dir") else None)
    if model is None or not (model / "config.json").is_file():
        raise UserError("--model", f"the engine gate's reference model {model or '(none recorded)'} is not readable here.",
                        "mount the model folder the CPU build used at the same path in the pod, or pass --model DIR.")
    runner = StageRunner(out, manifest)
    upstream = {}
    for stage in (QuantizeStage(), GateStage()):
        d = runner.recorded(stage)
        if d is None:
            raise UserError("--out", f"{out / RECORDS_DIR / (stage.name + '.json')} is not a valid {stage.name} record.",
                            "run `invoke build` on the CPU side again (it rewrites the records), then the Job.")
        upstream[stage.name] = d
    req = BuildRequest(profile=plan.profile, profile_source=str(old.get("profile_source", "")), model_dir=model,
                       out_dir=out, golden_limit=golden_limit, repo_root=str(out), strict=strict)
    prepare(JOB_STAGES, req, plan)
    done = run_stages(JOB_STAGES, plan, req, runner, upstream, plan.profile.name,
                      finish=lambda d: manifest.finish(**{**manifest.facts, **manifest_facts(d)}))
    return done[JOB_STAGES[0].name]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m precision_pipeline.engine.job", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--strict", action="store_true")
    ap.add_argument("--model", type=Path, default=None, help="reference model folder (default: the CPU build's)")
    ap.add_argument("--golden-limit", type=int, default=None)
    a = ap.parse_args(argv)
    try:
        d = run_engine_job(a.out, a.strict, a.model, a.golden_limit)
    except BaseException as e:  # the one mapping (core.errors.exit_code_for); only an internal error has a traceback
        code = exit_code_for(e)
        if code == EXIT_INTERNAL or isinstance(e, SystemExit):
            raise
        print(f"error: {error_text(e)}", file=sys.stderr)
        return code
    print(f"engine: {d.record.status}" + (f" ({d.record.reason})" if d.record.reason else ""))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
