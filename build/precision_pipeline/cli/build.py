"""``invoke build`` (here or ``--on k8s``), ``invoke check`` and ``invoke profiles``: one call each, printed."""

from __future__ import annotations

from pathlib import Path

from precision_pipeline.cli.console import console, int_arg, planning_note, print_build, stage_line


def build(profile, *, model=None, out=None, strict=False, repo_root=None, golden_limit=None, checkpoint=None,
          image=None, no_wait=False, device="auto", reference_dtype="float32") -> None:
    """``pipeline.run_build`` printing each stage as it ends, then the build table and the output folder."""
    from rich.markup import escape as esc

    from precision_pipeline.pipeline import run_build

    con = console()
    stages = []

    def on_stage(rec):
        stages.append(rec)
        con.print(stage_line(rec), soft_wrap=True)

    try:
        res = run_build(profile, model=model, out=out, strict=strict, repo_root=repo_root,
                        golden_limit=int_arg("--golden-limit", golden_limit, 1, 1000), checkpoint=checkpoint, image=image,
                        on_stage=on_stage, wait=not no_wait,
                        on_wait=lambda msg: con.print(f"[yellow]{esc(msg)}[/]", soft_wrap=True),
                        device=device, reference_dtype=reference_dtype)
    except Exception:
        if stages:
            print_build(stages)
        raise
    print_build(res.stages)
    con.print(f"output: {res.out_dir}")


def build_on(on, profile, model=None, out=None, image=None, golden_limit=None) -> int:
    """``build --on k8s``: the engine build Job for the profile (resolved, never quantized here), applied and
    followed with a kubectl context (returns its exit code, 5 when the Job failed), else printed (0)."""
    from precision_pipeline.core.errors import EXIT_ENGINE_BUILD_FAILED, UserError
    from precision_pipeline.core.outputs import default_out_dir
    from precision_pipeline.engine.job import check_gated_output
    from precision_pipeline.resolve import plan as plan_mod
    from precision_pipeline.gate.verdict import load_build_profile
    from precision_pipeline.serving import build_job, deploy
    from precision_pipeline.spec.default_model import model_dir

    limit = int_arg("--golden-limit", golden_limit, 1, 1000)
    if on != "k8s":
        raise UserError("--on", f"{str(on)[:40]!r} is not a place to build.", "use --on k8s (or leave --on out to build here).")
    if image is not None:  # '' (an unset $IMAGE) is refused, not the default (hostile s15b F8)
        deploy.check_image(image, "--image")
        from precision_pipeline.serving.images import CATALOG, lookup

        if lookup(image) is None:  # hostile s15b F9: busybox or a Triton tag without TensorRT-LLM, silently
            from precision_pipeline.cli.console import console

            console(stderr=True).print(
                f"[yellow]warning[/]: {image} is not in the catalog of Triton + TensorRT-LLM images "
                f"({', '.join(r.tag for r in CATALOG)}): the Job runs trtllm-build inside it, so it must ship TensorRT-LLM "
                "(its versions are recorded in engine/provenance.json); a moving tag (latest) may change between runs.",
                soft_wrap=True)
    prof = load_build_profile(profile)
    plan = plan_mod.resolve(prof, model_dir(model), for_build=True)
    out_dir = check_gated_output(Path(out) if out else default_out_dir(prof.name), prof.name)
    text = build_job.render_job(plan, out_dir, deploy.DEFAULT_IMAGE if image is None else image, model_dir=model_dir(model),
                                golden_limit=limit)
    rc = build_job.apply_and_follow(text)
    if rc is None:
        print(text, end="")
        return 0
    return EXIT_ENGINE_BUILD_FAILED if rc else 0


