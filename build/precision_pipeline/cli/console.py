"""The CLI's console, its one rendering of an error (the exit code is ``core.errors.exit_code_for``'s), the build
table, and the flag parsers (each refusal a UserError naming the flag)."""

from __future__ import annotations

import contextlib
import math
import os
import stat
import sys
import traceback

LOG_WIDTH = 160
"""Columns of a table printed into a log (not a terminal): rich's default of 80 cut every wide table
(build, compare) into unreadable fragments; a terminal keeps its own width. ``COLUMNS`` overrides."""


def console(stderr: bool = False):
    """The rich console of a task's output (stdout); ``stderr=True``: of its errors (hostile s12 F-J: a refusal on
    stdout went into `build --on k8s > job.yaml` and left the terminal silent)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if stream.isatty() or os.environ.get("COLUMNS") else LOG_WIDTH
    return Console(stderr=stderr, highlight=False, width=width)


def report(exc: BaseException) -> int:
    """Print what ended a task (call it from the ``except`` block) and return its exit code
    (``core.errors.exit_code_for``): a user error's problems (and what a stage had written before it refused),
    an expected failure's sentence, a full disk's file and cause; a traceback only for an internal error (1)."""
    from precision_pipeline.core.errors import EXIT_BROKEN_PIPE, error_text, exit_code_for

    code = exit_code_for(exc)
    try:
        if isinstance(exc, OSError) and not exc.filename and code != EXIT_BROKEN_PIPE and _stdout_full():
            raise exc  # the task's own output failed (`> /dev/full`, a redirect to a full disk): said below, as that
        _print_report(exc, code)
    except OSError as e:  # stdout itself cannot be written (`> /dev/full`, a full disk under a redirect): hostile s9 F5
        _silence_stdout()  # nor at exit, when Python flushes what is left
        what = (f"cannot write the standard output: {e.strerror or e} (a redirect to a full disk or /dev/full?)"
                if isinstance(exc, OSError) and not exc.filename else error_text(exc))
        with contextlib.suppress(OSError):
            print(f"error: {what}", file=sys.stderr)
    return code


def _stdout_full() -> bool:
    """Whether the standard output cannot take more bytes: it is /dev/full (character device 1:7) or a file on a
    full file system (no block free)."""
    try:
        st = os.fstat(sys.stdout.fileno())
        if st.st_rdev and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 7):
            return True
        return stat.S_ISREG(st.st_mode) and os.fstatvfs(sys.stdout.fileno()).f_bavail == 0  # a pipe's fs has none
    except (OSError, ValueError):
        return False


def _silence_stdout() -> None:
    """Point file descriptor 1 at /dev/null (stdout's reader left, or stdout cannot be written)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _print_report(exc: BaseException, code: int) -> None:
    from rich.markup import escape as esc  # user text and patterns such as [a-z0-9] are not markup

    from precision_pipeline.core.errors import (EXIT_BROKEN_PIPE, EXIT_INTERNAL, EXIT_INTERRUPTED, PipelineError,
                                                UserError, error_text)

    con = console(stderr=True)
    if isinstance(exc, UserError):
        if exc.written:  # refused by a stage after the build had written (core.route.run_stages sets it)
            con.print(f"[bold red]error[/]: the {esc(exc.stage or 'build')} stage refused the input after this build "
                      f"wrote {esc(', '.join(exc.written))} in the output; the previous artifacts of the later "
                      "stages are unchanged.", soft_wrap=True)
        elif exc.done:  # a release command recovered an interrupted change before refusing (hostile s15 F1)
            con.print(f"[bold red]error[/]: the input was refused; before that, the recovery every release command "
                      f"starts with: {esc('; '.join(exc.done))}.", soft_wrap=True)  # found or did (hostile s17 F13)
        else:
            con.print("[bold red]error[/]: the input was refused; nothing was changed.")
        for p in exc.problems:
            con.print(f"  [bold]{esc(p.field)}[/]: {esc(p.reason)}" + (f"\n    fix: {esc(p.fix)}" if p.fix else "")
                      + (f"\n    rule: {esc(p.rule)}" + (f" ({esc(p.source)})" if p.source else "") if p.rule else ""),
                      soft_wrap=True)
    elif code == EXIT_BROKEN_PIPE:  # `invoke releases | head`: the reader left; say nothing
        _silence_stdout()
    elif code == EXIT_INTERRUPTED:  # after a commit point (InterruptedAfterCommit) its sentence says what took effect
        con.print(f"interrupted: {esc(str(exc))}" if isinstance(exc, PipelineError) else
                  "interrupted; previous artifacts are intact.", soft_wrap=True)
    elif code == EXIT_INTERNAL and not isinstance(exc, PipelineError):  # an expected failure (e.g. the served
        # tritonserver died: exit 1) is a sentence; only a bug prints a traceback
        traceback.print_exception(type(exc), exc, exc.__traceback__)
        print("\ninternal error: this is a bug in the pipeline, not in your input. Please report it "
              "with the traceback above and the command line.", file=sys.stderr)
    else:
        con.print(f"[bold red]error[/]: {esc(error_text(exc))}", soft_wrap=True)


def stage_line(rec) -> str:
    """One finished stage as printed live: ``name: status (reason) in S s`` (rich markup)."""
    return f"[bold]{rec.name}[/]: {rec.status}" + (f" ({rec.reason})" if rec.reason else "") + f" in {rec.seconds:.1f} s"


def print_build(stages) -> None:
    """The build table: stage, status (and why), seconds, key numbers."""
    from rich.table import Table

    table = Table(title="build")
    for col in ("stage", "status", "time", "key numbers"):
        table.add_column(col)
    for s in stages:
        colour = {"done": "green", "cached": "green", "skipped": "yellow", "failed": "red"}.get(s.status, "white")
        status = s.status + (f" ({s.reason})" if s.reason else "")
        nums = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s.numbers.items()
                         if v is not None and not isinstance(v, (dict, list)) and k != "args")
        table.add_row(s.name, f"[{colour}]{status}[/]", f"{s.seconds:.1f} s", nums)
    console().print(table)


