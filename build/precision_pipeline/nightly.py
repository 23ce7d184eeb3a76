"""The nightly rebuild: check every selected profile, rebuild what changed, gate, compare with a baseline.

``run_nightly(NightlyOptions)`` is what ``invoke nightly`` calls:

1. **Check first.** Every selected profile is loaded, resolved and preflighted (``pipeline.build_request``
   and ``core.route.prepare`` over its route, the same checks as ``invoke build``) before any heavy work. A
   refused profile is a row with verdict ``refused`` and its reason; the others go on.
2. **Rebuild what changed.** Each accepted profile runs ``pipeline.run_prepared`` (the checked request, not
   resolved again) into ``<out>/<profile>/``: the stage runner (``core/stage.py``) decides by content key what runs
   (a profile edit, a model change, new code or golden prompts). A failed gate whose key (and its
   checkpoint's key) is unchanged is read back from its record instead of being re-measured (the
   runner reuses failed gate verdicts: ``Stage.reuse_failed``). "Rebuilt" lists the stages that ran (``done``/``failed``);
   ``resolve`` always runs and is not listed; a skipped engine is listed apart, with its reason.
3. **Compare.** Each profile's gate numbers against its baseline (``find_baseline``): the last release
   of that profile in ``releases.json`` (the serving repository's, or ``--baseline FILE``), else the
   previous nightly's row (``<out>/nightly/summary.json``, or ``--baseline DIR`` holding one; its
   ``last_measured`` keeps each profile's last row that did not regress, so a regression stays one
   on the next run until it is fixed or promoted).
   Findings (``compare``): a metric worse than the baseline beyond tonight's 95 % bootstrap interval
   (the baseline value lies outside it on the good side), a metric that newly fails its threshold, a
   changed checkpoint size, a changed provenance (ModelOpt version, the checkpoint's quantization
   section, the calibration tokens, the scale tensors' digest). Each is reported with before/after.
4. **Report.** ``<out>/nightly/summary.json`` and ``summary.md`` (one table: profile, stages
   rebuilt, gate numbers, delta vs baseline, verdict), appended to ``$GITHUB_STEP_SUMMARY`` when set.
5. **Promote** (``--promote``): only when exactly one profile was selected and its verdict is pass.

Exit codes (``exit_code``; the most severe row wins, in this order): **1** a profile hit an internal
error; **5** ``trtllm-build`` failed or timed out; **6** (``EXIT_REGRESSED``) a profile regressed
against its baseline; **3** a gate failed; **2** a profile was refused; **4** a stage was skipped under
``--strict``; **0** all passed (the codes are those of ``core.errors``).

The upgrade canary (``run_upgrade``) and the cluster CronJob (``render_cronjob``) are below.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from precision_pipeline.core.errors import (EXIT_ENGINE_BUILD_FAILED, EXIT_GATE_FAILED, EXIT_INTERNAL, EXIT_INVALID,
                                            EXIT_REGRESSED, EXIT_STRICT_SKIP, GateFailed, UserError, exit_code_for)
from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.core.store import atomic_write_json, atomic_write_text, read_json_safe
from precision_pipeline.serving import deploy

NIGHTLY_DIR = "nightly"
"""Folder under the output root holding summary.json / summary.md (and upgrade.json / upgrade.md)."""
SEVERITY = (EXIT_INTERNAL, EXIT_ENGINE_BUILD_FAILED, EXIT_REGRESSED, EXIT_GATE_FAILED, EXIT_INVALID, EXIT_STRICT_SKIP)
"""Exit codes from most to least severe: the nightly exits with the first one any row has."""
VERDICT_EXIT = {"error": EXIT_INTERNAL, "engine_failed": EXIT_ENGINE_BUILD_FAILED, "regressed": EXIT_REGRESSED, "failed": EXIT_GATE_FAILED, "refused": EXIT_INVALID,
                "skipped": EXIT_STRICT_SKIP, "pass": 0}
VERDICT_OF_EXIT = {code: v for v, code in VERDICT_EXIT.items() if v != "regressed"}
"""A build's exit code (``core.errors.exit_code_for`` of what it raised) -> its row's verdict."""
RESERVED_NAMES = (NIGHTLY_DIR, "serving", "mutation")
"""Folders of the output root that are not build outputs (a profile of such a name is refused)."""
SHOWN_METRICS = ("kl_mean", "kl_p99", "top1", "ppl_delta_pct")
"""Gate numbers shown in the summary table (every metric is compared and kept in summary.json)."""


def _say(msg: str) -> None:
    print(msg, flush=True)


@dataclass
class NightlyOptions:
    """What ``invoke nightly`` was asked. ``profiles``: names or YAML paths (``select_profiles``).
    ``checkpoints``: profile name -> a checkpoint folder to reuse (``--checkpoint``)."""

    profiles: list[str]
    out_root: Path = REPO_ROOT / "artifacts"
    model: Optional[str] = None
    strict: bool = False
    golden_limit: Optional[int] = None
    checkpoints: dict[str, str] = field(default_factory=dict)
    baseline: Optional[Path] = None
    promote: bool = False
    serving_repo: Optional[Path] = None

    @property
    def nightly_dir(self) -> Path:
        return Path(self.out_root) / NIGHTLY_DIR

    @property
    def repo(self) -> Path:
        """The serving repository ``--promote`` promotes into (``serving_repo``, default OUT/serving/model_repository),
        resolved as `invoke promote`'s ``--repo`` is: a symbolic link to a repository is that repository (hostile s17
        F19: the unit's gpt_model_path and the baseline's releases.json were the link's folder's)."""
        p = Path(self.serving_repo) if self.serving_repo else Path(self.out_root) / "serving" / "model_repository"
        return p.expanduser().resolve()

    @property
    def releases_file(self) -> Path:
        return self.repo.parent / "releases.json"


OUT_ROOT = "an output root (OUT/<profile>/, OUT/nightly/)"
"""What ``nightly --out`` names, as its refusals say it."""


def select_profiles(spec: Optional[str]) -> list[str]:
    """``--profiles``: None (not given) or ``all`` = every shipped profile; else comma-separated names or YAML
    paths. An empty or blank value (``--profiles ''``, an unset shell variable) is refused (UserError), never
    read as "all": building every profile is asked for by name; so is an empty entry (``a,,b``, ``a,``)."""
    from precision_pipeline.spec.profile import shipped_profiles

    if spec is None or str(spec).strip() == "all":
        return shipped_profiles()
    parts = [s.strip() for s in str(spec).split(",")]
    items = [s for s in parts if s]
    if not items:
        raise UserError("--profiles", f"{str(spec)[:80]!r} names no profile.", "pass e.g. --profiles fp8-h100,bf16-h100 or all.")
    if len(items) != len(parts):  # "a,,b" or "a,": a typo, not a shorter list (as rollout's --steps 5,,100)
        raise UserError("--profiles", f"{str(spec)[:80]!r} has an empty entry.", "pass e.g. --profiles fp8-h100,bf16-h100 or all.")
    return list(dict.fromkeys(items))


def parse_checkpoints(spec: Optional[str], profiles: list[str]) -> dict[str, str]:
    """``--checkpoint``: ``DIR`` (one selected profile; key ``*``) or ``NAME=DIR[,NAME=DIR]``, each NAME one of
    ``profiles`` (the selected). UserError otherwise."""
    if not spec:
        return {}
    if "=" not in spec:
        if len(profiles) != 1:
            raise UserError("--checkpoint", "a bare folder is ambiguous with several profiles selected.",
                            "write --checkpoint NAME=DIR[,NAME=DIR].")
        return {"*": spec}
    out = {}
    for part in spec.split(","):
        name, _, d = part.partition("=")
        if not name.strip() or not d.strip():
            raise UserError("--checkpoint", f"{part[:80]!r} is not NAME=DIR.", "write --checkpoint NAME=DIR[,NAME=DIR].")
        out[name.strip()] = d.strip()
    names = {*profiles, *(Path(r).stem for r in profiles)}  # a YAML path's profile is named by its stem
    if stray := [n for n in out if n not in names]:  # hostile s12 F-K: a typo quietly quantized again
        raise UserError("--checkpoint", f"{stray[0][:80]!r} is not among the selected profiles: {', '.join(profiles)}.",
                        "name a selected profile (NAME=DIR), or select it with --profiles.")
    return out


# --------------------------------------------------------------------------------------------
# Rows


@dataclass
class Row:
    """One profile's line of the summary (``to_json`` is its summary.json entry)."""

    profile: str
    source: str
    route: str = ""  # the serving route (Profile.route: engine | llm_api); the upgrade canary reports by it
    verdict: str = "pass"
    reason: str = ""
    out_dir: str = ""
    stages: dict[str, str] = field(default_factory=dict)
    rebuilt: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    gate: dict[str, Any] = field(default_factory=dict)
    gate_passed: Optional[bool] = None
    failed_metrics: list[str] = field(default_factory=list)
    checkpoint_bytes: Optional[int] = None
    provenance: dict[str, Any] = field(default_factory=dict)
    baseline: Optional[dict[str, Any]] = None
    findings: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return dict(self.__dict__)

    @property
    def measured(self) -> bool:
        return bool(self.gate)


