"""The import layers of build/precision_pipeline, read with ``ast`` (nothing is imported).

Every ``import`` counts: module level and inside functions (a function-level import runs when the
function does), except those under ``if TYPE_CHECKING:``. Four rules:

(a) no import cycles between modules;
(b) no ``_private`` name of one module is imported (or read as ``module._name``) by another;
(c) core/, spec/ and resolve/ need no torch: nothing they import, transitively (implicit parent
    packages included), is torch, transformers, modelopt or safetensors.torch;
(d) a module imports only modules of its own layer or of lower layers (``LAYERS``).

The layer order is the one the code has (derived from its imports; resolve -> quantize is the one
edge against it, removed by the format-registry branch):

====  ==========  ====================================================================
rank  layer       what it is
====  ==========  ====================================================================
0     core        errors, store, paths: no project imports
1     spec        profile, formats, hardware, model architecture, default model
2     resolve     plan and rules: spec in, plan out; torch-free
3     checkpoint  reading exported TensorRT-LLM checkpoints
4     quantize    calibration, ModelOpt PTQ, mixed-precision search, MoE re-sharding
5     gate        golden set, the checkpoint gate and its report, the engine gate
6     engine      the trtllm-build command
7     serving     templates, Triton repository, releases, manifests, local server
8     analysis    per-layer sensitivity (uses the gate and the checkpoint reader)
9     pipeline    the stage runner (pipeline.py)
10    nightly     the nightly rebuild over many profiles (nightly.py: runs run_prepared per profile)
11    cli         what each ``invoke`` task calls and prints (cli/: build, serving, choose, sensitivity)
====  ==========  ====================================================================

Parts that fail because of code the format-registry branch rewrites are ``xfail(strict=True)``
(``KNOWN``): when that branch lands they pass, and strict turns the pass into a failure so that the
mark is removed.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SOURCE_ROOT = Path(__file__).resolve().parents[1] / "build"
PACKAGE = "precision_pipeline"

LAYERS: dict[str, int] = {"core": 0, "spec": 1, "resolve": 2, "checkpoint": 3, "quantize": 4, "gate": 5,
                          "engine": 6, "serving": 7, "analysis": 8, "pipeline": 9, "nightly": 10,
                          "cli": 11}
TORCH_FREE = ("core", "spec", "resolve")
NEEDS_TORCH = ("torch", "transformers", "modelopt", "safetensors.torch")
# functions of the torch-free layers allowed to import torch, and why; no torch-free module may import them
SET_UP_ONLY: dict[tuple[str, str], str] = {
    ("precision_pipeline.spec.default_model", "ensure_default_model"):
        "the one-time GGUF -> HF conversion of the default model (run.sh, quantize); resolve never runs it",
    ("precision_pipeline.spec.device", "probe_cuda"):
        "asks torch.cuda which GPUs a build may use (spec.device.choose_device, once per build); resolve gets its result",
}

REGISTRY_BRANCH = "fixed by the format registry branch"
KNOWN: dict[tuple[str, str], str] = {}  # none left: the format registry removed the cycle and private imports


# ------------------------------------------------------------------------------------------------
# Reading the imports


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    internal: dict[str, int] = field(default_factory=dict)   # project module -> first line importing it
    external: dict[str, int] = field(default_factory=dict)   # other module (dotted) -> line
    function_of: dict[int, str] = field(default_factory=dict)  # line -> name of the enclosing function
    private: list[tuple[int, str]] = field(default_factory=list)  # (line, "module._name")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` (they never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for child in node.body:
                    skip.update(id(n) for n in ast.walk(child))
    return skip


def read_modules(root: Path = SOURCE_ROOT) -> dict[str, Module]:
    mods: dict[str, Module] = {}
    for p in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        mods[".".join(parts)] = Module(".".join(parts), p, is_pkg)
    for m in mods.values():
        tree = ast.parse(m.path.read_text(), filename=str(m.path))
        skip = _type_checking_nodes(tree)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for n in ast.walk(fn):
                    if isinstance(n, (ast.Import, ast.ImportFrom)):
                        m.function_of.setdefault(n.lineno, fn.name)  # outermost function wins (walk order)
        aliases: dict[str, str] = {}  # local name -> project module it is bound to

        def note(target: str, line: int, names: tuple[str, ...] = (), module: Module = m) -> None:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                for n in names:  # from pkg import submodule
                    if f"{target}.{n}" in mods:
                        module.internal.setdefault(f"{target}.{n}", line)
                    else:
                        module.internal.setdefault(target, line)
                if not names:
                    module.internal.setdefault(target, line)
            else:
                module.external.setdefault(target, line)
                for n in names:
                    module.external.setdefault(f"{target}.{n}", line)

        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                for a in node.names:
                    note(a.name, node.lineno)
                    if a.name.startswith(PACKAGE) and a.asname:
                        aliases[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = m.name.split(".") if m.is_package else m.name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = tuple(a.name for a in node.names)
                note(target, node.lineno, names)
                if target.startswith(PACKAGE):
                    for a in node.names:
                        full = f"{target}.{a.name}"
                        if full in mods:
                            aliases[a.asname or a.name] = full
                        elif _is_private(a.name) and target != m.name:
                            m.private.append((node.lineno, f"{target}.{a.name}"))
        for node in ast.walk(tree):  # module._name on an imported project module
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and _is_private(node.attr) and aliases[node.value.id] != m.name and id(node) not in skip):
                m.private.append((node.lineno, f"{aliases[node.value.id]}.{node.attr}"))
    return mods


def layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "core"  # the package's own __init__ imports nothing


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself), Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in mods[v].internal:
            if w not in mods:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in mods[v].internal:
                out.append(sorted(comp))

    for v in sorted(mods):
        if v not in index:
            visit(v)
    return out


def torch_path(mods: dict[str, Module], start: str) -> list[str] | None:
    """The import chain from ``start`` to a module that needs torch, or None. Parent packages count
    (importing a.b.c runs a/__init__.py and a/b/__init__.py first)."""

    def needs_torch(v: str, ext: str) -> bool:
        if (v, mods[v].function_of.get(mods[v].external[ext], "")) in SET_UP_ONLY:
            return False
        return any(ext == f or ext.startswith(f + ".") for f in NEEDS_TORCH)

    def deps(v: str) -> list[str]:
        parts = v.split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts))]
        return [p for p in parents if p in mods] + sorted(w for w in mods[v].internal if w in mods)

    prev: dict[str, str | None] = {start: None}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        bad = sorted(e for e in mods[v].external if needs_torch(v, e))
        if bad:
            chain = [f"{bad[0]} (line {mods[v].external[bad[0]]})"]
            node: str | None = v
            while node is not None:
                chain.append(node)
                node = prev[node]
            return chain[::-1]
        for w in deps(v):
            if w not in prev:
                prev[w] = v
                queue.append(w)
    return None


MODS = read_modules()


def _params(kind: str, names) -> list:
    return [pytest.param(n, id=n.removeprefix(PACKAGE + "."),
                         marks=[pytest.mark.xfail(strict=True, reason=KNOWN[(kind, n)])] if (kind, n) in KNOWN else [])
            for n in sorted(names)]


# ------------------------------------------------------------------------------------------------
# The rules


def test_the_reader_sees_the_package():
    assert len(MODS) > 30 and "precision_pipeline.pipeline" in MODS
    assert "precision_pipeline.gate.metrics" in MODS["precision_pipeline.analysis.sensitivity"].internal
    assert "torch" in MODS["precision_pipeline.gate.checkpoint_gate"].external
    # function-level imports count
    assert "precision_pipeline.gate.report" in MODS["precision_pipeline.gate.checkpoint_gate"].internal
    assert set(LAYERS) == {layer_of(m) for m in MODS}, "a new sub-package: give it a rank in LAYERS"


@pytest.mark.parametrize("module", _params("cycle", MODS))
def test_no_import_cycle(module):
    """(a) the module is in no import cycle."""
    mine = [c for c in cycles(MODS) if module in c]
    assert not mine, f"{module} is in the import cycle {' <-> '.join(mine[0])}"


@pytest.mark.parametrize("module", _params("private", MODS))
def test_no_private_import_across_modules(module):
    """(b) no ``from x import _name`` / ``x._name`` of another project module."""
    assert not MODS[module].private, ", ".join(f"line {ln}: {n}" for ln, n in MODS[module].private)


@pytest.mark.parametrize("module", _params("torch", [m for m in MODS if layer_of(m) in TORCH_FREE]))
def test_torch_free_layers_need_no_torch(module):
    """(c) core/, spec/ and resolve/ reach no torch through any import."""
    chain = torch_path(MODS, module)
    assert chain is None, " -> ".join(chain)


def test_set_up_only_functions_stay_out_of_the_torch_free_layers():
    for (owner, fn), why in SET_UP_ONLY.items():
        assert fn in {n.name for n in ast.walk(ast.parse(MODS[owner].path.read_text()))
                      if isinstance(n, ast.FunctionDef)}, (owner, fn)
        users = [m for m in MODS if layer_of(m) in TORCH_FREE and m != owner
                 and fn in MODS[m].path.read_text()]
        assert not users, f"{', '.join(users)} use {fn} ({why})"


@pytest.mark.parametrize("module", _params("layer", MODS))
def test_imports_go_down_the_layers(module):
    """(d) imports stay in the module's layer or go to a lower one."""
    mine = LAYERS[layer_of(module)]
    up = sorted(f"{t} ({layer_of(t)}, line {ln})" for t, ln in MODS[module].internal.items()
                if t in MODS and LAYERS[layer_of(t)] > mine)
    assert not up, f"{module} ({layer_of(module)}) imports upwards: {', '.join(up)}"


