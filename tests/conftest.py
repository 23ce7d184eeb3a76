"""Shared fixtures. Heavy fixtures are session-scoped and small (few calibration samples)."""

from __future__ import annotations

import atexit
import gc
import os
from pathlib import Path

import pytest

atexit.register(gc.freeze)  # a test process's exit without walking every object torch made (as tasks.py does)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent


def _threads_per_xdist_worker() -> None:
    """Under pytest-xdist (``invoke test`` runs ``-n 2``): each worker's torch/OpenMP threads = the cores this process
    may use / the number of workers (at least 1), so that the workers do not oversubscribe the cores (more threads
    than free cores makes torch CPU inference several times slower: ``gate.threads.thread_choice``). Set before
    torch is imported (it reads ``OMP_NUM_THREADS`` at start); subprocesses (a build, a server) inherit it. The
    gate still picks its own count per run (``gate.threads.auto_threads``: the cores other processes leave free)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1 and os.environ.get("PYTEST_XDIST_WORKER"):
        per = str(max(1, len(os.sched_getaffinity(0)) // workers))
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ.setdefault(key, per)


_threads_per_xdist_worker()


def pytest_configure(config):
    """A pytest that is not an xdist worker (one started by a test inside a worker, e.g. ``invoke mutate``'s runs in
    tests/test_mutate.py) inherits the worker's ``PYTEST_XDIST_WORKER``: removed here, so that ``once_per_run`` and
    the file order below see a plain run."""
    if not hasattr(config, "workerinput"):
        os.environ.pop("PYTEST_XDIST_WORKER", None)
        os.environ.pop("PYTEST_XDIST_WORKER_COUNT", None)


def once_per_run(tmp_path_factory, name: str, make) -> Path:
    """``make(folder)`` run once per test run and its ``folder`` shared: a session fixture that builds outputs
    (a gate run, packed units) is set up once per process, so under pytest-xdist each worker that needs it would
    build it again. The first worker builds it under a file lock (``core.store.locked``) in the run's shared
    temporary folder (the parent of the workers' base temps); the others wait for it and read it. Without xdist,
    the session's base temp. ``make`` must fill ``folder`` completely (it is marked done only after it returns);
    readers must not write into it. Returns ``folder``."""
    from precision_pipeline.core.store import locked

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # pytest-N/ holds popen-gw0, popen-gw1, ...: one per run, shared by its workers
    folder = root / f"once-{name}"
    with locked(root / f".once-{name}.lock", timeout_s=3600):
        if not (root / f".once-{name}.done").is_file():
            import shutil

            shutil.rmtree(folder, ignore_errors=True)  # a worker that failed while building left it half made
            folder.mkdir(parents=True)
            make(folder)
            (root / f".once-{name}.done").write_text("ok\n")
    return folder


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct HF folder (made by the set-up script)."""
    from precision_pipeline.spec.default_model import ensure_default_model

    return ensure_default_model()


# --------------------------------------------------------------------------------------------
# Exported TensorRT-LLM checkpoints of the default model (build/precision_pipeline/quantize/ptq.py), tiny calibration.
#
# Each fixture returns the Path of a checkpoint folder (config.json + rank*.safetensors). They
# are built lazily (only when a test asks) and cached under <cache>/test-checkpoints/<name>-<key>,
# where key hashes the profile, the sources of build/precision_pipeline/quantize/ptq.py + build/precision_pipeline/quantize/calibration.py, the
# ModelOpt/transformers/torch versions and the model's content fingerprint: a code or model change rebuilds them.
# PRECISION_TEST_CKPT_CACHE=0 builds into pytest's tmp dir instead (every session).
# Next to each checkpoint, modelopt.pt holds ModelOpt's state (mto.modelopt_state + quantizer
# buffers) so a test can rebuild ModelOpt's own fake-quant model (restore_modelopt_model).

_TINY = {"calibration": {"num_samples": 8, "seq_len": 64}}
_TINY_SLOW = {"calibration": {"num_samples": 4, "seq_len": 32}}
CHECKPOINT_SPECS: dict[str, tuple[str, dict]] = {
    # name: (shipped profile, overrides merged over it)
    "fp8": ("fp8-h100", _TINY),
    "bf16": ("bf16-h100", {}),
    "int4_awq": ("int4-awq-a100", _TINY_SLOW),
    "int8_sq": ("int8-sq-l4", _TINY_SLOW),
    "nvfp4": ("nvfp4-b200", _TINY_SLOW),
    "w8a16": ("int8-sq-l4", {**_TINY_SLOW, "quantization": {"quant_algo": "W8A16"}}),
    # every spec is a valid profile: the quantize stage refuses through the resolve rules
    "w4a8_awq": ("int4-awq-a100", {**_TINY_SLOW, "quantization": {"quant_algo": "W4A8_AWQ", "kv_cache_quant_algo": "FP8"},
                                   "target": {"gpu": "h100-sxm"}}),
    "fp8_tp3": ("fp8-h100", {**_TINY, "parallel": {"tp_size": 3},
                             "deployment": {"gpus_per_replica": 3, "fallback": None, "warm_fallback": False}}),
}


def quantize_job(profile, model_dir: Path | None = None):
    """The quantize job (``quantize.job.QuantizeJob``) of ``profile`` for the model in ``model_dir`` (default: the
    default model), made as a build makes it: the resolve rules' refusals as one UserError, else ``job_of(plan)``."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.quantize.job import job_of
    from precision_pipeline.resolve.plan import evaluate
    from precision_pipeline.spec.default_model import ensure_default_model

    plan = evaluate(profile, Path(model_dir) if model_dir is not None else ensure_default_model())
    if plan.problems:
        raise UserError(list(plan.problems))
    return job_of(plan)


def checkpoint_profile(name: str):
    """The validated Profile a test checkpoint is built from."""
    from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile

    base, over = CHECKPOINT_SPECS[name]
    return validate_profile(deep_merge(load_raw(base), over))


def _checkpoint_key(name: str, model_dir: Path) -> str:
    import importlib.metadata as md

    from precision_pipeline.core.fingerprint import model_fingerprint
    from precision_pipeline.core.store import hash_dir, hash_obj

    parts = {
        "profile": checkpoint_profile(name).model_dump(mode="json"),
        "src": hash_dir(REPO_ROOT / "build" / "precision_pipeline" / "quantize", suffixes=(".py",)),
        "versions": [md.version(p) for p in ("nvidia-modelopt", "transformers", "torch")],
        "model": model_fingerprint(model_dir).sha256,
    }
    return hash_obj(parts)[:16]


def build_test_checkpoint(name: str, model_dir: Path, root: Path) -> Path:
    """Build (or reuse) the test checkpoint ``name`` under ``root``; returns the checkpoint folder."""
    import torch

    from precision_pipeline.core.progress import StageProgress
    from precision_pipeline.quantize.ptq import QUANTIZE_LOG, QUANTIZE_WARNINGS, captured_warnings, export_checkpoint, quantize_model
    from precision_pipeline.core.store import atomic_dir, locked

    folder = Path(root) / f"{name}-{_checkpoint_key(name, model_dir)}"
    ckpt = folder / "ckpt"
    with locked(Path(root) / f".{name}.lock", timeout_s=3600):
        if (folder / "done").is_file():
            return ckpt
        with atomic_dir(folder) as tmp:
            # ModelOpt's warnings recorded into the checkpoint as run_quantize does (quantize_warnings.json)
            with captured_warnings(tmp / QUANTIZE_LOG, StageProgress("quantize", enabled=False),
                                   record_path=tmp / "ckpt" / QUANTIZE_WARNINGS):
                qm = quantize_model(quantize_job(checkpoint_profile(name), model_dir), model_dir, show_progress=False)
                result = export_checkpoint(qm, tmp / "ckpt")
            if qm.config is not None:
                import modelopt.torch.opt as mto

                qsd = {k: v for k, v in qm.model.state_dict().items() if "quantizer" in k}
                torch.save({"modelopt_state": mto.modelopt_state(qm.model), "quantizer_state_dict": qsd},
                           tmp / "modelopt.pt")
            (tmp / "result.json").write_text(__import__("json").dumps(result.to_dict(), indent=1, default=str))
            (tmp / "done").write_text("ok\n")
    return ckpt


def restore_modelopt_model(ckpt: Path, model_dir: Path):
    """ModelOpt's own fake-quant model (FP32) for a test checkpoint built by build_test_checkpoint.

    Only the quantizer state is stored, so this is valid for algorithms that leave the weights
    untouched ("max" calibration: FP8, W8A16, NVFP4). SmoothQuant and AWQ rescale the weights in
    place: refused (ValueError) rather than returning a wrong model.
    """
    import json

    import modelopt.torch.opt as mto
    import torch
    from transformers import AutoModelForCausalLM

    name = json.loads((Path(ckpt).parent / "result.json").read_text())["modelopt_config_name"]
    if name.startswith(("INT8_SMOOTHQUANT", "INT4_AWQ", "W4A8_AWQ")):
        raise ValueError(f"{name} rescales weights; restore_modelopt_model keeps only quantizer state")

    blob = torch.load(Path(ckpt).parent / "modelopt.pt", weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = mto.restore_from_modelopt_state(model, blob["modelopt_state"])
    model.load_state_dict(blob["quantizer_state_dict"], strict=False)
    return model


@pytest.fixture(scope="session")
def checkpoint_cache_root(tmp_path_factory) -> Path:
    if os.environ.get("PRECISION_TEST_CKPT_CACHE", "1") == "0":
        return tmp_path_factory.mktemp("test-checkpoints")
    from precision_pipeline.spec.default_model import cache_dir

    return cache_dir() / "test-checkpoints"


def _ckpt_fixture(name: str):
    @pytest.fixture(scope="session")
    def _fixture(default_model_dir, checkpoint_cache_root) -> Path:
        return build_test_checkpoint(name, default_model_dir, checkpoint_cache_root)

    _fixture.__doc__ = f"Path of the {name} test checkpoint ({CHECKPOINT_SPECS[name][0]} + {CHECKPOINT_SPECS[name][1]})."
    return _fixture


fp8_checkpoint = _ckpt_fixture("fp8")            # FP8 + FP8 KV, 8 x 64 calibration
bf16_checkpoint = _ckpt_fixture("bf16")          # NO_QUANT (BF16)
int4_awq_checkpoint = _ckpt_fixture("int4_awq")  # W4A16_AWQ group 64, 4 x 32
int8_sq_checkpoint = _ckpt_fixture("int8_sq")    # W8A8_SQ_PER_CHANNEL alpha 0.5, 4 x 32
nvfp4_checkpoint = _ckpt_fixture("nvfp4")        # NVFP4 + FP8 KV, 4 x 32
w8a16_checkpoint = _ckpt_fixture("w8a16")        # W8A16, 4 x 32
w4a8_awq_checkpoint = _ckpt_fixture("w4a8_awq")  # W4A8_AWQ group 64 + FP8 KV, 4 x 32
fp8_tp3_checkpoint = _ckpt_fixture("fp8_tp3")    # FP8 + FP8 KV, tp_size 3 (same calibration as fp8)

def build_hf_export(name: str, model_dir: Path, root: Path) -> Path:
    """The unified HF export (``QuantizeJob.export_format == "hf_unified"``) of test checkpoint ``name``, made from
    the same calibrated quantizers (``restore_modelopt_model``: "max"-calibrated formats only) by
    ``ptq.export_checkpoint``; cached next to it as ``<folder>/hf``. Returns that folder."""
    import dataclasses
    import json

    from precision_pipeline.core.store import atomic_dir, locked
    from precision_pipeline.quantize.ptq import QuantizedModel, export_checkpoint

    ckpt = build_test_checkpoint(name, model_dir, root)
    out = ckpt.parent / "hf"
    with locked(Path(root) / f".{name}-hf.lock", timeout_s=3600):
        if (ckpt.parent / "hf.done").is_file():
            return out
        job = quantize_job(checkpoint_profile(name), model_dir).model_copy(update={"export_format": "hf_unified"})
        res = json.loads((ckpt.parent / "result.json").read_text())
        qm = QuantizedModel(model=restore_modelopt_model(ckpt, model_dir), job=job, config_name=res["modelopt_config_name"],
                            config={}, calibration=None, excluded_hf=[], unmatched=[], calibrate_s=0.0, group_size=job.group_size)
        with atomic_dir(ckpt.parent / "hf-tmp") as tmp:
            export_checkpoint(dataclasses.replace(qm), tmp / "hf")
        (ckpt.parent / "hf-tmp" / "hf").rename(out)
        (ckpt.parent / "hf-tmp").rmdir()
        (ckpt.parent / "hf.done").write_text("ok\n")
    return out


@pytest.fixture(scope="session")
def fp8_hf_checkpoint(default_model_dir, checkpoint_cache_root) -> Path:
    """The fp8 test checkpoint's quantizers exported as ModelOpt's unified HF checkpoint (``build_hf_export``)."""
    return build_hf_export("fp8", default_model_dir, checkpoint_cache_root)


# OpenMP threads that spin while waiting make torch on a shared, oversubscribed CPU up to ~10x
# slower (measured: a 20-token calibration forward took 20 s with the default policy and 0.4 s
# with PASSIVE while other processes were busy). Must be set before torch initialises OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def gate_cache(tmp_path_factory):
    """``GateRuntime.reference_cache`` for the tests' gate runs: the gate's own reference cache (None, i.e.
    ``<cache>/gate-ref``, keyed by model, tokens, options and library versions), so the FP32 reference and BF16 floor
    of a golden subset are computed once per machine, not once per session (the FP32 + BF16 floor pass was ~3/4 of
    test_gate.py's ``self_gate``); ``PRECISION_TEST_CKPT_CACHE=0``: a fresh one per session. The cold path (computed,
    written, then read) is asserted on the 2-layer model in tests/gate/test_gate_speed_paths.py."""
    if os.environ.get("PRECISION_TEST_CKPT_CACHE", "1") == "0":
        return tmp_path_factory.mktemp("gate-ref-cache")
    return None


GATE_SUBSET = {"prompts_per_category": 1, "heldout_tokens": 128, "greedy_new_tokens": 3, "bootstrap_resamples": 200}
"""The ``GateOptions`` of the gate tests' runs on the default model (tests/gate/test_gate.py's ``SUBSET``, ``fp8_gates``,
tests/gate/test_family_transplant.py): one golden prompt per category, 128 held-out tokens, 3 greedy tokens; one set
of options, so one entry of the gate's reference cache serves them all."""