def _gate_numbers(out_dir: Path) -> dict[str, Any]:
    """{metric: {"value", "ci95", "passed", "op"}} from ``<out>/gate/metrics.json`` ({} when absent)."""
    m = read_json_safe(out_dir / "gate" / "metrics.json")
    if not isinstance(m, dict):
        return {}
    return {k: {"value": v.get("value"), "ci95": v.get("ci95"), "passed": v.get("passed"), "op": v.get("op")}
            for k, v in (m.get("metrics") or {}).items() if isinstance(v, dict)}


def provenance(out_dir: Path) -> dict[str, Any]:
    """What produced the checkpoint in ``<out>/checkpoint``: the producer (ModelOpt version), its
    ``quantization`` section, the calibration token digest and a digest of every scale tensor's values
    (a changed KV-cache calibration default shows as changed scales)."""
    ck = Path(out_dir) / "checkpoint"
    cfg = read_json_safe(ck / "config.json")
    if not isinstance(cfg, dict):
        return {}
    cal = read_json_safe(ck / "calibration.json")
    out: dict[str, Any] = {"producer": cfg.get("producer"), "quantization": cfg.get("quantization")}
    if isinstance(cal, dict):
        out["calibration_sha256"] = cal.get("sha256")
    out["scales_sha256"] = _scales_digest(ck)
    return out


