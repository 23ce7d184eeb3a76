"""``invoke recommend`` and ``invoke compare``: the performance model and measured accuracy
(``analysis/choose.py``), ranked and printed; ``--measure`` / ``--build`` build the unmeasured for real."""

from __future__ import annotations

from pathlib import Path

from precision_pipeline.cli.console import console, float_arg, int_arg, planning_note, stage_line
from precision_pipeline.core.errors import EXIT_INVALID
from precision_pipeline.core.paths import REPO_ROOT
from precision_pipeline.spec.default_model import plan_model_dir


def _workload(input_len, output_len, concurrency, request_rate):
    from precision_pipeline.resolve.perf import DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN, Workload

    return Workload(int_arg("--input-len", input_len, 1) or DEFAULT_INPUT_LEN,
                    int_arg("--output-len", output_len, 1) or DEFAULT_OUTPUT_LEN,
                    int_arg("--concurrency", concurrency, 1), float_arg("--request-rate", request_rate))


def _gate_builder(con, model, golden_limit):
    """``analysis.choose.BuildFn`` for recommend --measure / compare --build: ``run_build`` of the file,
    printing each stage; a failed gate is measured (None), any other expected failure is the reason."""
    from precision_pipeline.core.errors import GateFailed, PipelineError, UserError
    from precision_pipeline.pipeline import run_build

    def build(path: Path):
        con.print(f"[bold]measuring[/] {path.name}: invoke build --profile {path}", soft_wrap=True)
        try:
            run_build(str(path), model=model, golden_limit=golden_limit,
                      on_stage=lambda r: con.print("  " + stage_line(r), soft_wrap=True))
        except GateFailed:
            return None
        except UserError as e:
            return e.message
        except PipelineError as e:
            return str(e)
        return None

    return build


def recommend(gpu, model=None, max_kl_p99=None, min_concurrency=None, max_gpus=None, context=None, write=None,
              measure=False, top=None, golden_limit=None, input_len=None, output_len=None, concurrency=None,
              request_rate=None, max_ttft_p99=None, max_tpot=None, min_tokens_per_s=None, max_cold_start=None):
    """Best profile for a GPU and workload under constraints (performance model); exit 2 when none meets them all."""
    from precision_pipeline.analysis import choose as ch
    from precision_pipeline.resolve import perf as PF

    k = ch.Constraints(max_kl_p99=float_arg("--max-kl-p99", max_kl_p99),
                       min_concurrency=int_arg("--min-concurrency", min_concurrency, 1),
                       max_gpus=int_arg("--max-gpus", max_gpus, 1, 4096) or ch.DEFAULT_MAX_GPUS,
                       max_ttft_p99_s=float_arg("--max-ttft-p99", max_ttft_p99), max_tpot_s=float_arg("--max-tpot", max_tpot),
                       min_tokens_per_s=float_arg("--min-tokens-per-s", min_tokens_per_s),
                       max_cold_start_s=float_arg("--max-cold-start", max_cold_start))
    ctx = int_arg("--context", context, 1)
    wl = _workload(input_len, output_len, concurrency, request_rate)
    n_top = int_arg("--top", top, 1, 64) or 2  # default None: invoke would int() a typed default itself
    rec = ch.recommend(gpu, plan_model_dir(model), REPO_ROOT / "artifacts", k, context=ctx, workload=wl)
    planning_note(con := console(), plan_model_dir(model), gpu)  # what a folder without weights cannot say; a100 =
    if measure:
        builds = ch.measure_top(rec, n_top, REPO_ROOT / "artifacts" / "recommend", _gate_builder(
            con, model, int_arg("--golden-limit", golden_limit, 1, 1000)), command=f"--gpu {gpu} --measure")
        for b in builds:
            con.print(f"measured {b['label']} ({b['profile']})" if b["reason"] is None
                      else f"[red]not measured[/] {b['label']}: {b['reason']}", soft_wrap=True)
        if not builds:
            con.print("--measure: every candidate near the constraints is measured already")
        rec = ch.recommend(gpu, plan_model_dir(model), REPO_ROOT / "artifacts", k, context=ctx, workload=wl)
    con.print(f"workload: {wl.describe()}; throughput, TTFT, TPOT from resolve/perf.py (true values within "
              f"x{PF.RANGE[0]}..x{PF.RANGE[1]} on benchmarks/planner.py's published rows)", soft_wrap=True)
    for cand in sorted((x for x in rec.candidates if not x.refused), key=ch.rank_key):
        pf, a = cand.perf, cand.accuracy
        status = "[green]meets[/]  " if cand.ok else "[yellow]ruled out[/] "
        con.print(f"{status}{cand.label}: {ch.tokens_per_gpu(cand):,.0f} output tokens/s per GPU "
                  f"({pf['output_tokens_per_s_per_replica']:,.0f} per replica of {cand.world_size} GPU, batch {pf['batch']:,}), "
                  f"TTFT P99 {pf['ttft_p99_s']:.3g} s, TPOT {pf['tpot_s'] * 1e3:.3g} ms, KL P99 {a.kl_p99} ({a.kind})"
                  + "".join(f"; {v['text']}" for v in cand.violations), soft_wrap=True, markup=True)
    for cand in (x for x in rec.candidates if x.refused):
        con.print(f"[red]refused[/]  {cand.label}: " + "; ".join(f"rule {r['rule']}" for r in cand.refused),
                  soft_wrap=True)
    if rec.best is None:
        con.print(f"[bold red]no candidate on {rec.gpu} meets every constraint[/] (reasons above)")
        return EXIT_INVALID
    b = rec.best
    r = b.perf["ranges"]
    con.print(f"[bold green]recommended[/]: {b.label} (from {b.base}): {ch.tokens_per_gpu(b):,.0f} output tokens/s per GPU "
              f"(range {r['output_tokens_per_s_per_gpu'][0]:,.0f}-{r['output_tokens_per_s_per_gpu'][1]:,.0f}), TTFT P99 "
              f"{b.perf['ttft_p99_s']:.3g} s, TPOT {b.perf['tpot_s'] * 1e3:.3g} ms, cold start {b.perf['replica_start_s']} s; "
              f"accuracy {b.accuracy.kind}: {b.accuracy.source}", soft_wrap=True)
    con.print(f"  fallback: {ch.fallback_text(b)}", soft_wrap=True)
    for line in b.perf["arithmetic"]:
        con.print(f"    {line}", soft_wrap=True)
    if write:
        path = ch.write_profile(b, Path(write), command=f"--gpu {gpu}")
        con.print(f"wrote {path}; build it with `invoke build --profile {path}`")
    return 0


