"""One strict ``${name}`` template renderer for the serving files (Triton config.pbtxt, Kubernetes YAML).

``render(text, params, where, style)`` fills every ``${name}`` placeholder of ``text`` and refuses,
as one ``UserError`` listing every problem (each prefixed with ``where``):

* a parameter the template has no placeholder for (an unused value; with the closest placeholder name);
* a placeholder no parameter fills (a missing value; with the closest parameter name);
* a ``${`` that does not open a well-formed ``${name}`` placeholder (an unknown placeholder);
* whatever the style refuses (``TemplateStyle.problems``).

How a value becomes text is the style's: ``PBTXT`` writes values into config.pbtxt text (booleans
``true``/``false``, floats by ``repr``, quotes and backslashes escaped for pbtxt strings; one-line
values only); ``YAML_VALUE`` writes each value as JSON (JSON is YAML) and requires every placeholder
to be a whole YAML value (``key: ${x}``, ``- ${x}``, ``- key: ${x}``), since a value quoted inside a
larger string (``name: x-${a}``) would not survive.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from precision_pipeline.core.errors import Problem, UserError, closest

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""A placeholder: ``${`` + an identifier + ``}``."""


def placeholders(text: str) -> set[str]:
    """Names of the ``${name}`` placeholders in ``text``."""
    return set(PLACEHOLDER.findall(text))


@dataclass(frozen=True)
class TemplateStyle:
    """How one file format turns a parameter value into template text.

    ``format_value(value) -> str``: the text that replaces ``${name}``. ``problems(text, params, where)``:
    what this format refuses beyond the shared checks (empty list when nothing).
    """

    name: str
    format_value: Callable[[Any], str]
    problems: Callable[[str, Mapping[str, Any], str], list[Problem]]


def pbtxt_text(v: Any) -> str:
    """A value as config.pbtxt writes it, before escaping: ``true``/``false``, floats by ``repr``, else ``str``."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    return str(v)


def _pbtxt_value(v: Any) -> str:
    # values land inside quoted pbtxt strings or as bare numbers/enums; escaping quotes and backslashes
    # keeps strings intact (a bare value with them fails the Triton parse that follows rendering)
    return pbtxt_text(v).replace("\\", "\\\\").replace('"', '\\"')


def _pbtxt_problems(text: str, params: Mapping[str, Any], where: str) -> list[Problem]:
    out = []
    for key, v in params.items():
        if any(c in pbtxt_text(v) for c in "\n\r\0"):
            out.append(Problem(f"{where}: parameter {key!r}", f"value {str(v)!r} contains a line break or NUL.",
                               "use a one-line value."))
    return out


# a placeholder must be a whole value: "key: ${x}", "- ${x}" or "- key: ${x}"
_WHOLE_YAML_VALUE = re.compile(r"^\s*(?:-\s+)?(?:[A-Za-z0-9_./-]+:\s+)?\$\{[^}]*\}\s*(?:#.*)?$")


def _yaml_problems(text: str, params: Mapping[str, Any], where: str) -> list[Problem]:
    return [Problem(f"{where}: line {n}", f"{line.strip()!r}: a placeholder must be a whole YAML value.",
                    "write 'key: ${name}' or '- ${name}' and compute the value in "
                    "build/precision_pipeline/serving/deploy.py.")
            for n, line in enumerate(text.splitlines(), 1) if "${" in line and not _WHOLE_YAML_VALUE.match(line)]


PBTXT = TemplateStyle("config.pbtxt text", _pbtxt_value, _pbtxt_problems)
YAML_VALUE = TemplateStyle("whole YAML value", lambda v: json.dumps(v, ensure_ascii=True), _yaml_problems)


def render(text: str, params: Mapping[str, Any], where: str, style: TemplateStyle) -> str:
    """Fill every ``${name}`` of ``text`` from ``params`` in ``style``; ``UserError`` listing all problems (module doc)."""
    wanted = placeholders(text)
    problems: list[Problem] = []
    for key in sorted(set(params) - wanted):
        hint = closest(key, wanted)
        problems.append(Problem(f"{where}: parameter {key!r}", "is not in the template.",
                                f"did you mean {hint!r}?" if hint
                                else f"template parameters: {', '.join(sorted(wanted)) or '(none)'}."))
    for key in sorted(wanted - set(params)):
        hint = closest(key, list(params))
        problems.append(Problem(f"{where}: ${{{key}}}", "is not filled.",
                                f"did you mean ${{{hint}}}?" if hint else "give a value for it (no silent defaults)."))
    stray = text.count("${") - len(PLACEHOLDER.findall(text))
    if stray:
        problems.append(Problem(where, f"has {stray} '${{' not opening a ${{name}} placeholder.",
                                "write placeholders as ${name} (letters, digits, underscores)."))
    problems += style.problems(text, params, where)
    if problems:
        raise UserError(problems)
    return PLACEHOLDER.sub(lambda m: style.format_value(params[m.group(1)]), text)


__all__ = ["render", "placeholders", "pbtxt_text", "TemplateStyle", "PBTXT", "YAML_VALUE", "PLACEHOLDER"]