# ------------------------------------------------------------------------------------------------
# The checks catch what they are meant to catch (a tree written here)


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Module]:
    for rel, text in files.items():
        p = tmp_path / PACKAGE / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return read_modules(tmp_path)


def test_checks_on_a_bad_tree(tmp_path):
    mods = _tree(tmp_path, {
        "__init__.py": "", "core/__init__.py": "", "resolve/__init__.py": "", "quantize/__init__.py": "",
        "core/a.py": "def f():\n    from precision_pipeline.core import b\n",
        "core/b.py": "import precision_pipeline.core.a\n",
        "resolve/r.py": "from precision_pipeline.quantize.q import _helper, ok\n",
        "quantize/q.py": "import torch\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    from precision_pipeline.resolve import r\n_helper = ok = 1\n",
        "quantize/u.py": "from precision_pipeline.quantize import q as qq\nx = qq._helper\nfrom . import q\n",
    })
    assert cycles(mods) == [["precision_pipeline.core.a", "precision_pipeline.core.b"]]  # the TYPE_CHECKING one is not
    assert mods["precision_pipeline.resolve.r"].private == [(1, "precision_pipeline.quantize.q._helper")]
    assert mods["precision_pipeline.quantize.u"].private == [(2, "precision_pipeline.quantize.q._helper")]
    assert "precision_pipeline.quantize.q" in mods["precision_pipeline.quantize.u"].internal  # relative import
    assert torch_path(mods, "precision_pipeline.resolve.r") == [
        "precision_pipeline.resolve.r", "precision_pipeline.quantize.q", "torch (line 1)"]
    assert torch_path(mods, "precision_pipeline.core.a") is None
    assert LAYERS[layer_of("precision_pipeline.resolve.r")] < LAYERS[layer_of("precision_pipeline.quantize.q")]


