"""Errors the pipeline raises on purpose, and the exit code each maps to.

Exit codes (every task): 0 success; 2 invalid input or a refused check (raised before any
heavy work); 3 accuracy gate failed; 4 a stage was skipped under ``--strict``; 5 ``trtllm-build``
failed or timed out (the previous engine is intact); 6 (``invoke nightly``) a profile regressed
against its baseline; 7 the Triton server at ``--url`` stopped answering during a change (nothing was
switched, or the message says what was); 1 unexpected internal error (the only case that prints a traceback), or
a switch that took effect whose check afterwards failed (the message says so); a switch whose commit failed and was
undone is 2 (``NotCommitted``)."""

from __future__ import annotations

import difflib
import errno
import os
import re
from dataclasses import dataclass
from typing import Iterable

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_INVALID = 2
EXIT_GATE_FAILED = 3
EXIT_STRICT_SKIP = 4
EXIT_ENGINE_BUILD_FAILED = 5
EXIT_REGRESSED = 6
EXIT_SERVER_STOPPED = 7


class PipelineError(Exception):
    """Base class of expected failures; ``exit_code`` says how the task ends."""

    exit_code = EXIT_INTERNAL


@dataclass
class Problem:
    """One refused input: which field, why, and what would work."""

    field: str
    reason: str
    fix: str = ""
    rule: str = ""
    source: str = ""

    def render(self) -> str:
        text = f"{self.field}: {self.reason}"
        if self.fix:
            text += f" Fix: {self.fix}"
        if self.rule:
            text += f" [rule {self.rule}]"
        return text


class UserError(PipelineError):
    """Bad input or a refused check (exit 2). Carries one or more ``Problem``s."""

    exit_code = EXIT_INVALID
    written: tuple[str, ...] = ()
    """What the run had already written when this was raised (paths relative to its output, e.g.
    ``plan.json``, ``checkpoint/``); empty: refused before any write (set by ``core.route.run_stages``)."""
    stage: str = ""
    """The stage that raised it, when a stage did."""
    done: tuple[str, ...] = ()
    """What the command had changed when this was raised: a recovery of an interrupted release change, each a
    sentence (set by ``serving.release_state.lock``); empty: nothing was changed."""

    def __init__(self, field_or_problems, reason: str = "", fix: str = "", rule: str = "", source: str = ""):
        if isinstance(field_or_problems, (list, tuple)):
            self.problems = list(field_or_problems)
        else:
            self.problems = [Problem(str(field_or_problems), reason, fix, rule, source)]
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return "\n".join(p.render() for p in self.problems)


class GateFailed(PipelineError):
    """The accuracy gate refused the checkpoint (exit 3)."""

    exit_code = EXIT_GATE_FAILED


class StrictSkip(PipelineError):
    """A stage was skipped while ``--strict`` was given (exit 4)."""

    exit_code = EXIT_STRICT_SKIP


class ServerStopped(PipelineError, ConnectionError):
    """The Triton server a command acts on (``--url``) stopped answering -- it died (connection refused, reset, closed
    without an answer) or froze (no answer on ``/v2/health/live`` for ``triton_server.LOAD_STALL_S``) -- while the
    command waited on it (exit 7, a sentence, no traceback; hostile s12 F-N, F-L). A ``ConnectionError`` too, so
    every handler of a server that went away (``except OSError``: rollout's steps, clean-ups) treats it as before."""

    exit_code = EXIT_SERVER_STOPPED


class LoadNotFinished(RuntimeError):
    """A model load that did not finish within the caller's limit (``TritonServer.load``'s ``load_timeout_s``) while
    the server still answered. Triton 2.51 keeps such a load pending -- for good when a python stub fails to start
    (measured on the CPU reference server: its stub exits, the load never ends) -- and queues every later load of the
    model behind it, so another load of it cannot help before the server restarts (hostile s17c H17). A RuntimeError,
    as every other refused load is."""


class NotCommitted(PipelineError):
    """A release switch whose commit (releases.json written) failed -- a full disk, a file-size limit, an immutable
    file -- and was undone: nothing changed, so exit 2 like a refusal (hostile s18b A28b: exit 1 read as an internal
    error). The message says what holds and the fix for the cause."""

    exit_code = EXIT_INVALID


class EngineBuildFailed(PipelineError):
    """``trtllm-build`` exited non-zero or ran past its time limit (exit 5); the previous engine is intact."""

    exit_code = EXIT_ENGINE_BUILD_FAILED


EXIT_BROKEN_PIPE = 141
"""A reader of the output left (``invoke releases | head``): 128 + SIGPIPE, said nothing."""
EXIT_INTERRUPTED = 130
"""Ctrl-C: 128 + SIGINT; writes are atomic, so previous artifacts are intact."""


