"""Skew between a built engine (the stand-in trtllm-build of tests/engine/doubles.py) and the serving side,
refused at pack, deploy and promote: TensorRT-LLM version vs the serving image, SM vs the deployment GPU,
rank files vs tp x pp, limits vs the rendered configs; an unknown image is a warning. Plus the build Job."""

from __future__ import annotations

import json

import pytest
import yaml

from precision_pipeline.core.errors import UserError
from precision_pipeline.engine.preflight import plan_need_bytes
from precision_pipeline.engine.toolchain import detect_toolchain
from precision_pipeline.engine.trtllm_build import run_engine
from precision_pipeline.serving import build_job, deploy, images, pack, release, release_recover, release_state, skew
from precision_pipeline.spec.profile import load_profile, shipped_profiles
from tests.engine import doubles
from tests.serving.test_pack import ckpt, make_plan, model_dir  # noqa: F401  (fixtures)

GOOD_IMAGE = "nvcr.io/nvidia/tritonserver:26.05-trtllm-python-py3"  # ships TensorRT-LLM 1.2.1 (serving/images.py)
PROF = load_profile("fp8-h100")


def engine(tmp_path, monkeypatch, version="1.2.1", plan=None, key="c" * 64):
    tmp_path.mkdir(parents=True, exist_ok=True)
    doubles.install(tmp_path, monkeypatch, version=version)
    plan = plan or make_plan(PROF)
    eng = tmp_path / "build" / "engine"
    run_engine(plan, tmp_path / "ckpt", eng, plan.gpu.sm, detect_toolchain(), checkpoint_key=key,
               gpu_name=plan.gpu.name, need_bytes=plan_need_bytes(plan), on_progress=lambda m: None)
    return eng


def do_pack(tmp_path, model_dir, ckpt, eng, image=GOOD_IMAGE, plan=None, name="out"):  # noqa: F811
    out = tmp_path / name
    return pack.pack_repository(plan or make_plan(PROF), PROF, model_dir, ckpt, eng, True, out / "model_repository",
                                str(out), image=image), out / "model_repository"


def test_catalog_rows_name_their_source():
    assert images.lookup(GOOD_IMAGE).tensorrt_llm == "1.2.1"
    assert images.lookup(deploy.DEFAULT_IMAGE) is not None
    assert all(r.source and r.tag.endswith("-trtllm-python-py3") for r in images.CATALOG)
    assert images.lookup("example.com/triton:custom") is None


def test_matching_engine_packs_with_provenance_in_the_unit(tmp_path, monkeypatch, model_dir, ckpt):  # noqa: F811
    res, repo = do_pack(tmp_path, model_dir, ckpt, engine(tmp_path, monkeypatch))
    unit_engine = repo / res.engine_unit / "engine"
    assert (unit_engine / "provenance.json").is_file() and (unit_engine / "rank0.engine").is_file()
    assert any("TensorRT version of" in n and "not confirmed" in n for n in res.notes)
    assert skew.check_engine(unit_engine, image=GOOD_IMAGE, sm=90, world_size=1)  # the unit verifies (warnings only)


def test_trtllm_version_skew_refused_at_pack(tmp_path, monkeypatch, model_dir, ckpt):  # noqa: F811
    eng = engine(tmp_path, monkeypatch, version="1.2.0")
    with pytest.raises(UserError) as e:
        do_pack(tmp_path, model_dir, ckpt, eng)
    p = e.value.problems[0]
    assert p.rule == "skew.tensorrt_llm" and "1.2.0" in p.reason and "ships 1.2.1" in p.reason
    assert not (tmp_path / "out" / "model_repository").exists()


def test_unknown_image_is_a_warning_that_says_what_to_check(tmp_path, monkeypatch, model_dir, ckpt):  # noqa: F811
    res, _ = do_pack(tmp_path, model_dir, ckpt, engine(tmp_path, monkeypatch), image="example.com/triton:custom")
    note = next(n for n in res.notes if "not in the catalog" in n)
    assert "example.com/triton:custom" in note and "import tensorrt, tensorrt_llm" in note


