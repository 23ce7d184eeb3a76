"""A small mutation-testing runner on ``ast`` (``invoke mutate``; not part of ``invoke test``).

Why not mutmut: mutmut 3 mutates only inside undecorated functions (every ``@rule`` check in
resolve/rules.py, every ``@property`` and all module-level data such as the format registry in
spec/formats.py would never be mutated), and it names mutants by file path with only a ``src.``
prefix stripped, so the ``build/`` source root breaks its test-to-mutant association.

Which modules: every ``.py`` under ``build/precision_pipeline`` (named relative to it, e.g.
``serving/rollout.py``) and every Triton Python model under ``triton_repo/`` (named relative to the
repository, e.g. ``triton_repo/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/model.py``);
modules without a mutation point are skipped. ``[tool.mutate.modules."<module>"]`` in pyproject.toml
may override a module's tests (``tests = [...]``, pytest arguments), restrict it to some functions
(``functions = [...]``), include its slow tests (``slow = true``) and list equivalent mutants
(``equivalent = [{source = "text on the line", what = "< -> <=", why = "reason"}]``) and name module-level tables
whose numbers are citations of another project's source lines (``citations = ["NAME", ...]``: not mutated; no code
decides on a cited line number).

Which tests (``test_map``, a static import map computed on each run, ``--list`` prints it): the test
files that import the module (``import precision_pipeline.a.b``, ``from precision_pipeline.a import b``,
``from precision_pipeline.a.b import x``, or name it in a string such as a monkeypatch target); a
module no test file imports directly gets the test files importing a module that imports it (one
level). A Triton model gets the test files that name its model folder (``tensorrt_llm_bls``, ...) and
start a server or pack a repository. The fast tests (``-m "not slow and not gpu"``) run when the
selection has any; when it has only slow ones (or ``slow = true``), ``-m "not gpu"``.

What it does, per module:

1. Enumerate mutation points (deterministic order): binary and augmented-assignment operators
   (``+ -``, ``* /``, ``// *``, ``% //``, ``** *``), comparisons (``< <=``, ``> >=``, ``== !=``,
   ``in``/``not in``, ``is``/``is not``), ``and``/``or``, ``not x`` -> ``x``, integer constants
   ``n`` -> ``n + 1``, float constants ``x`` -> ``x + 1``, ``True``/``False`` swapped. Not mutated:
   strings (messages, keys), f-strings, docstrings, annotations, ``__all__``, and lines that carry
   ``# pragma: no mutate``. ``functions = [...]`` restricts a module to those functions.
2. Sample ``--max-mutants`` of them (seeded; all with ``--all-mutants``).
3. For each mutant: write the mutated module (``ast.unparse``) into a private copy of ``build/``,
   ``tests/``, ``triton_repo/``, ``precision_profiles/`` and ``tasks.py`` (one copy per job; everything else is a symlink to the checkout)
   and run the module's tests there with ``pytest -x``. A failing run, an import error or a timeout
   (4 x the unmutated run, at least 30 s) kills the mutant; a passing run means it survived, unless
   it matches an ``equivalent`` entry (counted with its reason, as killed).

Results go to ``artifacts/mutation/<module>.json`` (survivors with line and source text) and to
stdout, one score line per module and a table at the end. Exit status 0 when the score
((killed + equivalent) / run) meets ``--min-score`` (default: none).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import json
import os
import queue
import random
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "build" / "precision_pipeline"
TRITON = "triton_repo"
COPIED = ("build", "tests", TRITON, "tasks.py", "precision_profiles")
"""Copied into each mutant's workspace (everything else is a symlink). ``tasks.py`` too: it puts the ``build/`` beside
its resolved path on sys.path, so a symlink made every ``invoke`` a test starts in a new process import the unmutated
package (session 12: such CLI tests could not kill a mutant). ``precision_profiles/`` (52 KB): a shipped profile
resolved through a symlink is a path outside the workspace, not a shipped name (session 12: the unmutated
tests of serving/build_output.py failed, test_hostile_s8_left.py's fallback read as a path)."""

_BIN = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Mult,
        ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult}
_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
        ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
_BOOL = {ast.And: ast.Or, ast.Or: ast.And}
_SYM = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%", ast.Pow: "**",
        ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.In: "in",
        ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not", ast.And: "and", ast.Or: "or"}


