"""The strict YAML reader of profiles: one document, no duplicate keys, no YAML 1.1 number surprises (octal,
base 60, ``_`` separators, binary, unquoted dates), no ``!!binary``, and alias expansion bounded by ``MAX_YAML_NODES``; files
bounded by ``MAX_PROFILE_BYTES``. Each refusal is a ``UserError`` naming the field (spec/profile.py's module
doc lists the rules)."""

from __future__ import annotations

import math
import re
import reprlib
from pathlib import Path
from typing import Any, Optional

import yaml

from precision_pipeline.core.errors import UserError

MAX_PROFILE_BYTES = 256 * 1024
MAX_YAML_NODES = 20_000  # a full profile has about 150 nodes; aliases may not expand beyond this

_REPR = reprlib.Repr()
_REPR.maxstring, _REPR.maxother, _REPR.maxlist, _REPR.maxdict, _REPR.maxlevel = 60, 60, 4, 4, 2


def short(value: Any) -> str:
    """A bounded ``repr`` (never formats a whole input: a huge value costs nothing to describe)."""
    return _REPR.repr(value)


class _ProfileLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses duplicate keys and alias expansion beyond ``MAX_YAML_NODES``."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:  # ``<<: *base``: merged by SafeConstructor.flatten_mapping, own keys win
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # unhashable key: PyYAML refuses it below
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {short(key)} (first at line {first}, again at line {line}); "
                    "YAML keeps only the last one, which silently drops the first", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


    def construct_yaml_int(self, node):
        why = _yaml11_number_problem(self.construct_scalar(node), "int")
        if why:
            raise yaml.constructor.ConstructorError(None, None, why, node.start_mark)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        why = _yaml11_number_problem(self.construct_scalar(node), "float")
        if why:
            raise yaml.constructor.ConstructorError(None, None, why, node.start_mark)
        return super().construct_yaml_float(node)

    def construct_yaml_bool(self, node):
        t = self.construct_scalar(node)
        if t.strip().lower() not in ("true", "false"):  # yes/no/on/off: YAML 1.1 booleans, text in YAML 1.2
            raise yaml.constructor.ConstructorError(
                None, None, f"{short(t)} is a YAML 1.1 boolean (PyYAML reads it as {str(super().construct_yaml_bool(node)).lower()}) "
                "and text in YAML 1.2; write true or false", node.start_mark)
        return super().construct_yaml_bool(node)

    def construct_yaml_timestamp(self, node):
        t = self.construct_scalar(node)  # 2001-12-14 (or with a time): a YAML 1.1 timestamp, text in YAML 1.2
        raise yaml.constructor.ConstructorError(
            None, None, f"{short(t)} is a YAML 1.1 timestamp (PyYAML reads it as a date) and text in YAML 1.2; "
            f"quote it if it is text ('{t[:60]}'); no profile field takes a date", node.start_mark)

    def construct_yaml_binary(self, node):
        raise yaml.constructor.ConstructorError(
            None, None, "!!binary (base64 bytes) is not a profile value; profiles hold text, numbers and booleans "
            "(write the text itself, without the !!binary tag)", node.start_mark)


_MERGE_TAG = "tag:yaml.org,2002:merge"
_ProfileLoader.add_constructor("tag:yaml.org,2002:int", _ProfileLoader.construct_yaml_int)
_ProfileLoader.add_constructor("tag:yaml.org,2002:float", _ProfileLoader.construct_yaml_float)
_ProfileLoader.add_constructor("tag:yaml.org,2002:binary", _ProfileLoader.construct_yaml_binary)
_ProfileLoader.add_constructor("tag:yaml.org,2002:bool", _ProfileLoader.construct_yaml_bool)
_ProfileLoader.add_constructor("tag:yaml.org,2002:timestamp", _ProfileLoader.construct_yaml_timestamp)


def _yaml11_number_problem(text: str, kind: str) -> Optional[str]:
    """Why ``text`` (a plain scalar PyYAML resolves as a YAML 1.1 number) would be read differently by YAML 1.2,
    or None. PyYAML implements YAML 1.1 (resolver.py: ``0[0-7_]+`` is octal, ``[0-9]+(:[0-5]?[0-9])+`` is base 60,
    ``_`` is ignored, ``0b...`` is binary), YAML 1.2's core schema has none of these (``064`` is 64, ``1:04`` a
    string). Such a value is refused with what it would silently have become, instead of being guessed."""
    t = text.strip()
    body = t.lstrip("+-")
    if ":" in body:
        return (f"{short(t)} is a base-60 number in YAML 1.1 (PyYAML reads it as "
                f"{short(_yaml11_value(t, kind))}) and text in YAML 1.2; write the plain number, or quote it if it is text")
    if kind == "int" and re.fullmatch(r"0[0-9_]+", body):
        return (f"{short(t)} has a leading zero: YAML 1.1 (PyYAML) reads it as octal {short(_yaml11_value(t, kind))}, "
                f"YAML 1.2 as {int(body.replace('_', ''))}; write it without the leading zero "
                f"({'-' if t.startswith('-') else ''}{int(body.replace('_', ''))})")
    if kind == "int" and body.lower().startswith("0b"):
        return f"{short(t)} is a YAML 1.1 binary number (not YAML 1.2); write it in decimal"
    if "_" in body:
        return (f"{short(t)}: YAML 1.1 (PyYAML) drops the '_' and reads {short(_yaml11_value(t, kind))}, YAML 1.2 "
                "reads text; write the number without '_'")
    return None


