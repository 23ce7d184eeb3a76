"""The stage protocol and the one runner that keys, caches, commits and records every stage.

A stage (``Stage[I, O]``) declares:

* ``name`` (the manifest row and, with ``output``, the folder it writes under the build output),
  ``version`` (bump when the artifact's meaning changes),
* ``code``: paths relative to the package (``"quantize"``, ``"gate/data/golden_prompts.jsonl"``)
  whose bytes go into its key (a folder counts its ``.py`` and ``.jsonl`` files),
* ``needs``: the upstream stages whose artifacts its inputs read (their keys go into its key),
* ``inputs(plan: ResolvedPlan, request: BuildRequest, upstream) -> I``: a frozen pydantic model
  holding exactly what ``run`` reads (the resolved plan is given to every stage; a stage copies what
  it reads of it into ``I``, so a change of ``deployment.replicas`` does not re-quantize). Every field
  is keyed; a field that must not change the key is named in the model's ``unkeyed`` class attribute
  with its reason (``Frozen.unkeyed``, honoured by ``core.store.canonical``),
* ``preflight(plan, request)``: checks that need no write (a dataset's token lengths, the build
  node's GPUs and flags); every stage's is called before the build's first write (``core.route.prepare``),
* ``run(inputs, workdir) -> O``: the work; ``workdir`` is a fresh temporary folder that the
  runner renames onto ``<out>/<output>`` when ``run`` returns (None for stages without a folder).

An artifact may block what follows (``Artifact.blocking``: a failed gate is ``GateFailed``, exit 3);
the loop that runs a route's stages (``core/route.py``) raises it, and no driver branches on names.

Only ``StageRunner`` computes keys::

    key = sha256(canonical_json({"stage": name, "version": version, "inputs": I,
                                 "upstream": {need: key}, "code": code fingerprint}))

with the strict canonical form of ``core.store.canonical`` (unknown types are a TypeError that
names the offending value's path; paths enter only as ``core.fingerprint.Fingerprint``). A stage
is *cached* when its typed artifact record (``<out>/.stages/<name>.json``) is present, valid and
holds its key, and its folder is present and is what the record's ``files`` inventory says (each
file's size and content sample, ``core.fingerprint.inventory``; reports ``VIEW_SUFFIXES`` aside):
a checkpoint truncated or edited after its build, or a file added, makes the stage run again
(``StageRunner.not_reused`` says why); otherwise it runs. The record is the authority, not the
manifest row: it is committed together with the stage's folder (a commit file of
``core.store.atomic_dir``), so a kill during the folder swap is rolled forward with its record by
the next build's ``clean_stale``.
An artifact whose ``status`` is not ``done`` (a skipped engine) is never reused: the next build
runs the stage again. The one exception is declared by the stage: ``reuse_failed`` (the gates) makes
a ``failed`` artifact a result like a ``done`` one, because a verdict of the same inputs is the same
verdict (re-measuring an unchanged failing gate costs minutes and changes nothing).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Generic, Literal, Mapping, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from precision_pipeline.core.errors import GateFailed, PipelineError
from precision_pipeline.core.fingerprint import inventory, inventory_problem
from precision_pipeline.core.paths import PACKAGE_DIR
from precision_pipeline.core.store import atomic_dir, atomic_write_json, canonical_json, hash_dir, hash_file, read_json

if TYPE_CHECKING:  # the stage hooks' types (resolve is a higher layer; annotations only)
    from precision_pipeline.resolve.plan import ResolvedPlan
    from precision_pipeline.resolve.stage import BuildRequest

CODE_ROOT: Path = PACKAGE_DIR
"""Where ``Stage.code`` paths are resolved (tests point it at a copy of the package)."""

RECORDS_DIR = ".stages"
"""Folder under the build output holding each stage's typed artifact record (``<name>.json``)."""

CODE_SUFFIXES = (".py", ".jsonl")

VIEW_SUFFIXES = (".md", ".html", ".png", ".pyc")
"""Files of a stage folder its record does not vouch for: reports and pictures that later tasks re-render
(``invoke sensitivity`` adds a section to ``gate/report.md``), and the ``__pycache__/*.pyc`` Python writes
when a packed repository is served in place. Every other file's size and content sample
(``core.fingerprint.inventory``) is stored in the record and checked on each cache hit."""