class InterruptedAfterCommit(PipelineError):
    """A signal (Ctrl-C; SIGTERM or SIGHUP where a task maps them to Ctrl-C) after a change's commit point (exit 130):
    unlike a plain interrupt the change took effect, and the message says what is in place (hostile s11 F4: a
    committed rollback said "previous artifacts are intact"). Raised by ``serving.release_state.after_commit``."""

    exit_code = EXIT_INTERRUPTED

USER_OS_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT, errno.ENAMETOOLONG,
                            errno.EMFILE, errno.EFBIG, errno.EISDIR, errno.ENOTDIR})
"""OSErrors that are the user's machine, not a bug (permissions, a full disk or quota, a file-size limit, a
read-only filesystem, too many open files, a too long name, a folder made where a file is written or a file
where a folder is: ``mkdir <out>/manifest.json``): exit 2 with the file and the cause, no traceback."""

_OS_FIXES = {errno.EFBIG: "raise the file-size limit (ulimit -f)",
             errno.EISDIR: "a folder stands where this file is written: remove that folder if it is not yours",
             errno.ENOTDIR: "a file stands where a folder of that path is expected: remove or rename it"}


def exit_code_for(exc: BaseException) -> int:
    """The exit code of a run that ended with ``exc``: the one mapping every entry point uses (``tasks.py``'s
    ``guarded``, ``python -m precision_pipeline.engine.job``, the nightly's row verdicts).

    ``PipelineError``: its ``exit_code`` (2 refused, 3 gate failed, 4 skipped under --strict, 5 trtllm-build failed);
    ``BrokenPipeError``: 141; an OSError in ``USER_OS_ERRNOS``: 2; ``KeyboardInterrupt``: 130; anything else:
    1 (internal error, the only case with a traceback)."""
    if isinstance(exc, PipelineError):
        return exc.exit_code
    if isinstance(exc, BrokenPipeError):
        return EXIT_BROKEN_PIPE
    if isinstance(exc, OSError) and exc.errno in USER_OS_ERRNOS:
        return EXIT_INVALID
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_INTERNAL


def os_error_text(exc: OSError) -> str:
    """The one-paragraph message of an OSError in ``USER_OS_ERRNOS``: which file, why, and that nothing was lost."""
    where = str(exc.filename2 or exc.filename or "")[:200] or "(a file the system did not name)"
    fix = _OS_FIXES.get(exc.errno, "free space or fix permissions")
    verb = "use" if exc.errno in (errno.EISDIR, errno.ENOTDIR) else "write"  # a read of a folder fails the same way
    return (f"cannot {verb} {where}: {exc.strerror or str(exc)}. Writes are atomic, so the previous artifacts and the "
            f"serving repository are intact; {fix} and run again.")


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def rust_os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` inside a Rust library's error, or None: ``safetensors``' ``SafetensorError`` is no OSError, and
    its message ends with Rust's ``std::io::Error`` text ``... (os error N)`` (safetensors/bindings/python/src/lib.rs
    wraps the io::Error in ``SafetensorError``'s message; e.g. "Error while serializing: I/O error: No space left on
    device (os error 28)"). Hostile s15 F4: ModelOpt's checkpoint export on a full disk or under ``ulimit -f`` was
    an internal error with a traceback."""
    if type(exc).__name__ != "SafetensorError":
        return None
    m = _RUST_OS_ERROR.search(str(exc))
    if not m:
        return None
    n = int(m.group(1))
    return OSError(n, os.strerror(n))


def error_text(exc: BaseException) -> str:
    """The plain one-paragraph text of an expected failure (``exit_code_for`` not 1): a UserError's problems, an
    OSError's ``os_error_text``, else ``str(exc)``."""
    if isinstance(exc, UserError):
        return exc.message
    if isinstance(exc, OSError) and exc.errno in USER_OS_ERRNOS and not isinstance(exc, BrokenPipeError):
        return os_error_text(exc)
    return str(exc) or type(exc).__name__


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The closest known spelling of ``word`` among ``choices`` (difflib ratio >= 0.6), or None."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return match[0] if match else None


__all__ = [
    "EXIT_OK", "EXIT_INTERNAL", "EXIT_INVALID", "EXIT_GATE_FAILED", "EXIT_STRICT_SKIP", "EXIT_ENGINE_BUILD_FAILED",
    "EXIT_REGRESSED", "EXIT_ENGINE_BUILD_FAILED", "EXIT_SERVER_STOPPED",
    "PipelineError", "Problem", "UserError", "GateFailed", "StrictSkip", "EngineBuildFailed", "ServerStopped", "closest",
    "EXIT_BROKEN_PIPE", "EXIT_INTERRUPTED", "USER_OS_ERRNOS", "exit_code_for", "os_error_text", "error_text", "rust_os_error",
]