def read_gate_result(out_dir: Path):
    """The ``GateResult`` of a finished gate folder (metrics.json, per_token.npz), as ``run_gate`` returned it (the
    metrics as written to metrics.json: JSON types)."""
    import json

    import numpy as np

    from precision_pipeline.gate.verdict import GateResult

    metrics = json.loads((Path(out_dir) / "metrics.json").read_text())
    with np.load(Path(out_dir) / "per_token.npz") as z:
        per_token = {k: z[k] for k in z.files}
    return GateResult(metrics["passed"], metrics["failures"], metrics, Path(out_dir), per_token)


@pytest.fixture(scope="session")
def fp8_gates(tmp_path_factory, fp8_checkpoint, fp8_hf_checkpoint, default_model_dir, gate_cache) -> dict:
    """{"engine": GateResult of the fp8 test checkpoint (TensorRT-LLM layout), "llm_api": GateResult of its unified HF
    export}, gated on ``GATE_SUBSET`` against the default model with fp8-h100's thresholds, read by
    tests/gate/test_gate.py, tests/checkpoint/test_hf_unified.py and tests/gate/test_family_transplant.py (each ran
    these gate runs of its own before: 5 runs, now 2). Once per run (``once_per_run``). The HF export runs first,
    so the engine run always reads the reference that run read or wrote in the gate's cache (``hit`` True);
    only the engine run writes the reports (the HF run's are not read)."""
    from precision_pipeline.gate.checkpoint_gate import gate_checkpoint
    from precision_pipeline.gate.options import GateOptions, GateRuntime
    from precision_pipeline.spec.profile import load_profile

    def make(folder):
        thr = load_profile("fp8-h100").gate.for_model_dir(default_model_dir)
        for route, ckpt in (("llm_api", fp8_hf_checkpoint), ("engine", fp8_checkpoint)):
            gate_checkpoint(ckpt, default_model_dir, thr, folder / route, GateOptions(**GATE_SUBSET),
                            GateRuntime(progress=False, reference_cache=gate_cache, write_report=route == "engine"))

    folder = once_per_run(tmp_path_factory, "fp8-gates", make)
    return {route: read_gate_result(folder / route) for route in ("engine", "llm_api")}