Status = Literal["done", "cached", "skipped", "failed"]


class Frozen(BaseModel):
    """Base of stage inputs and artifacts: immutable, unknown fields refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    unkeyed: ClassVar[Mapping[str, str]] = {}
    """{field: why it must not change a stage key}: the fields ``core.store.canonical`` leaves out. Every other
    field is keyed (no ``canonical()`` overrides in stage inputs)."""


class Artifact(Frozen):
    """A stage's typed result. ``status``: done | skipped | failed (``reason`` says why when not done)."""

    status: Literal["done", "skipped", "failed"] = "done"
    reason: str = ""

    def summary(self) -> dict[str, Any]:
        """The manifest row's ``numbers`` (and the build table's key numbers)."""
        return {}

    def present(self, out_dir: Path) -> bool:
        """Whether what the artifact describes is still on disk (checked before a cache hit)."""
        return True

    def blocking(self, subject: str, folder: Optional[Path]) -> Optional[PipelineError]:
        """The error that stops the stages after this one (``subject``: the profile's name; ``folder``: the stage's
        output folder), or None. A failed gate returns ``GateFailed`` (exit 3)."""
        return None

    def plan_view(self) -> dict[str, Any]:
        """What this artifact adds to ``plan.json`` (``ResolvedPlan.to_json``'s keyword arguments): {} by default."""
        return {}

    def manifest_facts(self) -> dict[str, Any]:
        """Top-level facts of ``manifest.json`` this artifact decides (``engine_present``): {} by default."""
        return {}


def gate_failure(what: str, subject: str, failed: tuple[str, ...], folder: Optional[Path], note: str = "") -> GateFailed:
    """The ``GateFailed`` of a failed verdict: ``<what> failed for <subject> (<metrics>)[; note]; see <folder>/report.md``."""
    see = f"; see {Path(folder) / 'report.md'}" if folder is not None else ""
    return GateFailed(f"{what} failed for {subject} ({', '.join(failed)})" + (f"; {note}" if note else "") + see)


I = TypeVar("I", bound=BaseModel)
O = TypeVar("O", bound=Artifact)


@dataclass
class StageRecord:
    """One row of the build summary (and of manifest.json ``stages``)."""

    name: str
    status: str = "pending"  # done | cached | skipped | failed | pending
    seconds: float = 0.0
    reason: str = ""
    key: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"status": self.status, "seconds": round(self.seconds, 3), "reason": self.reason,
                "key": self.key, "numbers": self.numbers}


@dataclass(frozen=True)
class Done(Generic[O]):
    """A finished stage as later stages see it: its artifact, key and output folder (None if it has none)."""

    artifact: O
    key: str
    dir: Optional[Path]
    record: StageRecord


class Stage(Generic[I, O]):
    """Base class of the pipeline's stages (see the module docstring for the contract)."""

    name: ClassVar[str]
    version: ClassVar[int] = 1
    code: ClassVar[tuple[str, ...]] = ()
    needs: ClassVar[tuple[str, ...]] = ()
    output: ClassVar[Optional[str]] = None
    artifact_type: ClassVar[type[Artifact]] = Artifact
    cacheable: ClassVar[bool] = True
    reuse_failed: ClassVar[bool] = False
    """A ``failed`` artifact with an unchanged key is reused (a verdict, e.g. a gate's), not re-run."""
    provides_plan: ClassVar[bool] = False
    """Its artifact's ``plan`` is the ``ResolvedPlan`` every later stage is given (resolve); it runs before the
    first write (``core.route.prepare``), so it must write nothing (``output`` None)."""

    def inputs(self, plan: "ResolvedPlan", request: "BuildRequest",
               upstream: Mapping[str, Done]) -> I:  # pragma: no cover - abstract
        raise NotImplementedError

    def preflight(self, plan: "ResolvedPlan", request: "BuildRequest") -> None:
        """Checks of this stage that write nothing and should refuse (UserError) before the build's first write."""
        return None

    def run(self, inputs: I, workdir: Optional[Path]) -> O:  # pragma: no cover - abstract
        raise NotImplementedError