def _scales_digest(ck: Path) -> Optional[str]:
    """sha256 over every scale tensor's name, dtype and raw bytes in ``ck``'s rank files (None: no scales).

    Read by byte range from the safetensors header (``checkpoint.reader.safetensors_header``), never
    decoded, so any dtype works (INT4 AWQ stores BF16 per-group scales, which numpy cannot hold)."""
    import hashlib
    import struct

    from precision_pipeline.checkpoint.reader import is_scale_tensor, safetensors_header

    h = hashlib.sha256()
    found = False
    for f in sorted(ck.glob("rank*.safetensors")):
        header = safetensors_header(f)
        with open(f, "rb") as fh:
            start = 8 + struct.unpack("<Q", fh.read(8))[0]
            for name in sorted(k for k in header if k != "__metadata__"):
                if is_scale_tensor(name):
                    found = True
                    begin, end = header[name]["data_offsets"]
                    fh.seek(start + begin)
                    h.update(name.encode())
                    h.update(header[name]["dtype"].encode())
                    h.update(fh.read(end - begin))
    return h.hexdigest() if found else None


# --------------------------------------------------------------------------------------------
# Baselines and comparison


def find_baseline(profile: str, releases: Optional[dict], previous: Optional[dict]) -> Optional[dict]:
    """The baseline of ``profile``: its last release in ``releases`` (releases.json), else its last row of a
    previous nightly (``previous``: a summary.json). None when neither has it.
    Returns {"source": text, "gate": {metric: value or {"value", ...}}, "checkpoint_bytes", "provenance"}."""
    for r in reversed((releases or {}).get("releases") or []):
        if isinstance(r, dict) and r.get("profile") == profile and r.get("kind", "release") == "release":
            return {"source": f"release {r.get('unit', '?')} ({r.get('time', '?')})", "gate": dict(r.get("gate") or {}),
                    "checkpoint_bytes": r.get("checkpoint_bytes"), "provenance": r.get("provenance")}
    row = ((previous or {}).get("last_measured") or {}).get(profile)
    if isinstance(row, dict) and row.get("gate"):
        return {"source": f"nightly {row.get('time', '?')}", "gate": row.get("gate"),
                "checkpoint_bytes": row.get("checkpoint_bytes"), "provenance": row.get("provenance")}
    return None


def _value(x: Any) -> Optional[float]:
    v = x.get("value") if isinstance(x, dict) else x
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _lower_is_better(metric: str, op: Optional[str]) -> bool:
    if op in ("<=", ">="):
        return op == "<="
    from precision_pipeline.gate.checkpoint_gate import CHECKS

    return CHECKS.get(metric, ("", "<="))[1] == "<="  # metrics without a threshold are KL statistics


def compare(row: Row, base: dict) -> list[dict[str, Any]]:
    """Findings of ``row`` against baseline ``base`` (see the module docstring), each
    {"kind", "what", "before", "after", "detail"}; kinds: regression, newly_failing, checkpoint_size, provenance, and
    not_compared (a baseline value that is no number: said, not a regression)."""
    out: list[dict[str, Any]] = []
    bgate = base.get("gate") or {}
    for metric, now in row.gate.items():
        after, before = _value(now), _value(bgate.get(metric))
        if after is not None and before is None and metric in bgate:  # hostile s15b F13: dropped without a word
            out.append({"kind": "not_compared", "what": metric, "before": None, "after": after,
                        "detail": f"{metric} not compared: the baseline's value is {_short(bgate.get(metric))}, "
                                  "not a number (a damaged baseline?)"})
            continue
        if after is None or before is None:
            continue
        ci = now.get("ci95")
        lower = _lower_is_better(metric, now.get("op"))
        if isinstance(ci, (list, tuple)) and len(ci) == 2 and all(isinstance(c, (int, float)) for c in ci):
            lo, hi = float(ci[0]), float(ci[1])
            if (lower and before < lo) or (not lower and before > hi):
                out.append({"kind": "regression", "what": metric, "before": before, "after": after,
                            "detail": f"{metric} {before:.4g} -> {after:.4g}: the baseline lies outside tonight's 95% "
                                      f"interval [{lo:.4g}, {hi:.4g}]"})
        was = bgate.get(metric, {}).get("passed") if isinstance(bgate.get(metric), dict) else None
        was_failed = metric in (bgate.get("failed_metrics") or ()) or was is False
        if now.get("passed") is False and not was_failed:
            out.append({"kind": "newly_failing", "what": metric, "before": before, "after": after,
                        "detail": f"{metric} now fails its threshold ({before:.4g} -> {after:.4g})"})
    b_bytes, a_bytes = base.get("checkpoint_bytes"), row.checkpoint_bytes
    if isinstance(b_bytes, int) and isinstance(a_bytes, int) and a_bytes != b_bytes:
        out.append({"kind": "checkpoint_size", "what": "checkpoint_bytes", "before": b_bytes, "after": a_bytes,
                    "detail": f"checkpoint {b_bytes:,} -> {a_bytes:,} bytes ({(a_bytes - b_bytes) / b_bytes:+.2%})"})
    bprov = base.get("provenance")
    if isinstance(bprov, dict) and row.provenance:
        for k in sorted(set(bprov) | set(row.provenance)):
            if bprov.get(k) != row.provenance.get(k) and k in bprov:
                out.append({"kind": "provenance", "what": k, "before": bprov.get(k), "after": row.provenance.get(k),
                            "detail": f"provenance {k}: {_short(bprov.get(k))} -> {_short(row.provenance.get(k))}"})
    return out