def test_sm_skew_refused_at_pack(tmp_path, monkeypatch, model_dir, ckpt):  # noqa: F811
    from precision_pipeline.spec.hardware import resolve_gpu

    eng = engine(tmp_path, monkeypatch)
    import dataclasses

    l4 = make_plan(PROF).model_copy(update={"gpu": dataclasses.replace(make_plan(PROF).gpu, sm=resolve_gpu("l4").sm)})
    with pytest.raises(UserError) as e:
        do_pack(tmp_path, model_dir, ckpt, eng, plan=l4)
    assert [p.rule for p in e.value.problems] == ["skew.sm"] and "SM 89" in e.value.problems[0].reason


def test_world_size_and_limit_skews_and_missing_rank(tmp_path, monkeypatch):
    eng = engine(tmp_path, monkeypatch)
    with pytest.raises(UserError) as e:
        skew.check_engine(eng, image=GOOD_IMAGE, sm=90, world_size=2, limits={"max_batch_size": 128, "max_seq_len": 8192})
    assert [p.rule for p in e.value.problems] == ["skew.world_size", "skew.limits"]
    assert e.value.problems[1].field == "engine: config.json build_config.max_batch_size"
    (eng / "rank0.engine").unlink()
    with pytest.raises(UserError, match="rank0.engine"):
        skew.check_engine(eng, image=GOOD_IMAGE, sm=90, world_size=1)


def test_each_skew_refused_at_promote_before_anything_changes(tmp_path, monkeypatch, model_dir, ckpt):  # noqa: F811
    """The one skew check of a release is acceptance's (``check_promotable``, before anything is written);
    ``release.promote`` and ``init_serving_repo`` make none of their own."""
    from precision_pipeline.core.fingerprint import model_fingerprint
    from precision_pipeline.serving.acceptance import check_promotable
    from tests.serving.test_acceptance import fake_build

    from tests.conftest import prof

    fp = model_fingerprint(model_dir).sha256
    loose = prof("fp8-h100", gate={"kl_mean_max": 0.1, "min_prompts": 18})  # a bar the synthetic gate numbers meet
    res, packed = do_pack(tmp_path, model_dir, ckpt, engine(tmp_path, monkeypatch))
    fake_build(packed.parent, loose, fp, packed=packed)
    serving = tmp_path / "serving" / "model_repository"
    for kw, rule in (({"image": "nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3", "sm": 90}, "skew.tensorrt_llm"),
                     ({"image": GOOD_IMAGE, "sm": 100}, "skew.sm"), ({"image": None, "sm": 100}, "skew.sm")):
        with pytest.raises(UserError) as e:
            check_promotable(loose, packed.parent, packed, **kw)
        assert rule in [p.rule for p in e.value.problems] and not serving.exists()
    check_promotable(loose, packed.parent, packed, image=GOOD_IMAGE, sm=90)
    release_recover.init_serving_repo(serving, packed)
    state = json.loads(release_state.state_path(serving).read_text())
    # a second build whose engine was then altered: acceptance refuses it, and so does install (unit_files)
    other = engine(tmp_path / "b", monkeypatch, key="d" * 64)
    res2, packed2 = do_pack(tmp_path, model_dir, ckpt, other, name="out2")
    fake_build(packed2.parent, loose, fp, packed=packed2)
    f = packed2 / res2.engine_unit / "engine" / "rank0.engine"
    f.unlink()
    f.write_bytes(b"rank file of another build")
    with pytest.raises(UserError) as e:
        check_promotable(loose, packed2.parent, packed2, image=GOOD_IMAGE, sm=90)
    assert any("rank0.engine" in p.field for p in e.value.problems)
    with pytest.raises(UserError) as e:
        release.promote(serving, packed2)
    assert e.value.problems[0].field.endswith("rank0.engine")
    assert json.loads(release_state.state_path(serving).read_text()) == state


def test_release_makes_no_skew_check_of_its_own():
    """One home: the skew check of a release is ``acceptance.check_promotable``'s."""
    import inspect

    assert not hasattr(release, "check_unit_skew")
    src = inspect.getsource(release)
    assert "check_engine" not in src and "check_unit_skew" not in src and "import skew" not in src