def compare(profiles="all", model=None, gpu=None, out=None, build=False, golden_limit=None, input_len=None,
            output_len=None, concurrency=None, request_rate=None):
    """Table + Pareto chart (accuracy loss vs estimated throughput) of profiles; lists those that cannot run."""
    from precision_pipeline.analysis import choose as ch
    from precision_pipeline.nightly import select_profiles
    from precision_pipeline.resolve import perf as PF
    from rich.table import Table

    wl = _workload(input_len, output_len, concurrency, request_rate)
    names = select_profiles(profiles)  # nightly's --profiles: all, or names without an empty entry (a,,b refused)
    cands = ch.compare(names, plan_model_dir(model), REPO_ROOT / "artifacts", gpu=gpu, workload=wl)
    if build:
        con = console()
        for b in ch.build_unmeasured(cands, _gate_builder(con, model, int_arg("--golden-limit", golden_limit, 1, 1000))):
            if b["reason"] is not None:
                con.print(f"[red]not measured[/] {b['label']}: {b['reason']}", soft_wrap=True)
        cands = ch.compare(names, plan_model_dir(model), REPO_ROOT / "artifacts", gpu=gpu, workload=wl)
    t = Table(title=f"profiles at {wl.describe()} (performance model, range x{PF.RANGE[0]}-x{PF.RANGE[1]}; accuracy: "
                    "measured build, else prior)")
    for col in ("profile", "GPU", "weights/GPU", "KV B/token", "batch", "out tok/s/GPU", "per replica", "TTFT P99",
                "TPOT", "KL P99", "accuracy", "frontier"):
        t.add_column(col)
    for r in ch.table_rows(cands):
        if r["runs"]:
            rg = r["ranges"] or {}
            tps = rg.get("output_tokens_per_s_per_gpu") or [0, 0]
            t.add_row(r["profile"], r["gpu"], f"{r['weight_bytes_per_gpu'] / 2**20:,.1f} MiB", f"{r['kv_bytes_per_token']:,}",
                      f"{r['batch'] or 0:,}", f"{r['output_tokens_per_s_per_gpu']:,.0f} ({tps[0]:,.0f}-{tps[1]:,.0f})",
                      f"{r['output_tokens_per_s_per_replica'] or 0:,.0f}",
                      "n/a" if r["ttft_p99_s"] is None else f"{r['ttft_p99_s']:.3g} s",
                      "n/a" if r["tpot_s"] is None else f"{r['tpot_s'] * 1e3:.3g} ms",
                      "n/a" if r["kl_p99"] is None else f"{r['kl_p99']:.3g}", r["accuracy"], "*" if r["frontier"] else "")
    planning_note(con := console(), plan_model_dir(model), gpu)  # what a folder without weights cannot say
    con.print(t)
    for r in ch.table_rows(cands):
        if not r["runs"]:
            con.print(f"[red]cannot run[/] {r['profile']}: {r['refused']}", soft_wrap=True)
    paths = ch.write_compare(cands, Path(out).expanduser().resolve() if out else REPO_ROOT / "artifacts" / "compare")
    con.print(f"wrote {paths['html']}, {paths['png']}, {paths['json']}")


__all__ = ["recommend", "compare"]
