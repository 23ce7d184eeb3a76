"""A small mutation-testing runner on ``ast`` (``invoke mutate``; not part of ``invoke test``).

Why not mutmut: mutmut 3 mutates only inside undecorated functions (every ``@rule`` check in
resolve/rules.py, every ``@property`` and all module-level data such as the format registry in
spec/formats.py would never be mutated), and it names mutants by file path with only a ``src.``
prefix stripped, so the ``build/`` source root breaks its test-to-mutant association.

What it does, per module listed under ``[tool.mutate.modules]`` in pyproject.toml:

1. Enumerate mutation points (deterministic order): binary and augmented-assignment operators
   (``+ -``, ``* /``, ``// *``, ``% //``, ``** *``), comparisons (``< <=``, ``> >=``, ``== !=``,
   ``in``/``not in``, ``is``/``is not``), ``and``/``or``, ``not x`` -> ``x``, integer constants
   ``n`` -> ``n + 1``, float constants ``x`` -> ``x + 1``, ``True``/``False`` swapped. Not mutated:
   strings (messages, keys), f-strings, docstrings, annotations, ``__all__``, and lines that carry
   ``# pragma: no mutate``. ``functions = [...]`` restricts a module to those functions.
2. Sample ``--max-mutants`` of them (seeded; all when fewer).
3. For each mutant: write the mutated module (``ast.unparse``) into a private copy of ``build/``
   and ``tests/`` (one copy per job; everything else is a symlink to the checkout) and run the
   module's fast tests there with ``pytest -x -m "not slow and not gpu"``. A failing run, an import
   error or a timeout (4 x the unmutated run, at least 30 s) kills the mutant; a passing run means
   it survived.

Results go to ``artifacts/mutation/<module>.json`` (survivors with line and source text) and to
stdout. Exit status 0 when the score (killed / run) meets ``--min-score`` (default: none).
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


def _skipped_nodes(tree: ast.AST, lines: list[str]) -> set[int]:
    """ids of nodes never mutated: strings, f-strings, docstrings, annotations, __all__, pragma lines."""
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


def _points(tree: ast.AST, source: str, functions: list[str] | None = None) -> list[tuple[Point, callable]]:
    """Every mutation point of ``tree`` with a function that applies it in place."""
    lines = source.splitlines()
    skip = _skipped_nodes(tree, lines)
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


def enumerate_points(source: str, functions: list[str] | None = None) -> list[Point]:
    return [p for p, _ in _points(ast.parse(source), source, functions)]


def mutate(source: str, index: int, functions: list[str] | None = None) -> str:
    """``source`` with mutation ``index`` applied (re-parsed, so the order is the enumeration order)."""
    tree = ast.parse(source)
    pts = _points(tree, source, functions)
    pts[index][1]()
    return ast.unparse(ast.fix_missing_locations(tree)) + "\n"


# --------------------------------------------------------------------------------------------
# Running


def _workspace(base: Path) -> Path:
    """A copy of build/ and tests/, symlinks to everything else at the top level."""
    base.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for entry in ROOT.iterdir():
        if entry.name in ("build", "tests"):
            shutil.copytree(entry, base / entry.name, ignore=ignore, symlinks=True)
        elif entry.name not in (".git", "artifacts", "mutants"):
            (base / entry.name).symlink_to(entry.resolve())
    return base


def _pytest(ws: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", OMP_WAIT_POLICY="PASSIVE",
               PRECISION_CACHE_DIR=os.environ.get("PRECISION_CACHE_DIR", str((ROOT / ".cache").resolve())))
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header", "-m",
           "not slow and not gpu", *tests]
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


def run_module(module: str, spec: dict, max_mutants: int | None, seed: int, jobs: int, out_dir: Path) -> dict:
    src_path = PACKAGE / module
    source = src_path.read_text()
    functions = spec.get("functions")
    points = enumerate_points(source, functions)
    chosen = points if max_mutants is None or max_mutants >= len(points) else sorted(
        random.Random(f"{seed}:{module}").sample(points, max_mutants), key=lambda p: p.index)
    tests = list(spec["tests"])
    lines = source.splitlines()
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        spaces: queue.Queue[Path] = queue.Queue()
        for j in range(jobs):
            spaces.put(_workspace(Path(tmp) / f"w{j}"))
        ws0 = spaces.get()
        status, base_s, tail = _pytest(ws0, tests, timeout=1800)
        spaces.put(ws0)
        if status != "survived":
            raise SystemExit(f"{module}: the unmutated tests do not pass ({status}: {tail})")
        timeout = max(30.0, 4 * base_s)
        print(f"{module}: {len(points)} mutation points, running {len(chosen)}; unmutated tests {base_s:.1f} s", flush=True)

        def one(pt: Point) -> dict:
            ws = spaces.get()
            target = ws / "build" / "precision_pipeline" / module
            try:
                target.write_text(mutate(source, pt.index, functions))
                status, secs, tail = _pytest(ws, tests, timeout)
            finally:
                target.write_text(source)
                spaces.put(ws)
            return {**asdict(pt), "status": status, "seconds": round(secs, 1), "source": lines[pt.line - 1].strip(),
                    "last_line": tail}

        results = []
        with cf.ThreadPoolExecutor(jobs) as ex:
            for r in ex.map(one, chosen):
                results.append(r)
                mark = {"killed": ".", "timeout": "T", "survived": "S", "no-tests": "?"}[r["status"]]
                print(mark, end="", flush=True)
    print()
    killed = sum(r["status"] in ("killed", "timeout") for r in results)
    survivors = [r for r in results if r["status"] == "survived"]
    summary = {"module": module, "points": len(points), "run": len(results), "killed": killed,
               "survived": len(survivors), "score": killed / len(results) if results else None, "seed": seed,
               "tests": tests, "survivors": survivors, "results": results}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / (module.replace("/", ".").removesuffix(".py") + ".json")).write_text(json.dumps(summary, indent=1))
    print(f"{module}: score {killed}/{len(results)} = {summary['score']:.1%}")
    for r in survivors:
        print(f"  survived  line {r['line']} ({r['function'] or 'module'}): {r['what']}   | {r['source'][:100]}")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--module", action="append", help="module path under build/precision_pipeline (default: all configured)")
    ap.add_argument("--max-mutants", type=int, default=None, help="sample at most N mutants per module")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--min-score", type=float, default=None, help="exit 1 below this score (0..1) over all modules")
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "mutation")
    a = ap.parse_args(argv)
    cfg = load_config()
    mods = cfg["modules"]
    names = a.module or list(mods)
    unknown = [m for m in names if m not in mods]
    if unknown:
        print(f"error: not configured in [tool.mutate.modules]: {', '.join(unknown)}; configured: {', '.join(mods)}",
              file=sys.stderr)
        return 2
    max_m = a.max_mutants if a.max_mutants is not None else cfg.get("max_mutants")
    sums = [run_module(m, mods[m], max_m, a.seed, a.jobs, a.out) for m in names]
    run = sum(s["run"] for s in sums)
    killed = sum(s["killed"] for s in sums)
    score = killed / run if run else 1.0
    print(f"total: {killed}/{run} killed = {score:.1%}")
    return 1 if a.min_score is not None and score < a.min_score else 0


if __name__ == "__main__":
    raise SystemExit(main())
