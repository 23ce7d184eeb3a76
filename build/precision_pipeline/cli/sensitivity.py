"""``invoke sensitivity``: the per-layer analysis (``analysis/sensitivity.py``), its table and suggestion printed."""

from __future__ import annotations

import os
from pathlib import Path

from precision_pipeline.cli.console import console, margin as margin_arg, parse_layers
from precision_pipeline.spec.default_model import model_dir as build_model_dir


def sensitivity(profile, model=None, out=None, prompts=None, fresh=False, checkpoint=None, layers=None,
                write_profile=None, margin=None):
    """Per-layer sensitivity: quantize one cell at a time, KL heatmap, cheapest exclude_modules that pass the gate."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP (shared CPUs)
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.core.outputs import default_out_dir
    from precision_pipeline.spec.profile import load_profile
    from precision_pipeline.analysis.sensitivity import SensitivityOptions, SensitivityRuntime, run_sensitivity

    prof = load_profile(profile)
    model_dir = build_model_dir(model)
    out_dir = Path(out).expanduser().resolve() if out else default_out_dir(prof.name)
    try:
        n = 1 if prompts is None else int(prompts)  # default None: invoke would int() a typed default itself
    except ValueError:
        n = 0
    if n < 1:
        raise UserError("--prompts", f"{prompts!r} is not a positive number of prompts per category.", "pass e.g. --prompts 1.")
    if write_profile:  # a bad target is refused before minutes of measuring, not after
        from precision_pipeline.analysis.sensitivity import extends_reference
        from precision_pipeline.spec.profile import check_profile_target

        extends_reference(profile, check_profile_target(Path(write_profile), "--write-profile", name_from_stem=True))
    res = run_sensitivity(prof, model_dir, out_dir, SensitivityOptions(prompts_per_category=n),
                          SensitivityRuntime(fresh=bool(fresh), margin=margin_arg(margin)),
                          checkpoint_dir=Path(checkpoint).expanduser() if checkpoint else None, layers=parse_layers(layers))
    d = res.data
    con = console()
    from rich.table import Table

    t = Table(title=f"most sensitive cells ({d['prompts']['answer_tokens']} answer tokens, "
                    f"{len(d['prompts']['ids'])} prompts)")
    for col in ("cell", "KL mean", "KL P99", "top-1", "exclusion cost"):
        t.add_column(col)
    for name in d["ranking"][:10]:
        r = d["cells"][name]
        cost = f"{r['cost_bytes'] / 1024:.0f} KiB" if "cost_bytes" in r else "not excludable"
        t.add_row(name, f"{r['kl_mean']:.3g}", f"{r['kl_p99']:.3g}", f"{r['top1']:.3f}", cost)
    con.print(t)
    f, s = d["full"], d["suggestion"]
    con.print(f"all cells quantized: KL mean {f['kl_mean']:.3g} (sum of cells {f['sum_of_cells_kl_mean']:.3g}), "
              f"P99 {f['kl_p99']:.3g}, top-1 {f['top1']:.3f}")
    if not s["cells"]:
        con.print("suggestion: nothing to exclude (the quantized cells already meet the gate's KL thresholds on this subset)")
    else:
        m = s.get("measured") or {}
        verdict = ("predicted to meet" if s["reachable"] else "cannot meet") + " the KL thresholds" + (
            "" if "meets_measured" not in s else f"; measured: {'meets' if s['meets_measured'] else 'MISSES'}")
        con.print(f"suggestion ({verdict}, {len(s.get('rounds') or [1])} round(s)): keep "
                  f"{len(s['cells'])} cell(s) in BF16, +{s['cost_bytes'] / 2**20:.2f} MiB", soft_wrap=True)
        con.print(f"  exclude_modules: {s['exclude_modules']}", soft_wrap=True)
        con.print(f"  predicted KL mean {s['predicted']['kl_mean']:.3g} / P99 {s['predicted']['kl_p99']:.3g}; measured "
                  f"{m.get('kl_mean', float('nan')):.3g} / {m.get('kl_p99', float('nan')):.3g}, top-1 "
                  f"{m.get('top1', float('nan')):.3f}", soft_wrap=True)
    con.print(f"{len(res.computed)} measured, {len(res.reused)} reused, {d['timings_s']['total']:.0f} s; "
              f"{res.json_path}, {res.heatmap_path}")
    if write_profile:
        from precision_pipeline.analysis.sensitivity import write_tuned_profile

        cmd = f"--profile {profile} --prompts {n}" + (f" --margin {margin}" if margin else "") + (
            f" --layers {layers}" if layers else "") + (f" --model {model}" if model else "")
        path = write_tuned_profile(d, profile, Path(write_profile), command=cmd)
        con.print(f"wrote {path}: build it with invoke build --profile {path}", soft_wrap=True)


__all__ = ["sensitivity"]