def _yaml11_value(text: str, kind: str) -> Any:
    c = yaml.constructor.SafeConstructor()
    node = yaml.ScalarNode(f"tag:yaml.org,2002:{kind}", text)
    try:
        return c.construct_yaml_int(node) if kind == "int" else c.construct_yaml_float(node)
    except (ValueError, yaml.YAMLError):
        return text


def _expanded_nodes(node: yaml.Node, memo: dict[int, int]) -> int:
    """Nodes the document has once every alias is expanded (linear time: shared nodes memoized)."""
    n = memo.get(id(node))
    if n is not None:
        return n
    memo[id(node)] = MAX_YAML_NODES + 1  # a node reached again while being counted: recursive alias
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded_nodes(c, memo) for c in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(_expanded_nodes(k, memo) + _expanded_nodes(v, memo) for k, v in node.value)
    else:
        n = 1
    memo[id(node)] = n
    return n


def safe_load(text: str) -> Any:
    """Parse one YAML document strictly (see the module docstring). Raises ``yaml.YAMLError``."""
    loader = _ProfileLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_nodes(node, {})
        if size > MAX_YAML_NODES:
            raise yaml.YAMLError(f"anchors and aliases expand to more than {MAX_YAML_NODES:,} nodes "
                                 "(an alias bomb, or a profile far larger than any real one)")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_yaml(path: Path, field: str) -> dict:
    """The mapping of the profile file ``path`` (``safe_load``; an empty file is {}). UserError on ``field`` if it
    cannot be read, is too large, is not UTF-8 or YAML, or holds something other than a mapping."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise UserError(field, f"cannot read {path}: {e.strerror}.", "give an existing YAML file or a shipped profile name.")
    if size > MAX_PROFILE_BYTES:
        raise UserError(field, f"{path} is {size} bytes; profiles are at most {MAX_PROFILE_BYTES}.", "trim the file.")
    try:
        data = safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UserError(field, f"{path} is not UTF-8 text.", "save the profile as UTF-8 YAML.")
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(e, "problem", None) or str(e)
        raise UserError(field, f"{path} is not valid YAML{where}: {what}.", "fix the YAML.")
    except ValueError as e:  # e.g. an integer of more than 4300 digits (Python's int limit)
        raise UserError(field, f"{path} holds a value that cannot be read: {str(e)[:120]}.", "fix the value.")
    except RecursionError:
        raise UserError(field, f"{path} is nested too deeply.", "flatten the YAML.")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(field, f"{path} holds a {type(data).__name__}, not a mapping of profile fields.",
                        "start the file with keys such as 'target:' and 'quantization:'.")
    return data


def number_as_text(v: Any) -> str:
    """`` | fix: write N (...)`` when ``v`` is text that is a number but PyYAML (YAML 1.1) reads as text even
    unquoted (``1e2``, ``5e-2``: YAML 1.1 floats need a dot and a signed exponent; ``0o10``: YAML 1.2's octal
    form is text in YAML 1.1); "" otherwise (then it was
    quoted, and the fix is to drop the quotes)."""
    if not isinstance(v, str) or len(v) > 40:
        return ""
    if re.fullmatch(r"[-+]?0o[0-7]+", v):  # YAML 1.2's octal form: text to YAML 1.1 (PyYAML reads 0o10 as '0o10')
        n = int(v.replace("0o", ""), 8)
        return (f" | fix: write {n} ({v} is YAML 1.2's octal form; YAML 1.1, which PyYAML reads, takes it as text; "
                "profiles write numbers in decimal).")
    try:
        f = float(v)
        bare = yaml.safe_load(v)
    except (ValueError, yaml.YAMLError):
        return ""
    if not math.isfinite(f) or not isinstance(bare, str):
        return ""
    plain = str(int(f)) if f.is_integer() and abs(f) < 1e15 else repr(f)
    return (f" | fix: write {plain} (YAML 1.1, which PyYAML reads, takes {v} as text: its exponent form needs a dot "
            "and a signed exponent, 1.0e+2).")


def deep_merge(base: Any, over: Any) -> Any:
    """Merge ``over`` onto ``base``: mappings key by key (recursively); lists and scalars replace."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = deep_merge(base[k], v) if k in base else v
        return out
    return over



def merge_profiles(parent: dict, child: dict) -> dict:
    """``child`` merged over its ``extends`` parent (``deep_merge``), with one rule more: a gate field the child sets
    (``gate.kl_p99_max: 0.0001``) also replaces that field in every ``gate.overrides`` entry the child inherits and
    does not restate, so the last word about a bar holds (hostile s12 F-S: the shipped fp8-h100's override for the
    default model kept 0.55 and silently shadowed a child's tighter bar). An override the child writes itself wins
    as before; fields the override leaves unset already fall back to the profile's."""
    merged = deep_merge(parent, child)
    cg, mg = child.get("gate"), merged.get("gate")
    if not (isinstance(cg, dict) and isinstance(mg, dict) and isinstance(mg.get("overrides"), dict)):
        return merged
    own = {k: v for k, v in cg.items() if k != "overrides"}
    restated = cg["overrides"] if isinstance(cg.get("overrides"), dict) else {}
    mg["overrides"] = {fp: e if fp in restated or not isinstance(e, dict) else {**e, **{k: own[k] for k in own if k in e}}
                       for fp, e in mg["overrides"].items()}
    return merged


__all__ = ["deep_merge", "merge_profiles", "MAX_PROFILE_BYTES", "MAX_YAML_NODES", "short", "safe_load", "read_yaml", "number_as_text"]