def _short(v: Any, n: int = 60) -> str:
    s = json.dumps(v, sort_keys=True) if not isinstance(v, str) else v
    return s if len(s) <= n else s[: n - 3] + "..."


# --------------------------------------------------------------------------------------------
# One profile


def _checkpoint_of(opts: NightlyOptions, name: str) -> Optional[str]:
    return opts.checkpoints.get(name) or opts.checkpoints.get("*")


def _check(ref: str, opts: NightlyOptions):
    """(request, prepared) of profile ``ref``, checked as ``invoke build`` checks it (``core.route.prepare`` over its
    route: resolve and every stage's preflight; ``prepared`` is (plan, done), what ``pipeline.run_prepared`` takes).
    Raises UserError."""
    from precision_pipeline.core.route import prepare
    from precision_pipeline.pipeline import build_request, route_of
    from precision_pipeline.gate.verdict import load_build_profile

    name = load_build_profile(ref).name
    if name in RESERVED_NAMES:
        raise UserError("--profiles", f"profile name {name!r} is a folder of the nightly output root.", "rename the profile.")
    out = Path(opts.out_root) / name
    req = build_request(ref, opts.model, str(out), opts.strict, None, opts.golden_limit, _checkpoint_of(opts, name))
    return req, prepare(route_of(req.profile).stages, req)


def _build_row(ref: str, req, prepared, opts: NightlyOptions, build: Callable, say: Callable[[str], None]) -> Row:
    name = req.profile.name
    row = Row(profile=name, source=ref, route=req.profile.route, out_dir=str(req.out_dir))
    records = []

    def on_stage(rec) -> None:
        records.append(rec)
        say(f"[nightly] {name} {rec.name}: {rec.status}" + (f" ({rec.reason})" if rec.reason else "")
            + f" in {rec.seconds:.1f} s")

    t0 = time.perf_counter()
    try:
        build(req, prepared, on_stage=on_stage)
    except Exception as e:  # one profile's failure or crash does not stop the others
        code = exit_code_for(e)  # the one exception -> exit code mapping; the verdict follows from the code
        row.verdict = VERDICT_OF_EXIT.get(code, "error")
        if isinstance(e, UserError):
            row.reason = "; ".join(f"{p.field}: {p.reason}" for p in e.problems)
        elif row.verdict == "error":
            traceback.print_exc()
            row.reason = f"{type(e).__name__}: {e}"
        else:
            row.reason = str(e)
        if isinstance(e, GateFailed) and any(r.name in ("gate", "engine_gate") and r.status == "cached" for r in records):
            say(f"[nightly] {name}: checkpoint and gate keys unchanged; its failed gate verdict is read back, not re-measured")
    row.seconds = time.perf_counter() - t0
    for rec in records:
        row.stages[rec.name] = rec.status
        if rec.name != "resolve" and rec.status in ("done", "failed"):
            row.rebuilt.append(rec.name)
        if rec.status == "skipped":
            row.skipped[rec.name] = rec.reason
    out = Path(req.out_dir)
    row.gate = _gate_numbers(out) if (row.stages.get("gate") in ("done", "cached", "failed")) else {}
    if row.gate:
        row.gate_passed = all(v.get("passed") is not False for v in row.gate.values())
        row.failed_metrics = [k for k, v in row.gate.items() if v.get("passed") is False]
    from precision_pipeline.core.stage import read_record
    from precision_pipeline.quantize.stage import QuantizeStage

    q = read_record(out, QuantizeStage())  # the typed checkpoint artifact
    if q is not None and row.stages.get("quantize") in ("done", "cached"):
        row.checkpoint_bytes = q.artifact.checkpoint_bytes
        try:
            row.provenance = provenance(out)
        except Exception as e:  # reading one profile's provenance must not stop the nightly either
            traceback.print_exc()
            row.verdict, row.reason = "error", f"provenance of {out}: {type(e).__name__}: {e}"
    return row


# --------------------------------------------------------------------------------------------
# The run


@dataclass
class NightlySummary:
    rows: list[Row]
    started: float
    finished: float
    baseline_source: str
    last_measured: dict[str, dict]
    promoted: Optional[str] = None
    not_promoted: Optional[str] = None
    """With ``--promote``: why nothing was promoted (a check that did not pass, or promote's refusal)."""

    @property
    def exit_code(self) -> int:
        return exit_code([r.verdict for r in self.rows])

    def to_json(self) -> dict:
        return {"format": "precision-pipeline-nightly", "version": 1, "started": self.started, "finished": self.finished,
                "exit_code": self.exit_code, "baseline_source": self.baseline_source, "promoted": self.promoted,
                "not_promoted": self.not_promoted, "profiles": [r.to_json() for r in self.rows], "last_measured": self.last_measured}


