"""The main job: resolve -> quantize -> verify -> gate -> engine -> pack -> deploy, as a list of stages and one loop.

``run_build`` is what ``invoke build`` calls. Each stage (``core/stage.py``) declares its typed
inputs, the upstream stages it needs and the code it depends on; ``StageRunner`` alone computes
its content key, reuses an unchanged stage's artifact, writes its folder atomically and records
its row in ``manifest.json``. So a repeated identical build takes seconds, and on a GPU node an
unchanged engine is not built again. Output layout (``artifacts/<profile>/`` by default)::

    plan.json  checkpoint/  gate/  engine/  model_repository/  k8s/  manifest.json  (.stages/: typed artifact records)
    .precision-build.json  (the marker: this folder is a build output)  .build.lock (+ .build.lock.json: its holder)

Whose folder: a build writes only into a new or empty ``--out``, or into one holding the marker
``.precision-build.json`` (``{"format": "precision-pipeline-build", "version": 1}``) that a build
wrote. Any other non-empty folder is refused (exit 2), whatever files it holds (a
``manifest.json`` or ``plan.json`` of a web project is not ours). An output of a pipeline version
from before the marker (``manifest.json`` with ``stages`` and ``.stages/``) is refused too, with
the fix to delete it or pick a new ``--out``: it cannot be told apart from a user's folder safely.

Order: every input is checked before the first write (profile, ``--model``, ``--out``,
``--checkpoint`` down to each tensor's byte range, ``--golden-limit``, ``--repo-root``,
``--image``, the resolve rules including ``calibration.dataset``, and the dataset's token lengths).
Then the output is created and locked (``.build.lock`` inside it, plus an ``flock`` on the output
folder itself, so deleting ``.build.lock`` lets no second build in; a writable ``--out`` in a
read-only parent works; a second build of the same output waits and says who holds it, or with
``wait=False`` / ``--no-wait`` is refused at once), interrupted stage swaps are rolled forward
(``core.store.clean_stale``), and the stages run. ``plan.json`` is written after each stage that
ran and at the end, so a kill during a stage leaves the previous build's plan.json with the
previous artifacts.

Errors: ``UserError`` (exit 2) before any write for bad input or refused checks;
``GateFailed`` (exit 3); ``StrictSkip`` (exit 4) when a stage was skipped under ``strict``.
"""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from precision_pipeline.checkpoint.stage import VerifyStage
from precision_pipeline.core.errors import GateFailed, StrictSkip, UserError
from precision_pipeline.core.outputs import OUTPUT_FORMAT, OUTPUT_MARKER, OUTPUT_VERSION, read_output_marker, refuse_filesystem_root  # noqa: F401
from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.core.stage import Done, Manifest, Stage, StageRecord, StageRunner, execute
from precision_pipeline.core.store import atomic_write_json, clean_stale, locked, read_json, read_json_safe
from precision_pipeline.engine.stage import EngineStage
from precision_pipeline.engine.gate_stage import EngineGateStage
from precision_pipeline.gate.stage import GateStage
from precision_pipeline.quantize.stage import QuantizeStage
from precision_pipeline.resolve.stage import BuildRequest, ResolveStage
from precision_pipeline.serving.stage import DeployStage, PackStage
from precision_pipeline.spec.profile import load_profile

STAGES: tuple[Stage, ...] = (ResolveStage(), QuantizeStage(), VerifyStage(), GateStage(), EngineStage(), EngineGateStage(),
                              PackStage(), DeployStage())
"""``verify`` (checkpoint/verify.py) reads the exported checkpoint's headers and scale tensors and refuses
(exit 2) a checkpoint that does not match its formats' layouts, its metadata or the plan, before the gate."""


@dataclass
class BuildResult:
    """What ``run_build`` produced: the stage rows and the output directory."""

    out_dir: Path
    stages: list[StageRecord]
    manifest: dict


def default_out_dir(profile_name: str) -> Path:
    return REPO_ROOT / "artifacts" / profile_name


LOCK_FILE = ".build.lock"
"""The build lock, inside the output; its sidecar ``.build.lock.json`` names the holder (core.store.locked)."""
_OWN_FILES = (OUTPUT_MARKER, LOCK_FILE, LOCK_FILE + ".json")


