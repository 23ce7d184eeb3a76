"""The one strict template renderer (build/precision_pipeline/serving/templates.py) and its two styles."""

from __future__ import annotations

import json

import pytest
import yaml

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import deploy, pack
from precision_pipeline.serving.templates import PBTXT, YAML_VALUE, render


@pytest.mark.parametrize("style", [PBTXT, YAML_VALUE], ids=lambda s: s.name)
def test_unknown_missing_and_unused_are_all_reported(style):
    text = "a: ${alpha}\nb: ${beta}\n"
    with pytest.raises(UserError) as e:
        render(text, {"alpha": 1, "betta": 2, "gamma": 3}, "t.txt", style)
    msg = str(e.value)
    assert "t.txt: parameter 'betta': is not in the template" in msg and "did you mean 'beta'" in msg
    assert "t.txt: parameter 'gamma': is not in the template" in msg  # unused value
    assert "t.txt: ${beta}: is not filled" in msg and "did you mean ${betta}" in msg  # missing value
    with pytest.raises(UserError, match="not opening a \\$\\{name\\} placeholder"):
        render("a: ${alpha}\nb: ${be-ta}\n", {"alpha": 1}, "t.txt", style)  # unknown placeholder syntax
    with pytest.raises(UserError, match="not opening"):
        render("a: ${alpha\n", {}, "t.txt", style)


def test_pbtxt_style_writes_text():
    text = 'b: ${b}\nf: ${f}\ns: "${s}"\n'
    out = render(text, {"b": True, "f": 0.5, "s": 'say "hi" \\ bye'}, "x", PBTXT)
    assert out == 'b: true\nf: 0.5\ns: "say \\"hi\\" \\\\ bye"\n'
    with pytest.raises(UserError, match="line break"):
        render('s: "${s}"\n', {"s": "two\nlines"}, "x", PBTXT)
    assert pack.render_template(text, {"b": False, "f": 1.0, "s": "x"}, "x") == 'b: false\nf: 1.0\ns: "x"\n'


def test_yaml_style_writes_whole_values():
    text = "name: ${name}\nargs:\n  - ${flag}\nlimits: ${limits}\n"
    out = render(text, {"name": "a: b", "flag": True, "limits": {"cpu": 2}}, "k.yaml", YAML_VALUE)
    assert yaml.safe_load(out) == {"name": "a: b", "args": [True], "limits": {"cpu": 2}}
    assert out.splitlines()[0] == "name: " + json.dumps("a: b")
    assert render("name: ${name}\n", {"name": "café"}, "k.yaml", YAML_VALUE) == 'name: "caf\\u00e9"\n'  # ASCII only
    with pytest.raises(UserError, match="line 1: 'name: svc-\\$\\{name\\}': a placeholder must be a whole YAML value"):
        render("name: svc-${name}\n", {"name": "x"}, "k.yaml", YAML_VALUE)
    assert deploy.render_template(text, {"name": "n", "flag": 1, "limits": None}, "k") == \
        render(text, {"name": "n", "flag": 1, "limits": None}, "k", YAML_VALUE)


def test_template_styles_are_frozen():
    import dataclasses

    from precision_pipeline.serving import templates

    with pytest.raises(dataclasses.FrozenInstanceError):
        templates.PBTXT.name = "other"