@dataclass
class Point:
    """One mutation: ``index`` in enumeration order, where, and what it does."""

    index: int
    line: int
    col: int
    what: str
    function: str


def _skipped_nodes(tree: ast.AST, lines: list[str], citations: list[str] | None = None) -> set[int]:
    """ids of nodes never mutated: strings, f-strings, docstrings, annotations, __all__, pragma lines, and the values
    of the module-level assignments named in ``citations``."""
    skip: set[int] = set()

    def drop(n: ast.AST | None) -> None:
        if n is not None:
            skip.update(id(x) for x in ast.walk(n))

    for n in ast.walk(tree):
        if isinstance(n, ast.JoinedStr):
            drop(n)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            drop(n.returns)
            for a in [*n.args.args, *n.args.kwonlyargs, *n.args.posonlyargs, n.args.vararg, n.args.kwarg]:
                if a is not None:
                    drop(a.annotation)
        elif isinstance(n, ast.AnnAssign):
            drop(n.annotation)
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets):
            drop(n)
        if (isinstance(n, (ast.Assign, ast.AnnAssign)) and citations and n in getattr(tree, "body", ())
              and any(isinstance(t, ast.Name) and t.id in citations for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))):
            drop(n.value)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body:
            first = n.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                drop(first)
        ln = getattr(n, "lineno", None)
        if ln is not None and "pragma: no mutate" in lines[ln - 1]:
            skip.add(id(n))
    return skip


def _functions(tree: ast.AST) -> dict[int, str]:
    """node id -> name of the innermost enclosing function ("" at module level)."""
    out: dict[int, str] = {}

    def visit(n: ast.AST, name: str) -> None:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = n.name
        out[id(n)] = name
        for c in ast.iter_child_nodes(n):
            visit(c, name)

    visit(tree, "")
    return out


def _points(tree: ast.AST, source: str, functions: list[str] | None = None,
            citations: list[str] | None = None) -> list[tuple[Point, callable]]:
    """Every mutation point of ``tree`` with a function that applies it in place."""
    lines = source.splitlines()
    skip = _skipped_nodes(tree, lines, citations)
    fn_of = _functions(tree)
    parents: dict[int, tuple[ast.AST, str, int | None]] = {}
    for p in ast.walk(tree):
        for field, val in ast.iter_fields(p):
            if isinstance(val, list):
                for i, c in enumerate(val):
                    if isinstance(c, ast.AST):
                        parents[id(c)] = (p, field, i)
            elif isinstance(val, ast.AST):
                parents[id(val)] = (p, field, None)
    out: list[tuple[Point, callable]] = []

    def add(n: ast.AST, what: str, apply) -> None:
        fn = fn_of.get(id(n), "")
        if functions is not None and fn not in functions:
            return
        out.append((Point(len(out), n.lineno, n.col_offset, what, fn), apply))

    for n in ast.walk(tree):
        if id(n) in skip or not hasattr(n, "lineno"):
            continue
        if isinstance(n, (ast.BinOp, ast.AugAssign)) and type(n.op) in _BIN:
            new = _BIN[type(n.op)]
            add(n, f"{_SYM[type(n.op)]} -> {_SYM[new]}", lambda n=n, new=new: setattr(n, "op", new()))
        elif isinstance(n, ast.Compare):
            for i, op in enumerate(n.ops):
                if type(op) in _CMP:
                    new = _CMP[type(op)]
                    add(n, f"{_SYM[type(op)]} -> {_SYM[new]}", lambda n=n, i=i, new=new: n.ops.__setitem__(i, new()))
        elif isinstance(n, ast.BoolOp):
            new = _BOOL[type(n.op)]
            add(n, f"{_SYM[type(n.op)]} -> {_SYM[new]}", lambda n=n, new=new: setattr(n, "op", new()))
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not) and id(n) in parents:
            def drop_not(n=n):
                p, field, i = parents[id(n)]
                if i is None:
                    setattr(p, field, n.operand)
                else:
                    getattr(p, field)[i] = n.operand
            add(n, "not x -> x", drop_not)
        elif isinstance(n, ast.Constant) and type(n.value) is bool:
            add(n, f"{n.value} -> {not n.value}", lambda n=n: setattr(n, "value", not n.value))
        elif isinstance(n, ast.Constant) and type(n.value) in (int, float):
            add(n, f"{n.value!r} -> {n.value + 1!r}", lambda n=n: setattr(n, "value", n.value + 1))
    return out


