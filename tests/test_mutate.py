"""The mutation runner (tests/mutate.py): which points it mutates, and how."""

from __future__ import annotations

import ast

from tests import mutate as M

TOY = '''"""Module docstring 1 + 2."""
__all__ = ["f"]
LIMIT = 3


def f(x: int = 4, flag: bool = True) -> int:
    """Docstring 5 < 6."""
    msg = f"value {x + 1}"
    if x < LIMIT and not flag:
        return x * 2
    y = x - 1  # pragma: no mutate
    return x if x in (1, 2) else 0
'''


def test_points_and_what_they_do():
    got = [(p.line, p.what, p.function) for p in M.enumerate_points(TOY)]
    assert sorted(got) == sorted([
        (3, "3 -> 4", ""),
        (6, "4 -> 5", "f"), (6, "True -> False", "f"),
        (9, "and -> or", "f"), (9, "< -> <=", "f"), (9, "not x -> x", "f"),
        (10, "* -> /", "f"), (10, "2 -> 3", "f"),
        (12, "in -> not in", "f"), (12, "1 -> 2", "f"), (12, "2 -> 3", "f"), (12, "0 -> 1", "f"),
    ])  # docstrings, the f-string, annotations, __all__ and the pragma line are left alone


def test_mutate_applies_exactly_one_point():
    pts = M.enumerate_points(TOY)
    for p in pts:
        out = M.mutate(TOY, p.index)
        assert ast.dump(ast.parse(out)) != ast.dump(ast.parse(TOY)), p
        compile(out, "toy", "exec")
    i = next(p.index for p in pts if p.what == "not x -> x")
    assert "if x < LIMIT and flag:" in M.mutate(TOY, i)
    i = next(p.index for p in pts if p.what == "< -> <=")
    assert "if x <= LIMIT and (not flag):" in M.mutate(TOY, i)


def test_functions_filter():
    assert {p.function for p in M.enumerate_points(TOY, ["f"])} == {"f"}
    assert M.enumerate_points(TOY, ["g"]) == []


CITED = """TABLE: dict = {"a": ("TYPE_INT32", 43), "b": ("TYPE_BOOL", 258)}
OTHER = {"c": 7}


def f(x):
    TABLE = 3
    return x + TABLE
"""


def test_citation_tables_are_not_mutated():
    """``citations``: the named module-level tables' numbers (source line citations) are no mutation points; the
    same name inside a function and other tables still are."""
    every = M.enumerate_points(CITED)
    assert sorted((p.line, p.what) for p in every) == [(1, "258 -> 259"), (1, "43 -> 44"), (2, "7 -> 8"), (6, "3 -> 4"),
                                                       (7, "+ -> -")]
    kept = M.enumerate_points(CITED, citations=["TABLE"])
    assert sorted((p.line, p.what) for p in kept) == [(2, "7 -> 8"), (6, "3 -> 4"), (7, "+ -> -")]
    i = next(p.index for p in kept if p.what == "7 -> 8")
    assert "OTHER = {'c': 8}" in M.mutate(CITED, i, citations=["TABLE"])
    spec = M.load_config()["modules"]["serving/backend_contract.py"]
    assert set(spec["citations"]) == {"REQUIRED_PARAMETERS", "DEFAULTED_PARAMETERS", "INPUTS", "OUTPUTS"}


def test_every_module_is_covered_and_has_tests():
    """Every package module and Triton model with a mutation point is scored, each with tests."""
    mods = M.discover_modules()
    assert {"serving/rollout.py", "serving/probe.py", "checkpoint/scales.py", "gate/checkpoint_gate.py",
            "triton_repo/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/model.py",
            "triton_repo/backends/tensorrtllm/model.py"} <= set(mods)
    tmap = M.test_map(mods)
    cfg = M.load_config()
    assert [m for m in mods if not M.selection(m, cfg, tmap)[0]] == []
    # the static import map: a direct import, the most specific test file first
    assert tmap["serving/rollout.py"][0].startswith("tests/serving/test_rollout")
    assert "tests/serving/test_probe_model_dir.py" in tmap["serving/probe.py"]
    # a Triton model runs only in a real server: the server tests, slow ones included
    tests, marker, _ = M.selection("triton_repo/all_models/inflight_batcher_llm/postprocessing/1/model.py", cfg, tmap)
    assert "tests/serving/test_serve.py" in tests and marker == "not gpu"
    # the BLS is configured with its server-free tests (a stand-in triton_python_backend_utils)
    tests, _, _ = M.selection("triton_repo/all_models/inflight_batcher_llm/tensorrt_llm_bls/1/model.py", cfg, tmap)
    assert tests == ["tests/serving/test_bls_routing.py"]
    # a module whose tests are all slow runs them; one with fast tests runs only those
    assert M._has_fast_tests(["tests/serving/test_pack.py"]) and not M._has_fast_tests(["tests/serving/test_serve.py"])


def test_equivalent_mutants_are_matched_by_line_text_and_mutation():
    spec = {"equivalent": [{"source": "if n_boot <= 0:", "what": "<= -> <", "why": "no interval either way"}]}
    assert M._equivalent(spec, {"source": "if n_boot <= 0:  # x", "what": "<= -> <", "function": "f"}) == "no interval either way"
    assert M._equivalent(spec, {"source": "if n_boot <= 0:", "what": "0 -> 1", "function": "f"}) is None


def test_configured_modules_exist_and_have_tests():
    cfg = M.load_config()
    known = set(M.discover_modules())
    for module, spec in cfg["modules"].items():
        assert module in known, module
        src = M.module_path(module).read_text()
        assert M.enumerate_points(src, spec.get("functions")), module
        for t in spec.get("tests", []):
            if t.startswith("tests/"):
                assert (M.ROOT / t.split("::")[0]).is_file(), t


def test_every_equivalent_entry_names_a_line_of_its_module():
    """An ``equivalent`` entry whose line text is no longer in its module (edited or moved) would silently stop
    matching: each entry's ``source`` is in the module's source, its ``what`` is a mutation of that line, and its
    ``function`` (when given) is that line's function."""
    cfg = M.load_config()
    for module, spec in cfg.get("modules", {}).items():
        src = M.module_path(module).read_text()
        lines = src.splitlines()
        points = M.enumerate_points(src, spec.get("functions"), spec.get("citations"))
        for e in spec.get("equivalent", []):
            assert e["source"] in src, (module, e["source"])
            assert e.get("why"), (module, e["source"])
            hits = [p for p in points if e["source"] in lines[p.line - 1] and p.what == e["what"]
                    and (not e.get("function") or p.function == e["function"])]
            assert hits, (module, e["source"], e["what"], e.get("function"))