def code_fingerprint(code: tuple[str, ...], root: Optional[Path] = None) -> dict[str, str]:
    """{path: sha256} for each declared code path (folders: their .py/.jsonl files). Missing paths are an error."""
    root = Path(root or CODE_ROOT)
    out: dict[str, str] = {}
    for rel in code:
        p = root / rel
        if p.is_dir():
            out[rel] = hash_dir(p, suffixes=CODE_SUFFIXES)
        elif p.is_file():
            out[rel] = hash_file(p)
        else:
            raise FileNotFoundError(f"stage code path {rel!r} does not exist under {root}")
    return out


def stage_key(stage: Stage, inputs: BaseModel, upstream_keys: Mapping[str, str]) -> str:
    """sha256 of the strict canonical form of (name, version, inputs, upstream keys, code fingerprint)."""
    if not isinstance(inputs, BaseModel) or not inputs.model_config.get("frozen"):
        raise TypeError(f"{stage.name}: inputs must be a frozen pydantic model, got {type(inputs).__qualname__}")
    body = {"stage": stage.name, "version": stage.version, "inputs": inputs,
            "upstream": dict(upstream_keys), "code": code_fingerprint(stage.code)}
    return hashlib.sha256(canonical_json(body).encode()).hexdigest()


def read_manifest(path: Path) -> dict:
    """``manifest.json`` at ``path`` as a dict ({} when the file does not exist).

    A file that is not a JSON object (truncated by a full disk, edited by hand) raises UserError (exit 2)
    naming it and the fix: ``invoke build`` on that output rewrites it from the stage records
    (``.stages/``, the authority), without re-running an unchanged stage."""
    from precision_pipeline.core.errors import UserError

    try:
        data = read_json(path, default={})
    except (ValueError, UnicodeDecodeError) as e:
        data = f"not valid JSON ({str(e)[:80]})"
    except OSError as e:
        data = f"unreadable ({e.strerror or e})"
    if not isinstance(data, dict):
        why = data if isinstance(data, str) else f"a JSON {type(data).__name__}, not an object"
        raise UserError("manifest.json", f"{path} is {why}: the build output's summary is damaged.",
                        f"run `invoke build --profile P --out {Path(path).parent}` again: it rewrites manifest.json "
                        "from the stage records and reuses every unchanged stage.")
    return data


def unfinished_build(manifest: dict) -> Optional[str]:
    """Why the last build (or engine Job) into an output did not finish, from its ``manifest.json`` (``read_manifest``):
    it has ``started`` but no ``finished``, so it was killed or interrupted after its first stage record and the stage
    records may mix two builds (a new resolve with the old checkpoint, a new gate with the old packed unit: hostile
    s15 F5, s15b F2). None when it finished, or the manifest records no start (an empty or hand-made one)."""
    started = manifest.get("started")
    if not isinstance(started, (int, float)) or isinstance(manifest.get("finished"), (int, float)):
        return None
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
    return f"the last build into this folder (started {when}) did not finish (interrupted or killed)"


@dataclass
class Manifest:
    """manifest.json as an object: rendered with the layout the README documents."""

    path: Path
    profile: str
    profile_source: str
    model_dir: str
    out_dir: str
    previous: dict[str, dict] = field(default_factory=dict)
    stages: dict[str, dict] = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    finished: Optional[float] = None
    facts: dict[str, Any] = field(default_factory=dict)
    """Top-level facts the finished stages decide (``Artifact.manifest_facts``: ``engine_present``)."""

    @classmethod
    def open(cls, path: Path, keep_finished: bool = False, **head: str) -> "Manifest":
        """The manifest a build (re)writes: the previous rows of a readable ``path``; a damaged one (not a JSON
        object, ``read_manifest``) is replaced, since the rows are rewritten from the stage records. A build starts
        unfinished (``finished`` is written by ``finish``: ``unfinished_build``); ``keep_finished`` (the engine Job,
        which adds stages to a finished CPU build) keeps the old ``started``/``finished`` and facts until its own
        ``finish``, so a Job that fails and is retried is not refused as an interrupted build."""
        try:
            old = read_manifest(path)
        except PipelineError:
            print(f"[manifest] {path} is damaged (not a JSON object); it is rewritten from the stage records.",
                  file=sys.stderr, flush=True)
            old = {}
        prev = old.get("stages", {}) if isinstance(old, dict) else {}
        prev = prev if isinstance(prev, dict) else {}
        m = cls(path=Path(path), previous=dict(prev), stages=dict(prev), **head)
        if keep_finished and isinstance(old.get("finished"), (int, float)) and isinstance(old.get("started"), (int, float)):
            m.started, m.finished = float(old["started"]), float(old["finished"])
            m.facts = {k: v for k, v in old.items() if k not in m.render() and k != "finished"}
        return m

    def render(self) -> dict:
        out: dict[str, Any] = {"profile": self.profile, "profile_source": self.profile_source, "model_dir": self.model_dir,
                               "out_dir": self.out_dir, "stages": self.stages, "started": self.started}
        if self.finished is not None:
            out["finished"] = self.finished
            out.update(self.facts)
        return out

    def record(self, rec: StageRecord) -> None:
        self.stages[rec.name] = rec.to_json()
        self.save()

    def finish(self, **facts: Any) -> None:
        self.finished = time.time()
        self.facts = dict(facts)
        self.save()

    def save(self) -> None:
        atomic_write_json(self.path, self.render())