def enumerate_points(source: str, functions: list[str] | None = None, citations: list[str] | None = None) -> list[Point]:
    return [p for p, _ in _points(ast.parse(source), source, functions, citations)]


def mutate(source: str, index: int, functions: list[str] | None = None, citations: list[str] | None = None) -> str:
    """``source`` with mutation ``index`` applied (re-parsed, so the order is the enumeration order)."""
    tree = ast.parse(source)
    pts = _points(tree, source, functions, citations)
    pts[index][1]()
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


# --------------------------------------------------------------------------------------------
# Running


def _workspace(base: Path) -> Path:
    """A copy of build/, tests/ and triton_repo/, symlinks to everything else at the top level."""
    base.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for entry in ROOT.iterdir():
        if entry.name in COPIED and entry.is_dir():
            shutil.copytree(entry, base / entry.name, ignore=ignore, symlinks=True)
        elif entry.name in COPIED:
            shutil.copy2(entry, base / entry.name)
        elif entry.name not in (".git", "artifacts", "mutants"):
            (base / entry.name).symlink_to(entry.resolve())
    return base


def _pytest(ws: Path, tests: list[str], timeout: float, marker: str = "not slow and not gpu") -> tuple[str, float, str]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_WAIT_POLICY="PASSIVE",
               PRECISION_CACHE_DIR=os.environ.get("PRECISION_CACHE_DIR", str((ROOT / ".cache").resolve())))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-m", marker, *tests]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ws, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - t0, ""
    tail = (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
    status = {0: "survived", 5: "no-tests"}.get(p.returncode, "killed")
    return status, time.perf_counter() - t0, tail[0]


def load_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutate"]


# --------------------------------------------------------------------------------------------
# Which modules, which tests


def module_path(module: str) -> Path:
    """The file of ``module`` (``serving/rollout.py`` under the package, ``triton_repo/...`` under the repository)."""
    return (ROOT if module.startswith(TRITON + "/") else PACKAGE) / module


def discover_modules() -> list[str]:
    """Every package module and Triton Python model with at least one mutation point, sorted."""
    out = []
    for f in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" not in f.parts and enumerate_points(f.read_text()):
            out.append(f.relative_to(PACKAGE).as_posix())
    for f in sorted((ROOT / TRITON).rglob("model.py")):
        if enumerate_points(f.read_text()):
            out.append(f.relative_to(ROOT).as_posix())
    return out


def _dotted(module: str) -> str:
    return "precision_pipeline." + module.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _imports_of(tree: ast.AST, known: set[str]) -> set[str]:
    """Dotted package modules (in ``known``) that ``tree`` imports or names in a string constant."""
    got: set[str] = set()

    def add(name: str) -> None:
        while name:  # precision_pipeline.a.b.c -> the longest known prefix
            if name in known:
                got.add(name)
                return
            name = name.rpartition(".")[0]

    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                add(a.name)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            for a in n.names:
                add(f"{n.module}.{a.name}")
            add(n.module)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith("precision_pipeline."):
            add(n.value.split(":")[0].split()[0])
    return got


SERVER_WORDS = ("TritonServer(", "serve_repository(")
"""A test file that starts a real server (every Triton model runs there, none in a fast test)."""


def _specific_first(module: str, files: set[str]) -> list[str]:
    """``files`` ordered so the most specific run first (``-x`` then kills sooner): the test files
    named after the module's stem, then those in its package's test folder, then the rest."""
    stem, pkg = Path(module).stem, Path(module).parent.name

    def rank(rel: str) -> tuple[int, str]:
        name, folder = Path(rel).stem, Path(rel).parent.name
        return (0 if stem in name else 1 if folder == pkg else 2, rel)

    return sorted(files, key=rank)


def test_map(modules: list[str] | None = None) -> dict[str, list[str]]:
    """module -> test files (relative to the repository) that exercise it, by the static rules of the module doc."""
    modules = modules if modules is not None else discover_modules()
    dotted = {_dotted(m): m for m in modules if not m.startswith(TRITON + "/")}
    files = sorted(f for f in (ROOT / "tests").rglob("test_*.py") if "__pycache__" not in f.parts)
    direct: dict[str, set[str]] = {m: set() for m in modules}
    texts = {}
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        texts[rel] = text = f.read_text()
        for d in _imports_of(ast.parse(text), set(dotted)):
            direct[dotted[d]].add(rel)
    # one level up: the package modules that import each module
    importers: dict[str, set[str]] = {m: set() for m in dotted.values()}
    for d, m in dotted.items():
        for other in _imports_of(ast.parse(module_path(m).read_text()), set(dotted)) - {d}:
            importers[dotted[other]].add(m)
    servers = {rel for rel, t in texts.items() if any(w in t for w in SERVER_WORDS)}
    out = {}
    for m in modules:
        if m.startswith(TRITON + "/"):
            parts = Path(m).parts  # all_models/<repo>/<model>/1/model.py, or backends/<backend>/model.py
            got = servers if "backends" in parts else {rel for rel in servers if parts[-3] in texts[rel]}
        elif direct[m]:
            got = direct[m]
        else:
            got = set().union(*(direct[i] for i in importers[m]))
        out[m] = _specific_first(m, got)
    return out


def _has_fast_tests(tests: list[str]) -> bool:
    """True when ``tests`` (pytest arguments) select a test not marked slow (static: a file whose
    module-level ``pytestmark`` is slow has none; otherwise any test function without the mark)."""
    for t in tests:
        path = ROOT / t.split("::")[0]
        if not t.startswith("tests/") or not path.is_file():
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Assign) and any(isinstance(x, ast.Name) and x.id == "pytestmark" for x in n.targets)
               and "slow" in ast.unparse(n.value) for n in tree.body):
            continue
        want = t.split("::")[1] if "::" in t else None
        for n in tree.body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test") and (
                    want is None or n.name == want.split("[")[0]):
                if not any("slow" in ast.unparse(d) for d in n.decorator_list):
                    return True
            if isinstance(n, ast.ClassDef) and n.name.startswith("Test") and want is None:
                return True
    return False