def int_arg(flag: str, value, lo: int = 0, hi: int = 2**31 - 1, example: int | None = None):
    """``value`` as an int within [lo, hi]; None stays None. Raises UserError naming ``flag``, whose fix suggests
    ``example`` (default: ``lo``, at least 1)."""
    from precision_pipeline.core.errors import UserError

    if value is None or isinstance(value, bool):
        return None if value is None else int(value)
    s = str(value).strip()
    if not s.lstrip("-").isdigit() or len(s) > 12 or not lo <= int(s) <= hi:
        raise UserError(flag, f"{s[:40]!r} is not a whole number from {lo:,} to {hi:,}.", f"pass e.g. {flag} {example if example is not None else max(lo, 1)}.")
    return int(s)


def float_arg(flag: str, value, hi: float | None = None, example: str = "0.5"):
    """``value`` as a finite number >= 0 (and <= ``hi`` when given); None stays None. Raises UserError naming
    ``flag``, whose fix suggests ``example``."""
    from precision_pipeline.core.errors import UserError

    if value is None:
        return None
    want = "a number >= 0" if hi is None else f"a number from 0 to {hi:g}"
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise UserError(flag, f"{str(value)[:40]!r} is not a number.", f"pass e.g. {flag} {example}.")
    if not math.isfinite(v) or v < 0 or (hi is not None and v > hi):  # nan, inf and 1e309 too (hostile s12 F-C)
        raise UserError(flag, f"{value!r} is not {want}.", f"pass e.g. {flag} {example}.")
    return v


def parse_layers(text):
    """``"0-3,7"`` -> [0, 1, 2, 3, 7]; None/"" -> None. UserError on ``--layers`` otherwise."""
    from precision_pipeline.core.errors import UserError

    if not text:
        return None
    out = []
    try:
        for part in str(text).split(","):
            a, _, b = part.strip().partition("-")
            out.extend(range(int(a), int(b) + 1) if b else [int(a)])
    except ValueError:
        raise UserError("--layers", f"{text!r} is not a list of layers.", "write e.g. 0-3,7.")
    return out


def margin(value) -> float:
    """``--margin``: a fraction in (0, 1] (default 1). UserError otherwise (NaN and text included)."""
    from precision_pipeline.core.errors import UserError

    if value is None:
        return 1.0
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if not 0 < v <= 1:  # also NaN and text: one range in every message
        raise UserError("--margin", f"{value!r} is not in (0, 1].", "pass e.g. --margin 0.8 (aim at 80 % of the thresholds).")
    return v




def planning_note(con, model_dir, gpu=None) -> bool:
    """Print which GPU a ``--gpu`` alias of several memory sizes is read as (``a100``: a100-80gb, as ``check`` says
    for a profile's target.gpu: ``spec.hardware.variant_note``; hostile s11 F7), then what a folder without weights
    or tokenizer lacks and which numbers need them (``spec.default_model.ModelFiles.planning_note``); returns
    whether the folder can be built."""
    from rich.markup import escape

    from precision_pipeline.spec.default_model import model_files
    from precision_pipeline.spec.hardware import variant_note

    if gpu and (variant := variant_note(gpu)):
        con.print(f"[yellow]note[/]: --gpu {escape(variant)}.", soft_wrap=True)

    note = model_files(model_dir).planning_note()
    if note:
        from precision_pipeline.spec.families import family
        from precision_pipeline.spec.model_arch import read_model_arch

        arch = read_model_arch(model_dir).architecture
        gaps = family(arch).build_gaps()
        if gaps:  # what rule model.gate_reads would refuse once the weights are there
            note.append(f"invoke build cannot build {arch} yet, weights or not: stages missing: "
                        + "; ".join(f"{stage}: {why}" for stage, why in gaps))
    for i, line in enumerate(note):
        con.print(("[yellow]note[/]: " if i == 0 else "  ") + escape(line), soft_wrap=True)
    return not note


__all__ = ["LOG_WIDTH", "console", "report", "stage_line", "print_build", "int_arg", "float_arg", "parse_layers", "margin",
           "planning_note"]
