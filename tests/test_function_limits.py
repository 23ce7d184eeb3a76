"""Size limits of the code (issue 24): no module in build/ over ``MAX_MODULE_LINES`` lines, no function
(methods and nested functions included) in build/ or tasks.py over ``MAX_FUNCTION_LINES`` lines or
``MAX_PARAMETERS`` parameters, except those in ``EXCEPTIONS``, each with its reason and the size it may
not grow past. Read with ``ast`` (nothing is imported).

A function's lines: from its ``def`` line to its last line (decorators aside, docstring included). Its
parameters: every name in its signature (``*args`` and ``**kwargs`` count one each), ``self`` / ``cls``
of a method not counted.

``EXCEPTIONS`` is printed in the README's architecture section (``readme_table()``; a test keeps the two
equal): shorten a function and its entry goes (a stale entry fails), grow one past its entry and the
test fails.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "build" / "precision_pipeline"
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 80
MAX_PARAMETERS = 8

NOT_SPLIT_YET = "not split yet (issue 24)"
INVOKE_TASK = "an Invoke task: Invoke turns every parameter into a command-line flag, one per option of the CLI"
CLI_FLAGS = "what one invoke task calls with its flags as they came (tasks.py stays thin); one parameter per flag"
KEYWORD_API = "a public call whose keyword options are the CLI's flags; to take a typed request with the BuildRequest of issue 24"

# module -> (lines at most, why)
MODULE_EXCEPTIONS: dict[str, tuple[int, str]] = {}

# "path:qualified name" -> (lines at most, parameters at most, why)
EXCEPTIONS: dict[str, tuple[int, int, str]] = {
    "build/precision_pipeline/cli/build.py:build": (26, 11, CLI_FLAGS + " (`invoke build`)"),
    "build/precision_pipeline/cli/choose.py:recommend": (55, 18, CLI_FLAGS + " (`invoke recommend`)"),
    "build/precision_pipeline/cli/choose.py:compare": (39, 10, CLI_FLAGS + " (`invoke compare`)"),
    "build/precision_pipeline/cli/sensitivity.py:sensitivity": (63, 9, CLI_FLAGS + " (`invoke sensitivity`)"),
    "build/precision_pipeline/cli/serving.py:rollout": (56, 9, CLI_FLAGS + " (`invoke rollout`)"),
    "build/precision_pipeline/cli/serving.py:probe": (74, 11, CLI_FLAGS + " (`invoke probe`)"),
    "build/precision_pipeline/cli/routing.py:explain": (40, 10, CLI_FLAGS + " (`invoke route explain`)"),
    "build/precision_pipeline/analysis/sensitivity.py:run_sensitivity": (28, 9, KEYWORD_API + " (`invoke sensitivity`)"),
    "build/precision_pipeline/checkpoint/reader.py:dequantize_checkpoint": (86, 1, NOT_SPLIT_YET),
    "build/precision_pipeline/checkpoint/verify.py:verify_checkpoint": (193, 2, "one pass over every tensor of the checkpoint; not split yet"),
    "build/precision_pipeline/engine/provenance.py:write_provenance": (21, 10, "one argument per provenance.json field; not split yet"),
    "build/precision_pipeline/engine/trtllm_build.py:run_engine": (67, 11, KEYWORD_API + " (the engine stage)"),
    "build/precision_pipeline/serving/llmapi_unit.py:pack_llm_api_unit": (38, 9, "the unit's inputs as pack and the tests call it; ``routing`` (keyword, issue 31) writes the unit's routing table as for an engine unit"),
    "build/precision_pipeline/pipeline.py:build_request": (29, 10, "the one place every flag of `invoke build` becomes the typed BuildRequest: one parameter per flag"),
    "build/precision_pipeline/pipeline.py:run_build": (72, 13, NOT_SPLIT_YET),
    "build/precision_pipeline/quantize/calibration.py:_builtin_set": (81, 5, NOT_SPLIT_YET),
    "build/precision_pipeline/quantize/search.py:run_search": (90, 9, NOT_SPLIT_YET),
    "build/precision_pipeline/quantize/search.py:auto_quantize_export": (64, 9, "a fossil without callers (fam deletes it: quantize/)"),
    "build/precision_pipeline/resolve/dataset.py:scan_user_dataset": (84, 4, "one pass over a user dataset's rows; not split yet"),
    "build/precision_pipeline/resolve/estimate.py:roofline": (89, 8, "one roofline derivation, step by step with its sources; not split yet"),
    "build/precision_pipeline/resolve/perf.py:performance": (130, 7, "one performance model derivation, step by step; not split yet"),
    "build/precision_pipeline/resolve/build_memory.py:build_memory_plan": (83, 1, "one derivation of the build's memory (quantize and the gate on the build's device), step by step; not split yet"),
    "build/precision_pipeline/serving/build_job.py:render_job": (36, 9, KEYWORD_API + " (the engine-build Job)"),
    "build/precision_pipeline/serving/pack.py:write_unit": (24, 9, "one argument per source of the engine unit it writes (its config, engine, checkpoint, model, hash, profile, meta files)"),
    "build/precision_pipeline/serving/pack.py:pack_repository": (54, 10, "the pack stage's inputs one by one (plan, profile, model, checkpoint, engine, output, repo root, workdir, image); tests call it without a PackInputs"),
    "build/precision_pipeline/serving/release.py:promote": (56, 10, "a public call with the options of `invoke promote` and `nightly --promote` (server, profile, gate, promoted_by, smoke, expect, serve_root, warm_previous); a typed request when tasks.py takes one"),
    "build/precision_pipeline/serving/release_recover.py:init_serving_repo": (24, 9, "a public call with the first promote's options (serve_root, profile, gate, by, fallback_repo, warm_fallback, keep_releases); a typed request when tasks.py takes one"),
    "build/precision_pipeline/serving/release_recover.py:_init_locked": (34, 10, "init_serving_repo's options, passed on under the releases lock"),
    "build/precision_pipeline/serving/release_rollout.py:begin_rollout": (36, 9, "a public call whose keyword options are `invoke rollout`'s (profile, gate, steps); a typed request when tasks.py takes one"),
    "build/precision_pipeline/serving/rollout.py:_evaluate": (23, 9, "one canary step's inputs; not split yet"),
    "build/precision_pipeline/serving/rollout.py:rollout": (80, 12, KEYWORD_API + " (`invoke rollout`)"),
    "build/precision_pipeline/serving/triton_server.py:TritonServer.__init__": (21, 10, "one argument per tritonserver option the tests and probe set"),
    "tasks.py:build": (29, 13, INVOKE_TASK),
    "tasks.py:rollout": (63, 10, INVOKE_TASK),
    "tasks.py:probe": (76, 12, INVOKE_TASK),
    "tasks.py:sensitivity": (63, 10, INVOKE_TASK),
    "tasks.py:nightly": (28, 13, INVOKE_TASK),
    "tasks.py:route": (10, 11, INVOKE_TASK),
    "tasks.py:recommend": (55, 19, INVOKE_TASK),
    "tasks.py:compare": (40, 11, INVOKE_TASK),
}


@dataclass(frozen=True)
class Function:
    where: str   # "path:qualified name"
    line: int
    lines: int
    params: int


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, method: bool) -> int:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if method and names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def functions(path: Path) -> list[Function]:
    """Every function of ``path`` (methods and nested functions too), with its size."""
    rel = path.relative_to(ROOT).as_posix()
    out: list[Function] = []

    def walk(node: ast.AST, prefix: str, in_class: bool) -> None:
        for ch in ast.iter_child_nodes(node):
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append(Function(f"{rel}:{prefix}{ch.name}", ch.lineno, ch.end_lineno - ch.lineno + 1,
                                    _params(ch, in_class)))
                walk(ch, f"{prefix}{ch.name}.", False)
            elif isinstance(ch, ast.ClassDef):
                walk(ch, f"{prefix}{ch.name}.", True)

    walk(ast.parse(path.read_text()), "", False)
    return out


def sources() -> list[Path]:
    return sorted(SOURCE.rglob("*.py")) + [ROOT / "tasks.py"]


def over_limits() -> list[Function]:
    return [f for p in sources() for f in functions(p) if f.lines > MAX_FUNCTION_LINES or f.params > MAX_PARAMETERS]


def readme_table() -> str:
    """The exceptions as the README prints them (a Markdown table)."""
    rows = ["| function | lines | parameters | why |", "|---|---|---|---|"]
    for path, (lines, why) in MODULE_EXCEPTIONS.items():
        rows.append(f"| `{path.removeprefix('build/precision_pipeline/')}` (module) | {lines} | | {why} |")
    for where, (lines, params, why) in EXCEPTIONS.items():
        path, name = where.split(":")
        rows.append(f"| `{path.removeprefix('build/precision_pipeline/')}` `{name}` | {lines} | {params} | {why} |")
    return "\n".join(rows)


def test_the_reader_sees_functions_methods_and_parameters():
    fns = {f.where: f for f in functions(ROOT / "tests" / "test_function_limits.py")}
    assert fns["tests/test_function_limits.py:_params"].params == 2
    assert fns["tests/test_function_limits.py:functions.walk"].params == 3
    assert len(sources()) > 60


def test_no_module_over_the_limit_but_the_listed_ones():
    big = {p.relative_to(ROOT).as_posix(): n for p in SOURCE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    unlisted = {m: n for m, n in big.items() if m not in MODULE_EXCEPTIONS or n > MODULE_EXCEPTIONS[m][0]}
    assert unlisted == {}, f"modules over {MAX_MODULE_LINES} lines (or grown past their entry): split them by responsibility"
    assert sorted(set(MODULE_EXCEPTIONS) - set(big)) == [], "within the limit now: remove from MODULE_EXCEPTIONS and the README"


def test_no_function_over_the_limits_but_the_listed_ones():
    found = over_limits()
    unlisted = [f"{f.where} ({f.lines} lines, {f.params} parameters)" for f in found if f.where not in EXCEPTIONS]
    assert unlisted == [], (f"over {MAX_FUNCTION_LINES} lines or {MAX_PARAMETERS} parameters: shorten them, "
                            "or list them in EXCEPTIONS with the reason (and in the README)")
    grown = [f"{f.where}: {f.lines} lines, {f.params} parameters; listed at {EXCEPTIONS[f.where][:2]}"
             for f in found if f.where in EXCEPTIONS
             and (f.lines > EXCEPTIONS[f.where][0] or f.params > EXCEPTIONS[f.where][1])]
    assert grown == [], "a listed function grew: shorten it instead"


def test_no_stale_exception():
    over = {f.where for f in over_limits()}
    stale = sorted(set(EXCEPTIONS) - over)
    assert stale == [], "within the limits now (or gone): remove from EXCEPTIONS and the README"


@pytest.mark.parametrize("where", sorted(EXCEPTIONS))
def test_each_exception_has_a_reason(where):
    assert len(EXCEPTIONS[where][2]) > 20


def test_the_readme_prints_the_exceptions():
    assert readme_table() in (ROOT / "README.md").read_text(), \
        "README.md's architecture section must hold tests/test_function_limits.py readme_table()"