def stage_folders() -> tuple[str, ...]:
    """The folders the stages write under the output (their interrupted swaps are recovered)."""
    from precision_pipeline.core.stage import RECORDS_DIR

    return tuple(s.output for s in STAGES if s.output) + (RECORDS_DIR,)


def write_output_marker(out: Path, profile: str = "") -> None:
    """Mark ``out`` as a build output (``.precision-build.json``)."""
    atomic_write_json(Path(out) / OUTPUT_MARKER, {"format": OUTPUT_FORMAT, "version": OUTPUT_VERSION,
                                                  "created": time.time(), "profile": profile})


def _looks_like_old_output(out: Path) -> bool:
    m = read_json_safe(out / "manifest.json")
    return isinstance(m, dict) and isinstance(m.get("stages"), dict) and "profile" in m and (
        (out / ".stages").is_dir() or any((out / f).is_dir() for f in stage_folders()))


def _validate_out_dir(out: Path) -> Path:
    """``--out``: new, empty, or a build output (its marker). Raises UserError otherwise (nothing written)."""
    out = Path(out).expanduser()
    field = "--out"
    try:
        refuse_filesystem_root(out, field)
        exists, is_dir = out.exists(), out.is_dir()
    except (OSError, ValueError) as e:
        raise UserError(field, f"{str(out)[:200]!r} cannot be used ({type(e).__name__}).", "give a directory path.")
    if exists and not is_dir:
        raise UserError(field, f"{out} exists and is not a directory.", "give a directory path.")
    if not exists:
        anc = out.parent
        while not anc.exists() and anc != anc.parent:
            anc = anc.parent
        if not anc.is_dir() or not os.access(anc, os.W_OK | os.X_OK):
            raise UserError(field, f"{out} does not exist and {anc} is not writable, so it cannot be created.",
                            "create the folder (writable) first, or give a path in a writable place.")
        return out.resolve()
    try:
        entries = [p.name for p in out.iterdir() if p.name not in _OWN_FILES]
    except OSError as e:
        raise UserError(field, f"{out} cannot be listed ({type(e).__name__}).", "give a readable, writable directory.")
    if not os.access(out, os.W_OK | os.X_OK):
        raise UserError(field, f"{out} is not writable.", "give a writable directory.")
    marker = read_json_safe(out / OUTPUT_MARKER)
    if isinstance(marker, dict) and marker.get("format") == OUTPUT_FORMAT:
        v = marker.get("version")
        if not isinstance(v, int) or isinstance(v, bool) or v > OUTPUT_VERSION:
            raise UserError(field, f"{out} is a build output of format version {v!r}; this pipeline writes version "
                            f"{OUTPUT_VERSION}.", "use the pipeline version that wrote it, or give a new --out.")
        return out.resolve()
    if not entries:
        return out.resolve()
    shown = ", ".join(sorted(entries)[:5]) + (f" (+{len(entries) - 5} more)" if len(entries) > 5 else "")
    if _looks_like_old_output(out):
        raise UserError(field, f"{out} looks like the output of a build from before output folders were marked "
                        f"({OUTPUT_MARKER} is missing), and this pipeline does not take over unmarked folders: "
                        "it cannot tell them from a folder of yours.",
                        f"delete it yourself (rm -r {out}) and build again, or give a new --out.")
    raise UserError(field, f"{out} is not empty ({shown}) and is not a build output (no {OUTPUT_MARKER}); "
                    "a build replaces its stage folders, so its files would be lost.",
                    "give a new or empty directory, or a previous build's output folder.")


SERVING_PATH_RE = re.compile(r"^[A-Za-z0-9/._+@:,=~-]+$")
"""Characters a build output (and ``--repo-root``) may have in its path. The packed Triton repository names
its files by this path (``gpt_model_path``, ``tokenizer_dir``, the Python models' folders), and Triton's
Python backend starts each stub as ``execvp("bash", {"bash", "-c", " exec <stub> <model_path> ..."})`` with the
paths joined by spaces, unquoted (triton-inference-server/python_backend ``src/stub_launcher.cc``,
``StubLauncher::Launch``), so a space splits the model path and the stub never starts: ``serve`` waits for
ever. Shell characters break the same command line; non-ASCII names are refused as well (a traceback before)."""