def check(profile=None, all=False, model=None) -> int:
    """Resolve and check profiles (no heavy work), one line per profile; returns 2 when ``all`` and one is refused."""
    from precision_pipeline.core.errors import EXIT_INVALID, UserError
    from precision_pipeline.core.fingerprint import model_fingerprint
    from precision_pipeline.resolve import plan as plan_mod
    from precision_pipeline.spec.default_model import plan_model_dir

    model_dir = plan_model_dir(model)
    con = console()
    buildable = planning_note(con, model_dir)  # weights and tokenizer there: the build-only rules apply too
    if all:
        bad = 0
        for name, ok, line in plan_mod.check_all(model_dir, for_build=buildable):
            con.print(("[green]ok[/]      " if ok else "[red]refused[/] ") + f"{name}: {line}", soft_wrap=True)
            bad += 0 if ok else 1
        return EXIT_INVALID if bad else 0
    if not profile:
        raise UserError("--profile", "no profile given.", "pass --profile NAME or --all.")
    from precision_pipeline.gate.verdict import load_build_profile  # imports torch (gate.metrics): not for --all
    p = plan_mod.resolve(load_build_profile(profile), model_dir, for_build=buildable)  # the same rules as invoke build
    if buildable and not p.problems:
        from precision_pipeline.quantize.stage import check_dataset_tokens  # imports torch: only when a build could run

        check_dataset_tokens(p.profile.calibration, model_dir)  # token counts of a user dataset, as the build checks
    mem = p.memory
    con.print(f"[green]ok[/] {profile}: weights {mem.weight_gib_per_gpu:.3f} GiB/GPU, "
              f"KV {mem.kv_bytes_per_token} B/token, capacity {mem.kv_tokens_capacity} tokens")
    if p.estimate:
        e = p.estimate
        con.print(f"  {e['kind']} on {e['hardware']['gpu']} ({e['hardware']['source']}):", soft_wrap=True)
        for line in e["arithmetic"]:
            con.print(f"    {line}", soft_wrap=True)
        con.print(f"    tensor parallel: {e['tp_communication']}", soft_wrap=True)
    if buildable:
        fp = model_fingerprint(model_dir).sha256  # full read once, memoized (the build hashes it anyway)
        con.print(f"  model fingerprint (the key of gate.overrides): {fp}", soft_wrap=True)
    else:
        fp = None  # a config.json alone has no fingerprint: it would not be the key the weights give
        con.print("  model fingerprint (the key of gate.overrides): needs the weights", soft_wrap=True)
    bar = p.profile.gate.for_model(fp or "")  # "" matches no override
    whose = ("gate.overrides for this model" if fp in p.profile.gate.overrides else "the profile's own"
             + ("" if fp else " (a gate.overrides entry is found by the fingerprint, once the weights are there)"))
    con.print(f"  gate bar: {whose}: "
              + ", ".join(f"{k} {v:g}" for k, v in bar.thresholds().model_dump().items() if v is not None)
              + (f"; category bars: {', '.join(sorted(bar.categories))}" if bar.categories else ""), soft_wrap=True)
    for w in p.warnings:
        con.print(f"  [yellow]warning[/]: {w}", soft_wrap=True)
    return 0


def profiles(gpu=None, model=None) -> None:
    """Shipped profiles; with ``gpu``, which can run on it and why the others cannot (for ``model``; UserError on
    ``--model`` without ``gpu``)."""
    from precision_pipeline.core.errors import UserError
    from precision_pipeline.spec.profile import shipped_profiles

    con = console()
    if model is not None and not gpu:  # hostile s12 F-D: --model was ignored (a missing folder listed all)
        raise UserError("--model", "is read only with --gpu (which profiles run on that GPU for this model).",
                        "add --gpu (e.g. --gpu h100), or leave --model out to list the shipped profiles.")
    if not gpu:
        for n in shipped_profiles():
            con.print(n)
        return
    from precision_pipeline.resolve import plan as plan_mod
    from precision_pipeline.spec.default_model import plan_model_dir

    path = plan_model_dir(model)
    planning_note(con, path)
    for name, ok, why in plan_mod.profiles_for_gpu(gpu, path):
        con.print(("[green]runs[/]     " if ok else "[red]cannot[/]   ") + f"{name}: {why}", soft_wrap=True)


__all__ = ["build", "build_on", "check", "profiles"]