class StageRunner:
    """Runs stages for one build output folder: key, cache decision, atomic commit, manifest row."""

    def __init__(self, out_dir: Path, manifest: Manifest, on_stage: Optional[Callable[[StageRecord], None]] = None):
        self.out_dir = Path(out_dir)
        self.manifest = manifest
        self.on_stage = on_stage
        self.records: list[StageRecord] = []
        self.not_reused: dict[str, str] = {}
        """{stage: why its folder did not match its record} for stages whose key matched (they ran again)."""
        self.folders: dict[str, str] = {}

        self.also_written: list[str] = []
        """Files the driver wrote into the output besides the stages' (``plan.json``), for ``written``."""

    def _record_path(self, stage: Stage) -> Path:
        return self.out_dir / RECORDS_DIR / f"{stage.name}.json"

    def recorded(self, stage: Stage) -> Optional[Done]:
        """``read_record`` of ``stage`` in this output."""
        return read_record(self.out_dir, stage)

    def commit(self, stage: Stage, d: Done) -> Done:
        """Record a stage that ran before the output existed (``core.route.prepare``: resolve): its typed record
        (``.stages/<name>.json``: what the engine build Job reads the plan from, although resolve is never reused)
        and its manifest row."""
        write_record(self._record_path(stage), stage.name, d.key, d.artifact)
        return self.record(d)

    def written(self) -> tuple[str, ...]:
        """What this run has written so far, relative to the output: ``also_written`` (``plan.json``),
        ``manifest.json``, the folder of each stage that ran (not cached) and the stage records."""
        ran = {r.name for r in self.records if r.status != "cached"}
        folders = [f + "/" for n, f in self.folders.items() if n in ran and (self.out_dir / f).exists()]
        return tuple(self.also_written + ["manifest.json"] + folders + [RECORDS_DIR + "/"])

    def _cached(self, stage: Stage, key: str) -> Optional[Artifact]:
        if not stage.cacheable:
            return None
        if stage.output is not None and not (self.out_dir / stage.output).exists():
            return None
        try:
            rec = json.loads(self._record_path(stage).read_text())
            if rec.get("key") != key or rec.get("stage") != stage.name:
                return None
            art = stage.artifact_type.model_validate(rec["artifact"])
        except (OSError, ValueError, KeyError, TypeError, ValidationError):
            return None
        reusable = art.status == "done" or (art.status == "failed" and stage.reuse_failed)
        if not reusable or not art.present(self.out_dir):
            return None
        if stage.output is not None:
            why = inventory_problem(self.out_dir / stage.output, rec.get("files"), VIEW_SUFFIXES)
            if why is not None:
                self.not_reused[stage.name] = why
                print(f"[{stage.name}] not reused: {self.out_dir / stage.output} is not what its record says ({why}); "
                      "running it again.", file=sys.stderr, flush=True)
                return None
        return art

    def run(self, stage: Stage, plan: "ResolvedPlan", request: "BuildRequest", done: Mapping[str, Done]) -> Done:
        """Run (or reuse) ``stage``; record its row; return what later stages see."""
        if stage.output:
            self.folders[stage.name] = stage.output
        return self.record(execute(stage, plan, request, done, self.out_dir, self._cached))

    def record(self, d: Done) -> Done:
        """Write ``d``'s manifest row (and tell ``on_stage``)."""
        self.manifest.record(d.record)
        self.records.append(d.record)
        if self.on_stage:
            self.on_stage(d.record)
        return d