def exit_code(verdicts: list[str]) -> int:
    """The nightly's exit code for these row verdicts (``SEVERITY`` order; 0 when every row passed)."""
    codes = {VERDICT_EXIT[v] for v in verdicts}
    return next((c for c in SEVERITY if c in codes), 0)


def _load_baselines(opts: NightlyOptions) -> tuple[Optional[dict], Optional[dict], str]:
    """(releases.json, previous summary.json, description) for ``opts`` (``--baseline`` FILE or DIR, or the defaults)."""
    prev_default = read_json_safe(opts.nightly_dir / "summary.json")
    if opts.baseline is not None:
        b = Path(opts.baseline).expanduser()
        if b.is_file():
            data = read_json_safe(b)
            if not isinstance(data, dict) or not isinstance(data.get("releases", data.get("profiles")), list):
                raise UserError("--baseline", f"{b} is neither a releases.json nor a nightly summary.json.",
                                "pass the serving repository's releases.json or a nightly folder.")
            if "releases" in data:
                return data, prev_default if isinstance(prev_default, dict) else None, f"releases {b}, then previous nightly"
            return None, data, f"nightly {b}"
        if b.is_dir():
            data = read_json_safe(b / "summary.json")
            if not isinstance(data, dict):
                raise UserError("--baseline", f"{b} holds no nightly summary.json.", "pass a nightly folder or a releases.json.")
            return None, data, f"nightly {b / 'summary.json'}"
        raise UserError("--baseline", f"{b} does not exist.", "pass a releases.json or a nightly folder.")
    rel = read_json_safe(opts.releases_file)
    return (rel if isinstance(rel, dict) else None, prev_default if isinstance(prev_default, dict) else None,
            f"releases {opts.releases_file} (when the profile was promoted), else the previous nightly")


def run_nightly(opts: NightlyOptions, *, build: Optional[Callable] = None, say: Callable[[str], None] = _say,
                attach: Optional[Callable] = None) -> NightlySummary:
    """Check, rebuild, gate and compare every profile of ``opts``; write the summary. See the module docstring.
    ``build(request, prepared, on_stage=)``: the build of a checked profile (default ``pipeline.run_prepared``).
    ``attach()``: the server ``--promote`` switches (``cli.serving.server_of``: None for the files only, a UserError
    while a local server serves the repository without ``--url``). Raises UserError only for bad options."""
    if build is None:
        from precision_pipeline.pipeline import run_prepared as build
    if opts.promote and len(opts.profiles) != 1:
        raise UserError("--promote", f"{len(opts.profiles)} profiles are selected; a serving repository serves one profile.",
                        "run nightly --promote --profiles NAME for the profile to promote.")
    releases, previous, base_src = _load_baselines(opts)
    started = time.time()
    rows: list[Row] = []
    accepted = []
    for ref in opts.profiles:  # 1. check every profile before any heavy work
        try:
            req, prepared = _check(ref, opts)
            accepted.append((ref, req, prepared))
            say(f"[nightly] {req.profile.name}: checks passed")
        except UserError as e:
            reason = "; ".join(f"{p.field}: {p.reason}" for p in e.problems)
            rows.append(Row(profile=Path(ref).stem if ref.endswith((".yaml", ".yml")) else ref, source=ref,
                            verdict="refused", reason=reason))
            say(f"[nightly] {ref}: refused: {reason}")
    for ref, req, prepared in accepted:  # 2.-3. rebuild, gate, compare
        row = _build_row(ref, req, prepared, opts, build, say)
        base = find_baseline(row.profile, releases, previous)
        if base is not None and row.measured:
            row.baseline = base
            row.findings = compare(row, base)
            if any(f["kind"] != "not_compared" for f in row.findings) and row.verdict in ("pass", "failed", "skipped"):
                row.verdict = "regressed"
        say(f"[nightly] {row.profile}: {row.verdict}; "
            + (f"rebuilt {', '.join(row.rebuilt)}" if row.rebuilt else "nothing rebuilt (every stage's key unchanged)")
            + "".join(f"; {f['detail']}" for f in row.findings))
        rows.append(row)
    last = dict((previous or {}).get("last_measured") or {})
    for r in rows:
        # a regressed row never becomes the baseline: a re-run would compare against the regressed numbers and
        # pass (issue 25 item 11); the baseline stays the last measurement that did not regress
        if r.measured and r.verdict != "regressed":
            last[r.profile] = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "gate": r.gate,
                               "failed_metrics": r.failed_metrics, "checkpoint_bytes": r.checkpoint_bytes,
                               "provenance": r.provenance}
    summary = NightlySummary(rows=rows, started=started, finished=time.time(), baseline_source=base_src, last_measured=last)
    if opts.promote and summary.exit_code == 0 and rows and rows[0].verdict == "pass":
        try:
            summary.promoted = _promote(rows[0], opts, attach() if attach else None)
            say(f"[nightly] promoted {rows[0].profile}: {summary.promoted}")
        except UserError as e:  # what promote refuses (serving/acceptance.py; the unit already current on a night
            summary.not_promoted = str(e)  # where nothing changed): said and recorded, the night's exit code stands
    elif opts.promote:
        summary.not_promoted = "not every check passed"
    if summary.not_promoted:
        say(f"[nightly] not promoted: {summary.not_promoted}")
    write_summary(summary, opts.nightly_dir)
    return summary