# ------------------------------------------------------------------------------------------------
# Stages never re-resolve

STAGE_PACKAGES = ("checkpoint", "quantize", "gate", "engine", "serving")
RESOLVING = ("precision_pipeline.resolve.rules", "precision_pipeline.resolve.rules_fit",
             "precision_pipeline.resolve.registry")
PLAN_TYPES = {"ResolvedPlan", "Mapping", "Limits", "Effective", "MemoryPlan", "WeightBreakdown", "OverrideRecord",
              "FallbackInfo", "FallbackMemory"}
"""What a stage may import of ``resolve.plan``: the typed plan it is handed (its sections), never ``evaluate`` /
``resolve`` / ``check_all`` (which re-run the rules)."""


def _resolving_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [f"line {node.lineno}: import {a.name}" for a in node.names
                    if a.name in RESOLVING or a.name == "precision_pipeline.resolve.plan"]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [a.name for a in node.names]
            if node.module in RESOLVING:
                out.append(f"line {node.lineno}: from {node.module} import {', '.join(names)}")
            elif node.module == "precision_pipeline.resolve.plan":
                out += [f"line {node.lineno}: from {node.module} import {n}" for n in names if n not in PLAN_TYPES]
            elif node.module == "precision_pipeline.resolve":
                out += [f"line {node.lineno}: from precision_pipeline.resolve import {n}" for n in names
                        if f"precision_pipeline.resolve.{n}" in RESOLVING or n == "plan"]
    return out


@pytest.mark.parametrize("module", sorted(m for m in MODS if layer_of(m) in STAGE_PACKAGES))
def test_stages_never_re_resolve(module):
    """No module of a stage package imports the resolve rules (``resolve.rules``, ``rules_fit``, ``registry``) or
    anything of ``resolve.plan`` but its types: a stage receives the resolved facts in its inputs."""
    assert not _resolving_imports(MODS[module].path), _resolving_imports(MODS[module].path)


def test_the_re_resolve_check_sees_a_stage_that_evaluates(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from precision_pipeline.resolve.plan import evaluate, ResolvedPlan\n"
                 "from precision_pipeline.resolve import rules as R\n")
    assert sorted(_resolving_imports(p)) == ["line 2: from precision_pipeline.resolve.plan import evaluate",
                                             "line 3: from precision_pipeline.resolve import rules"]