@pytest.fixture(scope="session")
def smollm_2layers(tmp_path_factory, default_model_dir) -> Path:
    """SmolLM2-135M-Instruct cut to its first 2 decoder layers (same tokenizer, same weights):
    the real model, small enough for a per-layer search in seconds."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("smollm2_2l")
    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), num_hidden_layers=2, dtype=torch.bfloat16)
    model.save_pretrained(str(out))
    for p in Path(default_model_dir).iterdir():
        if p.is_file() and p.name not in ("config.json", "model.safetensors") and not (out / p.name).exists():
            shutil.copy2(p, out / p.name)
    return out


MIXED_OVERRIDES = {"calibration": {"num_samples": 6, "seq_len": 48, "batch_size": 3}}


@pytest.fixture(scope="session")
def mixed_export(tmp_path_factory, smollm_2layers):
    """The shipped mixed-fp8-int4-h100 profile (FP8 / W4A16_AWQ search at 6 bits, FP8 KV, group 64)
    run on the 2-layer model with real calibration text (6 x 48), exported at tp_size 1 and 3.

    Returns ``(quantized_model, tp1 checkpoint dir, tp3 checkpoint dir, QuantizeResult tp1)``.
    """
    import dataclasses

    from precision_pipeline.spec.profile import deep_merge, load_raw, validate_profile
    from precision_pipeline.quantize.ptq import export_checkpoint, quantize_model

    root = tmp_path_factory.mktemp("mixed")
    prof = validate_profile(deep_merge(load_raw("mixed-fp8-int4-h100"), MIXED_OVERRIDES))
    qm = quantize_model(quantize_job(prof, smollm_2layers), smollm_2layers, show_progress=False)
    res = export_checkpoint(qm, root / "tp1")
    export_checkpoint(dataclasses.replace(qm, job=qm.job.model_copy(update={"tp_size": 3})), root / "tp3")
    return qm, root / "tp1", root / "tp3", res


def request(profile=None, out_dir: Path = Path("/nonexistent/out"), model_dir: Path | None = None, **kw):
    """A typed ``BuildRequest`` for calling stage hooks directly (``profile``: a Profile, default fp8-h100;
    ``model_dir``: default the default model's folder; other fields as keywords: strict, checkpoint, device...)."""
    from precision_pipeline.resolve.stage import BuildRequest
    from precision_pipeline.spec.default_model import default_model_dir as dm
    from precision_pipeline.spec.profile import load_profile

    return BuildRequest(profile=profile if profile is not None else load_profile("fp8-h100"), profile_source="test",
                        model_dir=model_dir if model_dir is not None else dm(), out_dir=Path(out_dir),
                        repo_root=str(out_dir), **kw)


def prof(base: str = "bf16-h100", **dotted):
    """A shipped profile's merged YAML with overrides, validated: ``section={...}`` replaces a
    section, ``section__key=value`` sets one key (``build__max_seq_len=...``)."""
    import copy

    from precision_pipeline.spec.profile import load_raw, validate_profile

    data = copy.deepcopy(load_raw(base))
    for key, val in dotted.items():
        parts = key.split("__")
        cur = data
        for part in parts[:-1]:
            cur = cur.setdefault(part, {})
        cur[parts[-1]] = val
    return validate_profile(data)


SMALL_GATE = {"heldout_tokens": 128, "greedy_new_tokens": 3}
"""The gate stage's held-out text and greedy length in the end-to-end tests of the stage flow (caching,
rebuilds, exit codes): run_build's ``--golden-limit 1`` cuts the prompts but not the 2048 held-out
tokens nor the 32 greedy tokens, which the reference, the BF16 noise floor and the candidate each
run (the gate's own numbers are tested in tests/gate/ on their own subsets)."""


def use_small_gate(mp: pytest.MonkeyPatch) -> dict:
    """Make run_build's gate stage measure ``SMALL_GATE`` (patched with ``mp``; every phase still runs:
    reference, noise floor, candidate, held-out perplexity, greedy) and render no reports (metrics.json and
    per_token.npz are written; report.md, report.html and the PNGs, ~1.7 s of CPU a run, are views no stage reads and
    these tests do not read: as ``GateRuntime(write_report=False)``, which never changes a number). Returns
    ``SMALL_GATE``."""
    import functools

    from precision_pipeline.gate import checkpoint_gate
    from precision_pipeline.gate import stage as gate_stage
    from precision_pipeline.gate.options import GateOptions

    mp.setattr(gate_stage, "GateOptions", functools.partial(GateOptions, **SMALL_GATE))
    write = checkpoint_gate.write_gate_dir
    mp.setattr(checkpoint_gate, "write_gate_dir",
               lambda result, heatmap_png=None, write_report=True: write(result, heatmap_png, write_report=False))
    return SMALL_GATE


SMALL_GATE_INVOKE = (
    "import functools, sys; sys.path.insert(0, 'build'); "
    "from precision_pipeline.gate import stage; from precision_pipeline.gate.options import GateOptions; "
    f"stage.GateOptions = functools.partial(GateOptions, **{SMALL_GATE!r}); "
    "from invoke.main import program; program.run(['invoke', *sys.argv[1:]])")
"""``python -c SMALL_GATE_INVOKE TASK ARGS...`` (run in the repository root): ``invoke TASK ARGS...`` in a new
process whose gate stage measures ``SMALL_GATE``, for a CLI test that reuses outputs built under ``use_small_gate``
(the gate's options are part of its stage key)."""


@pytest.fixture
def small_gate(monkeypatch):
    """run_build's gate stage measures ``SMALL_GATE`` (``use_small_gate``), so a stage-flow test does not pay
    for the full held-out text."""
    return use_small_gate(monkeypatch)


@pytest.fixture
def invoke_here(capfd, monkeypatch):
    """``invoke_here(TASK, *ARGS)``: ``invoke TASK ARGS...`` run by Invoke's own ``program`` in this process (same
    argument parsing, tasks.py, ``guarded`` exit codes and printed text as the command line; no new Python, which
    costs 3-12 s a call on 2 shared cores). Returns a ``subprocess.CompletedProcess`` (returncode, stdout, stderr)
    as ``subprocess.run(..., capture_output=True, text=True)`` would. For refusals and other quick paths; a test
    about the process itself (signals, a lock held by another process, exit of the interpreter) runs a subprocess."""
    import subprocess

    from invoke.main import program

    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setenv("COLUMNS", "250")

    def run(*args: str) -> subprocess.CompletedProcess:
        capfd.readouterr()
        try:
            program.run(["invoke", *args], exit=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out = capfd.readouterr()
        return subprocess.CompletedProcess(["invoke", *args], code, out.out, out.err)

    return run


HEAVIEST_FILES = (
    "tests/serving/test_rollout.py", "tests/core/test_stages.py", "tests/test_nightly.py",
    "tests/serving/test_release.py", "tests/serving/test_observability.py",
    "tests/checkpoint/test_hf_unified.py", "tests/gate/test_gate_mutations.py", "tests/gate/test_gate.py",
    "tests/serving/test_serve.py", "tests/quantize/test_mixed_precision.py",
)
"""The files that take longest (README "Suite time": their tests share one server or build per module, several
minutes each): under pytest-xdist they are handed out first (``invoke test`` passes ``--no-loadscope-reorder``), so
that no worker starts one of them while the other has nothing left to do. test_rollout.py (~550 s, a third of the
suite's CPU time) first, at the start of the run: its worker is the run's critical path once the rest shrinks (xdist
gives a worker its next file when at most 2 of its tests are pending, so the file it takes during test_rollout.py's
last two tests, ~480 s, waits for them). Only the order; a missing or stale entry costs time, never a result."""


LAST_FILES = ("tests/serving/test_release_live.py",)
"""Handed out last under pytest-xdist, when the other worker has only fast files left: its signal and kill tests load and
unload units on a live server and abort rollouts; in both whole-suite runs under ``-n 2`` (session 9) its SIGHUP abort
timed out while the other worker ran a live server under load (a Triton Python-backend stub hang), and the module's
server was gone for the next test. Alone (serial or ``-n 1``) the file passes (52 s)."""


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist only (a plain run keeps pytest's order, as ``invoke mutate`` and narrow runs use it): test
    files in the order the workers get them with ``--dist loadfile``: ``HEAVIEST_FILES``, then the other files with
    ``slow`` tests (most first), then the rest; the tests of a file keep their order. The same on every worker (the
    order is computed from the collection alone; xdist aborts a run whose workers collected different orders)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def rank(entry: tuple[int, str]) -> tuple:
        pos, name = entry
        if name in LAST_FILES:
            return (3, LAST_FILES.index(name), pos)
        if name in HEAVIEST_FILES:
            return (0, HEAVIEST_FILES.index(name), pos)
        slow = sum(1 for it in files[name] if it.get_closest_marker("slow") is not None)
        return (1, -slow, pos) if slow else (2, 0, pos)

    order = sorted(enumerate(files), key=rank)
    items[:] = [it for _, name in order for it in files[name]]