def _promote(row: Row, opts: NightlyOptions, server=None) -> str:
    """``--promote``: the same promote as ``invoke promote`` (``serving.build_output.promote_build``: acceptance with
    the serving image and SM, the first release with the profile's fallback build from this output root,
    ``warm_fallback`` and ``keep_releases``; ``server``: the live server to load, smoke-test and switch, as
    ``--url``). Returns the unit now current."""
    from precision_pipeline.serving import build_output

    b = build_output.open_build(row.source or row.profile, row.out_dir)
    fb = b.profile.deployment.fallback
    return build_output.promote_build(b, opts.repo, by="invoke nightly", server=server,
                                      fallback_out=Path(opts.out_root) / fb if fb else None).unit


# --------------------------------------------------------------------------------------------
# Summary


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def render_markdown(summary: dict) -> str:
    """summary.md from summary.json's content: one table (profile, stages rebuilt, gate numbers, delta vs
    baseline, verdict), then each finding with before/after, skipped stages and refusals."""
    lines = ["## Nightly rebuild", "",
             f"Exit code {summary['exit_code']}. Baseline: {summary['baseline_source']}.", "",
             "| profile | stages rebuilt | " + " | ".join(SHOWN_METRICS) + " | delta vs baseline | verdict |",
             "|---|---|" + "---|" * len(SHOWN_METRICS) + "---|---|"]
    notes: list[str] = []
    for r in summary["profiles"]:
        rebuilt = ", ".join(r["rebuilt"]) if r["rebuilt"] else ("nothing" if r["stages"] else "-")
        nums = [_fmt(_value(r["gate"].get(m))) for m in SHOWN_METRICS]
        base = r.get("baseline") or {}
        deltas = []
        for m in SHOWN_METRICS:
            a, b = _value(r["gate"].get(m)), _value((base.get("gate") or {}).get(m))
            if a is not None and b is not None:
                deltas.append(f"{m} {a - b:+.3g}")
        delta = ("; ".join(deltas) if deltas else "no baseline") if r["gate"] else "-"
        verdict = r["verdict"] + (f" ({len(r['findings'])} finding{'s' * (len(r['findings']) != 1)})" if r["findings"] else "")
        lines.append(f"| {r['profile']} | {rebuilt} | " + " | ".join(nums) + f" | {delta} | **{verdict}** |")
        for f in r["findings"]:
            notes.append(f"- `{r['profile']}` {f['kind']}: {f['detail']} (before {_short(f['before'])}, after {_short(f['after'])})")
        for st, why in r["skipped"].items():
            notes.append(f"- `{r['profile']}` {st} skipped: {why}")
        if r["verdict"] in ("refused", "error", "failed") and r["reason"]:
            notes.append(f"- `{r['profile']}` {r['verdict']}: {r['reason']}")
    if notes:
        lines += ["", *notes]
    if summary.get("promoted"):
        lines += ["", f"Promoted: {summary['promoted']}."]
    if summary.get("not_promoted"):
        lines += ["", f"Not promoted: {summary['not_promoted']}"]
    return "\n".join(lines) + "\n"


def write_summary(summary: NightlySummary, nightly_dir: Path) -> tuple[Path, Path]:
    """Write summary.json and summary.md (atomically); append the markdown to ``$GITHUB_STEP_SUMMARY`` when set."""
    data = json.loads(json.dumps(summary.to_json(), default=str))
    md = render_markdown(data)
    nightly_dir = Path(nightly_dir)
    nightly_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(nightly_dir / "summary.json", data)
    atomic_write_text(nightly_dir / "summary.md", md)
    step = os.environ.get("GITHUB_STEP_SUMMARY")
    if step:
        with open(step, "a", encoding="utf-8") as f:
            f.write(md + "\n")
    return nightly_dir / "summary.json", nightly_dir / "summary.md"


# --------------------------------------------------------------------------------------------
# Upgrade canary


EXPORT_DEPRECATED = "0.48"
EXPORT_REMOVED = "0.49"
EXPORT_SOURCE = ("ModelOpt docs, modelopt.torch.export.trtllm: export_tensorrt_llm_checkpoint is deprecated since 0.48.0 "
                 "and removed in 0.49.0 (shared/reference/upstream-2026-12.md)")
UPGRADED = ("nvidia-modelopt", "transformers")


class Installer(Protocol):
    """The canary's seam: a throw-away environment. ``create(dir)`` makes it; ``install(packages)`` installs
    the newest releases (returns {package: version}); ``run(argv, cwd)`` runs a command in it -> exit code."""

    def create(self, venv_dir: Path) -> None: ...

    def install(self, packages: tuple[str, ...]) -> dict[str, str]: ...

    def run(self, argv: list[str], cwd: Path) -> int: ...