@contextlib.contextmanager
def _names_the_folder(out: Path):
    """An OSError without a file name (``write()`` on a full disk: ENOSPC, EFBIG) gets the stage folder as its
    ``filename``, so the message says where the write failed instead of an empty path; a Rust library's I/O error
    (safetensors' ``SafetensorError`` "... (os error 28)": ``core.errors.rust_os_error``) becomes that OSError."""
    from precision_pipeline.core.errors import rust_os_error

    try:
        yield
    except OSError as e:
        if not e.filename:
            e.filename = str(out)
        raise
    except Exception as e:
        if (os_err := rust_os_error(e)) is None:
            raise
        os_err.filename = str(out)
        raise os_err from e


def read_record(out_dir: Path, stage: Stage) -> Optional[Done]:
    """``stage``'s last result in build output ``out_dir`` as a typed ``Done`` (its record's key and artifact;
    status ``cached``), or None when its record is missing, unreadable or not a valid ``stage.artifact_type``."""
    try:
        rec = json.loads((Path(out_dir) / RECORDS_DIR / f"{stage.name}.json").read_text())
        art = stage.artifact_type.model_validate(rec["artifact"])
        key = str(rec["key"])
    except (OSError, ValueError, KeyError, TypeError, ValidationError):
        return None
    folder = Path(out_dir) / stage.output if stage.output else None
    return Done(artifact=art, key=key, dir=folder, record=StageRecord(stage.name, "cached", key=key, numbers=art.summary()))


def write_record(path: Path, name: str, key: str, artifact: Artifact, files: Optional[dict] = None) -> None:
    """A stage's typed record ``{"stage", "key", "artifact"[, "files"]}`` at ``path`` (atomically)."""
    atomic_write_json(path, {"stage": name, "key": key, "artifact": artifact.model_dump(mode="json"),
                             **({"files": files} if files is not None else {})})


def execute(stage: Stage, plan: Any, request: Any, done: Mapping[str, Done], out_dir: Optional[Path] = None,
            cached: Optional[Callable[[Stage, str], Optional[Artifact]]] = None) -> Done:
    """Key ``stage``, reuse its artifact when ``cached`` returns one, else run it (atomically into
    ``<out_dir>/<stage.output>``) and store its typed record. Records no manifest row."""
    upstream = {n: done[n] for n in stage.needs}
    t0 = time.perf_counter()
    inputs = stage.inputs(plan, request, upstream)
    key = stage_key(stage, inputs, {n: d.key for n, d in upstream.items()})
    out = Path(out_dir) / stage.output if (stage.output and out_dir is not None) else None
    art = cached(stage, key) if cached is not None else None
    if art is not None:
        return Done(artifact=art, key=key, dir=out, record=StageRecord(stage.name, "cached", 0.0, key=key, numbers=art.summary()))
    record_path = Path(out_dir) / RECORDS_DIR / f"{stage.name}.json" if (stage.cacheable and out_dir is not None) else None

    def checked(a: Any) -> O:
        if not isinstance(a, stage.artifact_type):
            raise TypeError(f"stage {stage.name} returned {type(a).__qualname__}, not {stage.artifact_type.__qualname__}")
        return a

    if out is not None:
        # the record is a commit file of the folder's swap: a kill mid-swap is rolled forward with it
        commit: dict[Path, Any] = {}
        with _names_the_folder(out), atomic_dir(out, commit_files=commit) as tmp:
            art = checked(stage.run(inputs, tmp))
            if record_path is not None:
                commit[record_path] = {"stage": stage.name, "key": key, "artifact": art.model_dump(mode="json"),
                                       "files": inventory(tmp, VIEW_SUFFIXES)}
    else:
        art = checked(stage.run(inputs, None))
        if record_path is not None:
            write_record(record_path, stage.name, key, art)
    rec = StageRecord(stage.name, art.status, time.perf_counter() - t0, reason=art.reason, key=key, numbers=art.summary())
    return Done(artifact=art, key=key, dir=out, record=rec)


__all__ = ["Frozen", "Artifact", "Stage", "StageRunner", "StageRecord", "Done", "Manifest", "stage_key", "execute",
           "code_fingerprint", "CODE_ROOT", "RECORDS_DIR", "read_manifest", "unfinished_build", "write_record", "read_record", "gate_failure"]
