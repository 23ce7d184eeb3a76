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


def test_configured_modules_exist_and_have_tests():
    cfg = M.load_config()
    assert {"resolve/rules.py", "spec/formats.py", "resolve/plan.py", "checkpoint/codecs.py", "gate/checkpoint_gate.py",
            "serving/pack.py", "serving/release.py", "serving/deploy.py", "core/stage.py"} <= set(cfg["modules"])
    for module, spec in cfg["modules"].items():
        src = (M.PACKAGE / module).read_text()
        assert M.enumerate_points(src, spec.get("functions")), module
        for t in spec["tests"]:
            if t.startswith("tests/"):
                assert (M.ROOT / t.split("::")[0]).is_file(), t