def test_deploy_refuses_a_skewed_engine(tmp_path, monkeypatch, model_dir, ckpt):  # noqa: F811
    _, repo = do_pack(tmp_path, model_dir, ckpt, engine(tmp_path, monkeypatch))
    plan = make_plan(PROF)
    with pytest.raises(UserError) as e:
        deploy.render_manifests(deploy.ManifestInputs(plan, PROF, repo, str(tmp_path / "out"), image="nvcr.io/nvidia/tritonserver:25.12-trtllm-python-py3"), tmp_path / "out")
    assert e.value.problems[0].rule == "skew.tensorrt_llm"
    deploy.render_manifests(deploy.ManifestInputs(plan, PROF, repo, str(tmp_path / "out"), image=GOOD_IMAGE), tmp_path / "out")


@pytest.mark.parametrize("name", shipped_profiles())
def test_build_job_renders_valid_for_every_shipped_profile(tmp_path, name):
    from precision_pipeline.resolve import plan as P
    from precision_pipeline.spec.default_model import ensure_default_model
    from precision_pipeline.spec.hardware import resolve_gpu

    prof = load_profile(name)
    plan = P.evaluate(prof, ensure_default_model())
    text = build_job.render_job(plan, tmp_path / name)
    doc = yaml.safe_load(text)
    # block style in the template's key order (not sorted: metadata's name first)
    assert text.splitlines()[2:6] == ["apiVersion: batch/v1", "kind: Job", "metadata:", f"  name: {doc['metadata']['name']}"]
    assert doc["spec"]["activeDeadlineSeconds"] == 21600  # 6 hours
    deploy.validate_manifest(doc, "job", deploy.K8S_VERSION)
    spec = doc["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert doc["kind"] == "Job" and c["image"] == deploy.DEFAULT_IMAGE
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": deploy.gpu_product_label(resolve_gpu(prof.target.gpu).name)}
    assert c["resources"]["limits"]["nvidia.com/gpu"] == prof.world_size
    assert c["command"] == ["python3", "-m", "precision_pipeline.engine.job"]
    assert c["args"] == ["--out", str((tmp_path / name).resolve()), "--strict"]
    assert c["volumeMounts"][0]["mountPath"] == str((tmp_path / name).resolve())
    assert {"name": "PRECISION_IMAGE", "value": deploy.DEFAULT_IMAGE} in c["env"]


@pytest.mark.parametrize("rec, mapping, world_size, rules", [
    ({"world_size": 1, "sm": 90}, {"tp_size": 1}, 1, []),                       # no pp_size: pp 1
    ({"world_size": 2, "sm": 90}, {"tp_size": 2}, 2, []),
    ({"world_size": 2, "sm": 90}, {"pp_size": 2}, 2, []),                       # no tp_size: tp 1
    ({"world_size": 1, "sm": 90}, {"tp_size": 2, "pp_size": 1}, 1, ["skew.world_size"]),  # rank files agree, config.json does not
    ({"world_size": 1, "sm": 90}, {"world_size": 2}, 1, ["skew.world_size"]),
    ({"sm": 90}, {}, 1, ["skew.world_size"]),                                     # no world size recorded: 0 ranks
    ({"world_size": 1, "sm": 90, "gpus": [{"sm": 90, "name": "H100"}, {"sm": 89, "name": "L4"}]}, {}, 1, ["skew.sm"]),
    ({"world_size": 1, "sm": 90, "gpus": None}, {}, 1, []),
])
def test_world_size_and_sm_rules_on_recorded_numbers(tmp_path, monkeypatch, rec, mapping, world_size, rules):
    """check_engine's own arithmetic on a provenance record and config.json mapping given by hand (verify_engine_dir
    stands in): ranks and the mapping's tp x pp both equal the deployment's; every SM that built it is the deployment's."""
    monkeypatch.setattr(skew, "verify_engine_dir", lambda d, field: rec)
    (tmp_path / "config.json").write_text(json.dumps({"pretrained_config": {"mapping": mapping}}))
    if not rules:
        assert skew.check_engine(tmp_path, image=None, sm=90, world_size=world_size) == []
        return
    with pytest.raises(UserError) as e:
        skew.check_engine(tmp_path, image=None, sm=90, world_size=world_size)
    assert [p.rule for p in e.value.problems] == rules