def selection(module: str, cfg: dict, tmap: dict[str, list[str]]) -> tuple[list[str], str, dict]:
    """(pytest arguments, marker expression, the module's config entry) for ``module``."""
    spec = cfg.get("modules", {}).get(module, {})
    tests = list(spec.get("tests") or tmap.get(module) or [])
    slow = spec.get("slow") or module.startswith(TRITON + "/") or not _has_fast_tests(tests)
    marker = "not gpu" if slow else "not slow and not gpu"
    return tests, marker, spec


def _equivalent(spec: dict, r: dict) -> str | None:
    """The reason a surviving mutant ``r`` is equivalent (``equivalent`` entries match the line's text and ``what``)."""
    for e in spec.get("equivalent", []):
        if e["source"] in r["source"] and e["what"] == r["what"] and (not e.get("function") or e["function"] == r["function"]):
            return e["why"]
    return None


def run_module(module: str, spec: dict, tests: list[str], marker: str, max_mutants: int | None, seed: int, jobs: int,
               out_dir: Path) -> dict:
    src_path = module_path(module)
    rel = src_path.relative_to(ROOT)
    source = src_path.read_text()
    functions, citations = spec.get("functions"), spec.get("citations")
    points = enumerate_points(source, functions, citations)
    chosen = points if max_mutants is None or max_mutants >= len(points) else sorted(
        random.Random(f"{seed}:{module}").sample(points, max_mutants), key=lambda p: p.index)
    lines = source.splitlines()
    summary = {"module": module, "points": len(points), "run": 0, "killed": 0, "equivalent": 0, "survived": 0,
               "score": None, "seed": seed, "tests": tests, "marker": marker, "survivors": [], "results": []}
    if not tests:
        print(f"{module}: no test imports it: not run", flush=True)
        summary["error"] = "no tests"
        return summary
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        spaces: queue.Queue[Path] = queue.Queue()
        for j in range(jobs):
            spaces.put(_workspace(Path(tmp) / f"w{j}"))
        ws0 = spaces.get()
        status, base_s, tail = _pytest(ws0, tests, timeout=1800, marker=marker)
        spaces.put(ws0)
        if status != "survived":
            print(f"{module}: the unmutated tests do not pass ({status}: {tail}): not run", flush=True)
            summary["error"] = f"unmutated tests {status}: {tail}"
            return summary
        timeout = max(30.0, 4 * base_s)
        print(f"{module}: {len(points)} mutation points, running {len(chosen)}; {len(tests)} test args "
              f"(-m {marker!r}); unmutated tests {base_s:.1f} s", flush=True)

        def one(pt: Point) -> dict:
            ws = spaces.get()
            target = ws / rel
            try:
                target.write_text(mutate(source, pt.index, functions, citations))
                status, secs, tail = _pytest(ws, tests, timeout, marker)
            finally:
                target.write_text(source)
                spaces.put(ws)
            return {**asdict(pt), "status": status, "seconds": round(secs, 1), "source": lines[pt.line - 1].strip(),
                    "last_line": tail}

        results = []
        with cf.ThreadPoolExecutor(jobs) as ex:
            for r in ex.map(one, chosen):
                if r["status"] == "survived" and (why := _equivalent(spec, r)):
                    r["status"], r["why"] = "equivalent", why
                results.append(r)
                mark = {"killed": ".", "timeout": "T", "survived": "S", "no-tests": "?", "equivalent": "E"}[r["status"]]
                print(mark, end="", flush=True)
    print()
    killed = sum(r["status"] in ("killed", "timeout") for r in results)
    equivalent = [r for r in results if r["status"] == "equivalent"]
    survivors = [r for r in results if r["status"] in ("survived", "no-tests")]
    summary.update(run=len(results), killed=killed, equivalent=len(equivalent), survived=len(survivors),
                   score=(killed + len(equivalent)) / len(results) if results else None, survivors=survivors,
                   results=results)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / (module.replace("/", ".").removesuffix(".py") + ".json")).write_text(json.dumps(summary, indent=1))
    eq = f" + {len(equivalent)} equivalent" if equivalent else ""
    print(f"{module}: score {killed}{eq}/{len(results)} = {summary['score']:.1%}")
    for r in equivalent:
        print(f"  equivalent line {r['line']} ({r['function'] or 'module'}): {r['what']}   | {r['why']}")
    for r in survivors:
        print(f"  survived  line {r['line']} ({r['function'] or 'module'}): {r['what']}   | {r['source'][:100]}")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", action="append",
                    help="module under build/precision_pipeline (serving/rollout.py) or triton_repo/... (default: all)")
    ap.add_argument("--max-mutants", type=int, default=None, help="sample at most N mutants per module")
    ap.add_argument("--all-mutants", action="store_true", help="every mutation point (the whole set; hours)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--min-score", type=float, default=None, help="exit 1 below this score (0..1) over all modules")
    ap.add_argument("--list", action="store_true", help="print each module's points and tests, run nothing")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "mutation")
    a = ap.parse_args(argv)
    cfg = load_config()
    known = discover_modules()
    names = a.module or known
    unknown = [m for m in names if m not in known]
    if unknown:
        print(f"error: not a module with mutation points: {', '.join(unknown)}; e.g. serving/rollout.py or "
              f"{known[-1]} (`invoke mutate --list` lists them)", file=sys.stderr)
        return 2
    tmap = test_map(known)
    if a.list:
        for m in names:
            tests, marker, spec = selection(m, cfg, tmap)
            n = len(enumerate_points(module_path(m).read_text(), spec.get("functions"), spec.get("citations")))
            print(f"{m}: {n} points; -m {marker!r}; {' '.join(tests) or 'NO TESTS'}")
        return 0
    max_m = None if a.all_mutants else a.max_mutants if a.max_mutants is not None else cfg.get("max_mutants")
    sums = []
    for m in names:
        tests, marker, spec = selection(m, cfg, tmap)
        sums.append(run_module(m, spec, tests, marker, max_m, a.seed, a.jobs, a.out))
    run = sum(s["run"] for s in sums)
    good = sum(s["killed"] + s["equivalent"] for s in sums)
    score = good / run if run else 1.0
    print("\nmodule | killed | equivalent | run | score")
    for s in sums:
        sc = f"{s['score']:.1%}" if s["score"] is not None else s.get("error", "-")
        print(f"{s['module']} | {s['killed']} | {s['equivalent']} | {s['run']} | {sc}")
    print(f"total: {good}/{run} killed or equivalent = {score:.1%}")
    not_run = [s["module"] for s in sums if s.get("error")]
    if not_run:
        print(f"not run ({len(not_run)}): {', '.join(not_run)}")
    return 1 if a.min_score is not None and score < a.min_score else 0


if __name__ == "__main__":
    raise SystemExit(main())