class VenvInstaller:
    """The real one: ``python -m venv``, pip with ``requirements.lock`` minus the upgraded packages, then the
    newest ``UPGRADED`` from the registry. Never touches ``.venv`` (the pinned build)."""

    def __init__(self, root: Path = REPO_ROOT):
        self.root = Path(root)
        self.python: Optional[Path] = None

    def create(self, venv_dir: Path) -> None:
        import subprocess

        subprocess.run([sys.executable, "-m", "venv", str(venv_dir)], check=True)
        self.python = Path(venv_dir) / "bin" / "python"

    def install(self, packages: tuple[str, ...]) -> dict[str, str]:
        import subprocess
        import tempfile

        assert self.python is not None
        names = {p.lower() for p in packages}
        lock = [ln for ln in (self.root / "requirements.lock").read_text().splitlines()
                if ln.strip() and ln.split("==")[0].strip().lower() not in names]
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("\n".join(lock) + "\n")
        pip = [str(self.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        subprocess.run(pip + ["-r", f.name], check=True)
        subprocess.run(pip + ["--no-deps", "-r", str(self.root / "requirements-nodeps.txt")], check=True)
        subprocess.run(pip + ["--upgrade", *packages], check=True)
        code = "import importlib.metadata as m, json, sys; print(json.dumps({p: m.version(p) for p in sys.argv[1:]}))"
        out = subprocess.run([str(self.python), "-c", code, *packages], check=True, capture_output=True, text=True).stdout
        return json.loads(out)

    def run(self, argv: list[str], cwd: Path) -> int:
        import subprocess

        assert self.python is not None
        return subprocess.run([str(self.python), "-m", "invoke", *argv], cwd=str(cwd)).returncode


def _ge(version: str, floor: str) -> bool:
    from packaging.version import Version

    return Version(version) >= Version(floor)


def export_notice(modelopt_version: Optional[str]) -> Optional[str]:
    """The plain sentence about ModelOpt's TensorRT-LLM checkpoint export for this version, or None before 0.48."""
    if not modelopt_version:
        return None
    if _ge(modelopt_version, EXPORT_REMOVED):
        return (f"ModelOpt {modelopt_version} REMOVES export_tensorrt_llm_checkpoint, the TensorRT-LLM checkpoint export "
                f"the engine route's quantize stage uses: upgrading breaks every engine-route build; the llm_api route "
                f"exports with export_hf_checkpoint and is what to move to ({EXPORT_SOURCE}).")
    if _ge(modelopt_version, EXPORT_DEPRECATED):
        return (f"ModelOpt {modelopt_version} DEPRECATES export_tensorrt_llm_checkpoint, the TensorRT-LLM checkpoint export "
                f"the engine route uses; 0.49 removes it; the llm_api route (export_hf_checkpoint) is not affected "
                f"({EXPORT_SOURCE}).")
    return None


def upgrade_report(versions: dict[str, str], pinned: dict[str, str], canary: Optional[dict], baseline: Optional[dict],
                   canary_exit: int) -> dict:
    """What the upgrade changes, per profile: the canary's summary.json rows against the pinned nightly's
    (``baseline``: a summary.json; rows compared with ``compare``). Returns {"versions", "pinned", "notice",
    "profiles": [{"profile", "route", "verdict", "reason", "changes"}], "exit_code"}."""
    rows = []
    prev = {r["profile"]: r for r in (baseline or {}).get("profiles", []) if isinstance(r, dict)}
    for r in (canary or {}).get("profiles", []):
        p = prev.get(r["profile"])
        changes = []
        if p and p.get("gate") and r.get("gate"):
            row = Row(profile=r["profile"], source=r.get("source", ""), gate=r["gate"],
                      checkpoint_bytes=r.get("checkpoint_bytes"), provenance=r.get("provenance") or {})
            changes = compare(row, {"gate": p["gate"], "failed_metrics": p.get("failed_metrics"),
                                    "checkpoint_bytes": p.get("checkpoint_bytes"), "provenance": p.get("provenance")})
        breaks = r.get("verdict") in ("error", "refused") or (r.get("verdict") == "failed" and (p or {}).get("verdict") == "pass")
        verdict = "breaks" if breaks else ("changes" if changes else "unchanged")
        rows.append({"profile": r["profile"], "route": r.get("route") or "?", "verdict": verdict,
                     "reason": r.get("reason", ""), "changes": changes})
    if canary is None:
        rows.append({"profile": "(all)", "route": "-", "verdict": "breaks", "reason": f"the canary nightly wrote no summary (exit {canary_exit})",
                     "changes": []})
    code = EXIT_REGRESSED if any(r["verdict"] != "unchanged" for r in rows) else 0
    return {"versions": versions, "pinned": pinned, "notice": export_notice(versions.get("nvidia-modelopt")),
            "profiles": rows, "exit_code": code}


def render_upgrade_markdown(rep: dict) -> str:
    lines = ["## Upgrade canary", "",
             "Newest: " + ", ".join(f"{k} {v} (pinned {rep['pinned'].get(k, '?')})" for k, v in rep["versions"].items()) + ".", ""]
    if rep["notice"]:
        lines += [f"**{rep['notice']}**", ""]
    lines += ["| profile | serving route | with the upgrade | what changes |", "|---|---|---|---|"]
    for r in rep["profiles"]:
        what = "; ".join(c["detail"] for c in r["changes"]) or r["reason"] or "-"
        lines.append(f"| {r['profile']} | {r.get('route', '?')} | {r['verdict']} | {what} |")
    return "\n".join(lines) + "\n"


def run_upgrade(opts: NightlyOptions, installer: Optional[Installer] = None, workdir: Optional[Path] = None,
                say: Callable[[str], None] = _say) -> dict:
    """The upgrade canary: a throw-away venv (``installer``) with the newest ``UPGRADED`` packages runs the
    nightly into a separate output root, and the result is compared with the pinned build's last nightly
    (``<out>/nightly/summary.json``). Writes ``<out>/nightly/upgrade.json`` and ``upgrade.md``; the pinned
    ``.venv`` and the build outputs are never touched."""
    import importlib.metadata as md
    import tempfile

    installer = installer or VenvInstaller()
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="nightly-upgrade-"))
    installer.create(work / "venv")
    versions = installer.install(UPGRADED)
    pinned = {p: md.version(p) for p in UPGRADED}
    say("[nightly] upgrade canary: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    out = work / "artifacts"
    argv = ["nightly", "--out", str(out), "--profiles", ",".join(opts.profiles)]
    if opts.golden_limit:
        argv += ["--golden-limit", str(opts.golden_limit)]
    rc = installer.run(argv, REPO_ROOT)
    canary = read_json_safe(out / NIGHTLY_DIR / "summary.json")
    rep = upgrade_report(versions, pinned, canary if isinstance(canary, dict) else None,
                         read_json_safe(opts.nightly_dir / "summary.json"), rc)
    opts.nightly_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(opts.nightly_dir / "upgrade.json", rep)
    md_text = render_upgrade_markdown(rep)
    atomic_write_text(opts.nightly_dir / "upgrade.md", md_text)
    if os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a", encoding="utf-8") as f:
            f.write(md_text + "\n")
    return rep


# --------------------------------------------------------------------------------------------
# Cluster-side nightly: the CronJob


CRONJOB_TEMPLATE = REPO_ROOT / "k8s" / "nightly" / "nightly-cronjob.yaml"
"""In a sub-folder: the deploy stage renders every ``k8s/*.yaml`` for a build, and this is not one of them."""
DEFAULT_SCHEDULE = "30 2 * * *"
DEFAULT_SOURCE_DIR = deploy.SOURCE_DIR


def profiles_for_sm(sm: int) -> list[str]:
    """Shipped profiles whose ``target.gpu`` has compute capability ``sm`` (engines are built per SM)."""
    from precision_pipeline.spec.hardware import resolve_gpu
    from precision_pipeline.spec.profile import load_profile, shipped_profiles

    return [n for n in shipped_profiles() if resolve_gpu(load_profile(n).target.gpu).sm == sm]


def render_cronjob(gpu: str, out_dir: Path, *, image: Optional[str] = None, schedule: str = DEFAULT_SCHEDULE,
                   namespace: str = "default", pvc_name: Optional[str] = None, source_dir: str = DEFAULT_SOURCE_DIR,
                   artifacts_path: str = "/artifacts") -> Path:
    """Render ``k8s/nightly/nightly-cronjob.yaml`` for GPU ``gpu`` (catalog id or alias): ``nightly --strict`` over
    the shipped profiles of that GPU's SM, in the serving image, on a node with that GPU, against the artifacts
    PVC. Validated as every manifest is (``serving.deploy.validate_manifest``: Kubernetes schemas, strict).
    Writes ``<out_dir>/nightly-cronjob-sm<SM>.yaml``; returns its path. Raises UserError."""
    from precision_pipeline.serving import deploy
    from precision_pipeline.spec.hardware import resolve_gpu

    spec = resolve_gpu(gpu)
    profiles = profiles_for_sm(spec.sm)
    if not profiles:
        raise UserError("--gpu", f"no shipped profile targets SM {spec.sm} ({spec.name}).", "pick a GPU a profile targets.")
    image = deploy.DEFAULT_IMAGE if image is None else image  # "" (an unset $IMAGE) is refused below
    deploy.check_image(image, "--image")
    params = {
        "name": f"precision-nightly-sm{spec.sm}", "namespace": namespace, "schedule": schedule,
        "labels": {"app.kubernetes.io/name": "precision-nightly", "app.kubernetes.io/part-of": "precision-pipeline",
                   "precision-pipeline/sm": str(spec.sm)},
        "image": image, "gpu_products": [deploy.gpu_product_label(spec.name)],
        "command": ["./run.sh", "nightly", "--strict", "--out", artifacts_path, "--profiles", ",".join(profiles)],
        "working_dir": source_dir, "artifacts_path": artifacts_path, "pvc_name": pvc_name or deploy.DEFAULT_PVC,
    }
    where = "k8s/nightly/nightly-cronjob.yaml"
    doc = deploy.parse_manifest(deploy.render_template(CRONJOB_TEMPLATE.read_text(), params, where), where)
    deploy.validate_manifest(doc, where)
    import yaml

    out = Path(out_dir) / f"nightly-cronjob-sm{spec.sm}.yaml"
    atomic_write_text(out, f"# Rendered by build/precision_pipeline/nightly.py from {where} for {spec.name} (SM {spec.sm}).\n"
                      + yaml.safe_dump(doc, sort_keys=False, width=1000))
    return out


__all__ = ["NightlyOptions", "Row", "NightlySummary", "run_nightly", "select_profiles", "parse_checkpoints", "compare",
           "find_baseline", "provenance", "render_markdown", "write_summary", "exit_code",
           "EXIT_REGRESSED", "Installer", "VenvInstaller", "upgrade_report", "export_notice", "run_upgrade",
           "render_cronjob", "profiles_for_sm"]