def serving_path_problem(path: str) -> str | None:
    """Why ``path`` cannot hold a servable build (``SERVING_PATH_RE``), naming the first bad character; None if fine."""
    if SERVING_PATH_RE.match(path):
        return None
    bad = next((c for c in path if not SERVING_PATH_RE.match(c)), " ")
    what = ("a space" if bad == " " else "whitespace" if bad.isspace() else
            f"the non-ASCII character {bad!r} (U+{ord(bad):04X})" if not bad.isascii() else f"the character {bad!r}")
    return (f"{path[:200]!r} contains {what}. Triton's Python backend starts its stubs through a shell command "
            "line with the model paths unquoted, so the served repository would never become ready")


def _check_serving_path(path: Path | str, field: str) -> None:
    why = serving_path_problem(str(path))
    if why:
        raise UserError(field, why + ".", "build into a path of ASCII letters, digits and / . _ - + @ : , = ~ "
                        "(e.g. --out artifacts/my-build), or move the checkout to such a path.")


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
    from precision_pipeline.checkpoint.reader import check_declared_formats, safetensors_header

    for f in sorted(ck.glob("rank*.safetensors")):
        safetensors_header(f, field="--checkpoint")  # every tensor's byte range within the file, before any copy
    check_declared_formats(ck)  # header-level: a broken checkpoint is refused before anything is written
    from precision_pipeline.checkpoint.verify import verify_checkpoint

    verify_checkpoint(ck)  # layouts, scales, metadata (the verify stage repeats it against the plan after the copy)
    return ck


def load_build_profile(profile_ref: str):
    """``load_profile`` plus what depends on where the profile file is: a relative
    ``calibration.dataset`` becomes absolute against the profile file's folder (``invoke build``
    and ``invoke check`` both load profiles through this). Refuses a ``gate.min_prompts`` above the golden set
    (``gate.verdict.check_min_prompts``)."""
    from precision_pipeline.gate.verdict import check_min_prompts
    from precision_pipeline.resolve.dataset import with_dataset_resolved
    from precision_pipeline.spec.profile import resolve_profile_path

    profile = load_profile(profile_ref)
    check_min_prompts(profile)
    return with_dataset_resolved(profile, resolve_profile_path(profile_ref))


def check_golden_limit(golden_limit) -> None:
    """``--golden-limit``: None or a whole number >= 1 (prompts per golden category). UserError if not."""
    if golden_limit is None:
        return
    if isinstance(golden_limit, bool) or not isinstance(golden_limit, int) or golden_limit < 1:
        raise UserError("--golden-limit", f"{str(golden_limit)[:40]!r} is not a whole number >= 1.",
                        "pass e.g. --golden-limit 1, or leave it out for every golden prompt.")


def choose_device(device: str = "auto", reference_dtype: str = "float32"):
    """``--device`` / ``--reference-dtype`` on this machine (``spec.device``: probe, then select).
    UserError for an unknown value or ``cuda`` without a usable GPU."""
    from precision_pipeline.spec.device import probe_machine, select_device

    # a bad value is refused before torch is asked: checked against this machine's host side with the values that
    # need no GPU (``cuda`` itself is judged on the real probe below, so its refusal names what is missing)
    select_device("cpu" if str(device).strip().lower() == "cuda" else device, probe_machine("cpu"), reference_dtype)
    return select_device(device, probe_machine(device), reference_dtype)


