"""Plan details that mutation testing found unpinned (issue 12): one_line, the frozen plan, the
fallback summary, check_all's "(+N more)"."""

from __future__ import annotations

import pytest

from precision_pipeline.core.errors import Problem
from precision_pipeline.resolve import plan as P
from tests.conftest import prof


def test_one_line_is_field_reason_fix_rule():
    assert P.one_line(Problem("a.b", "is bad.", "fix it.", "r.x")) == "a.b: is bad. Fix: fix it. (rule r.x)"
    assert P.one_line(Problem("a.b", "is bad.")) == "a.b: is bad."


def test_the_plan_is_frozen(default_model_dir):
    plan = P.evaluate(prof("fp8-h100"), default_model_dir)
    with pytest.raises(Exception):
        plan.warnings = ()
    with pytest.raises(Exception):
        plan.limits.max_seq_len = 1


def test_a_fallback_that_does_not_load_is_not_ok(default_model_dir):
    plan = P.evaluate(prof("fp8-h100", deployment__fallback="no-such-profile"), default_model_dir)
    assert plan.fallback is not None and plan.fallback.ok is False
    assert "deployment.fallback" in {p.rule for p in plan.problems}
    good = P.evaluate(prof("fp8-h100", deployment__warm_fallback=False), default_model_dir)
    assert good.fallback.ok is True and good.fallback.memory is None
    rendered = good.to_json()["fallback"]
    assert rendered["profile"] == "bf16-h100" and "memory" not in rendered and None not in rendered.values()


def test_check_all_counts_the_other_problems(default_model_dir, tmp_path, monkeypatch):
    import shutil

    from precision_pipeline.spec import profile as profile_mod

    shipped = tmp_path / "profiles"
    shutil.copytree(profile_mod.PROFILES_DIR, shipped)
    (shipped / "zz-bad.yaml").write_text("target:\n  gpu: h100\nbuild:\n  max_batch_size: 0\n  tokens_per_block: 0\n"
                                         "  max_beam_width: 0\n")
    (shipped / "zz-two.yaml").write_text("target:\n  gpu: h100\nbuild:\n  max_batch_size: 0\n  max_beam_width: 0\n")
    (shipped / "zz-one.yaml").write_text("target:\n  gpu: h100\nbuild:\n  max_batch_size: 0\n")
    monkeypatch.setattr(profile_mod, "PROFILES_DIR", shipped)
    rows = {n: (ok, line) for n, ok, line in P.check_all(default_model_dir)}
    ok, line = rows["zz-bad"]
    assert ok is False and line.startswith("build.max_batch_size: ") and line.endswith(" (+2 more)"), line
    assert rows["zz-two"][1].startswith("build.max_batch_size: ") and rows["zz-two"][1].endswith(" (+1 more)")
    assert rows["zz-one"][1].startswith("build.max_batch_size: ") and "more)" not in rows["zz-one"][1]
    assert all(ok for n, (ok, _) in rows.items() if not n.startswith("zz-"))