def build_request(profile_ref: str, model: str | None = None, out: str | None = None, strict: bool = False,
                  repo_root: str | None = None, golden_limit: int | None = None, checkpoint: str | None = None,
                  image: str | None = None, device: str = "auto", reference_dtype: str = "float32") -> BuildRequest:
    """Load the profile and validate every path and option (folders, files, JSON, tensor byte ranges,
    limits, image, ``--device``); profile/model rules (and the build's memory on the chosen device)
    run in resolve. Writes nothing; raises UserError."""
    from precision_pipeline.serving.deploy import DEFAULT_IMAGE, check_image, check_repo_root

    profile = load_build_profile(profile_ref)
    model_dir = _model_dir(model)
    out_dir = Path(out).expanduser() if out else default_out_dir(profile.name or "profile")
    _check_serving_path(out_dir.absolute(), "--out")  # before any filesystem call on it (non-ASCII names included)
    out_dir = _validate_out_dir(out_dir)
    _check_serving_path(out_dir, "--out")  # the resolved path (a symlink may lead elsewhere)
    ck = check_checkpoint_dir(checkpoint) if checkpoint is not None else None
    check_golden_limit(golden_limit)
    if repo_root is not None:
        check_repo_root(repo_root)
        _check_serving_path(repo_root, "--repo-root")
    if image is not None:
        check_image(image, "--image")
    choice = choose_device(device, reference_dtype)
    return BuildRequest(profile=profile, profile_source=str(profile_ref), model_dir=model_dir, out_dir=out_dir,
                        checkpoint=ck, golden_limit=golden_limit, repo_root=repo_root or str(out_dir),
                        image=image or DEFAULT_IMAGE, strict=strict, device=choice)


def check_dataset_tokens(calibration, model_dir: Path, say: Callable[[str], None] | None = None) -> None:
    """The calibration checks that need the tokenizer (texts longer than ``calibration.seq_len`` tokens, with
    their token counts), on the lines a build reads; ``invoke build`` (before any write) and ``invoke check``
    run it. Nothing for ``builtin``. ``say``: progress lines while reading/tokenizing. Raises UserError."""
    from precision_pipeline.resolve.dataset import BUILTIN

    if calibration.dataset == BUILTIN:
        return
    from precision_pipeline.quantize.calibration import build_calibration_set, load_tokenizer

    build_calibration_set(calibration, load_tokenizer(model_dir), say=say or _say)


def _check_dataset_tokens(req: BuildRequest, plan) -> None:
    if req.checkpoint is None:
        check_dataset_tokens(plan.profile.calibration, req.model_dir)


def _preflight_build_node(plan, strict: bool) -> None:
    """On a build node (a toolchain is there), the engine preflight before quantize: refusals cost no GPU time."""
    from precision_pipeline.engine.preflight import plan_need_bytes, preflight
    from precision_pipeline.engine.toolchain import detect_toolchain
    from precision_pipeline.engine.trtllm_build import build_args

    tc = detect_toolchain()
    if tc.present() and plan.gpu is not None:
        preflight(tc, sm=plan.gpu.sm, gpu_name=plan.gpu.name, need_bytes=plan_need_bytes(plan),
                  argv=build_args(plan, Path("checkpoint"), Path("engine")), strict=strict)


def output_lock(out_dir: Path, what: str, wait: bool = True, on_wait: Callable[[str], None] | None = None):
    """The build lock of output ``out_dir`` (a context manager): ``.build.lock`` (its sidecar names the holder)
    plus an ``flock`` on ``out_dir`` itself (``core.store.locked(folder_lock=True)``), so deleting
    ``.build.lock`` during a build lets no second build in. ``wait``: False refuses at once (UserError on
    ``--out`` naming the holder)."""
    return locked(Path(out_dir) / LOCK_FILE, timeout_s=None if wait else 0, what=what, field="--out",
                  on_wait=on_wait or _say, folder_lock=True,
                  busy_fix="wait for that build to finish (leave out --no-wait to wait for it), or give another --out.")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _written(records: list[StageRecord], plan_written: bool, out_dir: Path) -> tuple[str, ...]:
    """What this build has written so far, relative to ``out_dir``: ``plan.json`` (when a stage ran),
    ``manifest.json``, the folder of each stage that ran (not cached) and the stage records."""
    by_name = {s.name: s for s in STAGES}
    ran = [r.name for r in records if r.status != "cached"]
    folders = [by_name[n].output + "/" for n in ran if n in by_name and by_name[n].output
               and (out_dir / by_name[n].output).exists()]
    from precision_pipeline.core.stage import RECORDS_DIR

    return tuple((["plan.json"] if plan_written else []) + ["manifest.json"] + folders + [RECORDS_DIR + "/"])


def run_build(profile_ref: str, model: str | None = None, out: str | None = None, strict: bool = False,
              repo_root: str | None = None, golden_limit: int | None = None, checkpoint: str | None = None,
              image: str | None = None, on_stage: Callable[[StageRecord], None] | None = None, wait: bool = True,
              on_wait: Callable[[str], None] | None = None, device: str = "auto",
              reference_dtype: str = "float32") -> BuildResult:
    """Run the main job for a profile. See the module docstring for stages, order and errors.

    ``checkpoint`` reuses an existing TensorRT-LLM checkpoint directory instead of quantizing;
    resolve then refuses it unless its mapping and quantization equal the profile's.
    ``golden_limit`` evaluates only the first prompts of each golden category (tests).
    ``on_stage`` is called after each stage (for live printing).
    ``wait``: when another build holds the output's lock, wait for it (``on_wait(message)`` every
    few seconds, default: printed to stderr); False: refuse at once (UserError on ``--out`` naming
    the holder's pid, host and start time).
    ``device``: ``auto`` | ``cpu`` | ``cuda`` (``spec.device``; the choice and why are printed and go
    into plan.json ``build_memory`` and the manifest's resolve row); ``reference_dtype``: the gate's
    reference, ``float32`` or ``bfloat16`` (when FP32 does not fit; the report says which).
    """
    req = build_request(profile_ref, model, out, strict, repo_root, golden_limit, checkpoint, image, device,
                        reference_dtype)
    _say(f"[device] {req.device.short()}: {req.device.reason}")
    resolve, rest = STAGES[0], STAGES[1:]
    resolved = execute(resolve, None, req, {})  # refuses bad input before anything is written
    plan = resolved.artifact.plan
    _check_dataset_tokens(req, plan)
    _preflight_build_node(plan, req.strict)
    out_dir = req.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)  # the first write: every input was checked above
    with output_lock(out_dir, f"build of {req.profile.name}", wait, on_wait or _say):
        _validate_out_dir(out_dir)  # again, under the lock
        if read_output_marker(out_dir) is None:
            write_output_marker(out_dir, req.profile.name)
        clean_stale(out_dir, names=stage_folders())
        manifest = Manifest.open(out_dir / "manifest.json", profile=req.profile.name, profile_source=req.profile_source,
                                 model_dir=str(req.model_dir), out_dir=str(out_dir))
        runner = StageRunner(out_dir, manifest, on_stage)
        done: dict[str, Done] = {resolve.name: runner.record(resolved)}
        # the plan's typed record, for the engine build Job (engine/job.py); resolve itself always runs
        from precision_pipeline.core.stage import RECORDS_DIR

        atomic_write_json(out_dir / RECORDS_DIR / f"{resolve.name}.json",
                          {"stage": resolve.name, "key": resolved.key, "artifact": resolved.artifact.model_dump(mode="json")})
        layers = None

        def write_plan() -> None:  # the plan goes with the stages it describes (plan.json shows the checkpoint)
            atomic_write_json(out_dir / "plan.json", plan.to_json(layers=layers))

        plan_written = False
        for stage in rest:
            try:
                d = done[stage.name] = runner.run(stage, plan, req, done)
            except UserError as e:  # refused after writes: say what was written (tasks.py prints it)
                e.stage = stage.name
                e.written = _written(runner.records, plan_written, out_dir)
                raise
            if stage.name == "quantize":
                layers = d.artifact.layers
            if d.record.status != "cached":
                write_plan()
                plan_written = True
            if stage.name == "gate" and not d.artifact.passed:
                raise GateFailed(f"accuracy gate failed for {req.profile.name} ({', '.join(d.artifact.failed_metrics)}); "
                                 f"see {out_dir / 'gate' / 'report.md'}")
            if stage.name == "engine_gate" and d.artifact.status == "failed":
                raise GateFailed(f"engine gate failed for {req.profile.name} ({', '.join(d.artifact.failed_metrics)}); "
                                 f"the engine is not packed; see {out_dir / 'engine_gate' / 'report.md'}")
        write_plan()
        manifest.finish(engine_present=bool(done["engine"].artifact.built))
    skipped = [r for r in runner.records if r.status == "skipped"]
    if strict and skipped:
        raise StrictSkip("--strict: stage(s) skipped: " + "; ".join(f"{s.name} ({s.reason})" for s in skipped))
    return BuildResult(out_dir, runner.records, manifest.render())
