"""The two serving routes in one serving repository (issue 28), files only (no server; the live sequence is
tests/serving/test_rollout.py ``test_engine_release_llm_api_rollout_and_rollback_under_load``): LLM-API units are
promoted, kept, removed and rolled back to like engine units, releases.json records each release's serving route and
provenance, the ensemble is left alone while an LLM-API unit is current, and the text probe never passes what it
cannot judge."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from precision_pipeline.core.errors import UserError
from precision_pipeline.serving import (llmapi_unit, pack, probe, release, release_configs, release_recover, release_state,
                                        release_units)
from precision_pipeline.spec.profile import GateThresholds
from tests.serving.test_llmapi_contract import MODEL_YAML
from tests.serving.test_release_safety import serving_repo, units4  # noqa: F401  (module fixture)


def llm_api_build(base: Path, default_model_dir: Path, salt: str) -> tuple[Path, str]:
    """A packed repository with one LLM-API unit over a stand-in checkpoint folder (config.json + one weights file whose
    bytes ``salt`` makes distinct: another content key); nothing here loads it."""
    ck = base / "checkpoint"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (ck / "model.safetensors").write_bytes(salt.encode() * 64)
    repo = base / "model_repository"
    repo.mkdir()
    u = llmapi_unit.pack_llm_api_unit(repo, MODEL_YAML, ck, default_model_dir, str(base.resolve()),
                                      {"profile": "fp8-h100-llmapi"}, version="1.2.1")
    (repo / pack.PACK_FILE).write_text(json.dumps({"engine_unit": u.name, "unit_key": u.key, "unit_files": u.unit_files}))
    return repo, u.name


@pytest.fixture(scope="module")
def llm2(tmp_path_factory, default_model_dir):
    base = tmp_path_factory.mktemp("llm-api-builds")
    return [llm_api_build(base / s, Path(default_model_dir), s) for s in ("one", "two")]


def test_llm_api_units_are_releases_like_engine_units(tmp_path, units4, llm2):  # noqa: F811
    a, b = units4[0], units4[1]
    (l1_repo, l1), (l2_repo, l2) = llm2
    repo = serving_repo(tmp_path, a)  # keep_releases 2
    release.promote(repo, l1_repo, profile="fp8-h100-llmapi")
    st = release_state.read_state(repo)
    rec = st["releases"][-1]
    assert (st["current"], rec["unit"], rec["serving_route"], rec["engine_present"]) == (l1, l1, "llm_api", True)
    files = st["unit_files"][l1]
    ckpt = {k: v for k, v in sorted(files.items()) if k.startswith("checkpoint/")}
    from precision_pipeline.core.store import hash_obj

    assert rec["provenance"] == {"checkpoint_key": hash_obj(ckpt), "runtime": "tensorrt_llm 1.2.1",
                                 "config_key": hash_obj({k: v for k, v in MODEL_YAML.items() if k != "model"})}
    assert st["releases"][0]["serving_route"] == "engine" and st["releases"][0]["provenance"] == {"engine_hash": a.engine_hash}
    # the ensemble keeps its engine unit (it cannot call an LLM-API unit); the BLS and route.json name the release
    assert release_configs.current_of_configs(repo) == (a.engine_unit, l1)
    assert release_configs.configs_agree(repo, l1) and not release_configs.configs_agree(repo, a.engine_unit)
    assert release_state.serving_models(repo, st) == ["preprocessing", "postprocessing", l1, "tensorrt_llm_bls"]
    assert (repo / l1 / "1" / "model.py").read_bytes() == llmapi_unit.STAND_IN.read_bytes()  # serving side, unrecorded
    assert "1/model.py" not in files
    assert release_recover.recover(repo) == []  # recovery finds nothing to fix in a mixed repository
    # retention counts LLM-API releases like engine ones: A, L1, B, L2 with keep_releases 2 -> A (the oldest) goes
    release.promote(repo, b.out_dir, profile="bf16-h100")
    release.promote(repo, l2_repo, profile="fp8-h100-llmapi")
    st = release_state.read_state(repo)
    on_disk = sorted(p.name for p in repo.iterdir() if release_units.is_any_unit(p.name))
    assert on_disk == sorted([l1, b.engine_unit, l2]) and sorted(st["unit_files"]) == on_disk
    assert release.list_releases(repo)["on_disk"] == on_disk
    # rollback across routes: to the previous (engine) release, then by a hex prefix to the LLM-API one
    assert release.rollback(repo)["unit"] == b.engine_unit
    assert release_configs.current_of_configs(repo) == (b.engine_unit, b.engine_unit)
    assert release.rollback(repo, to=l1[len("llm_api_"):][:6])["unit"] == l1
    assert release.rollback(repo, to=l2)["unit"] == l2
    assert release_state.read_state(repo)["current"] == l2
    # and an LLM-API release beyond keep_releases leaves the disk and the record: B, L2 kept, L1 removed
    release.rollback(repo, to=b.engine_unit)
    release.promote(repo, units4[3].out_dir, profile="bf16-h100")
    st = release_state.read_state(repo)
    assert not (repo / l1).exists() and l1 not in st["unit_files"] and l1 not in {r["unit"] for r in st["releases"]}
    assert release.list_releases(repo)["on_disk"] == sorted([b.engine_unit, l2, units4[3].engine_unit])


def test_first_promote_of_an_llm_api_build_takes_the_fallbacks_ensemble(tmp_path, units4, llm2):  # noqa: F811
    (l1_repo, l1), _ = llm2
    fb = units4[2]
    with pytest.raises(UserError, match="no ensemble model and no engine-route fallback") as ei:
        release_recover.init_serving_repo(tmp_path / "no-fb" / "model_repository", l1_repo)
    assert ei.value.problems[0].field == "--profile" and not (tmp_path / "no-fb" / "model_repository").exists()
    repo = tmp_path / "s" / "model_repository"
    st = release_recover.init_serving_repo(repo, l1_repo, profile="fp8-h100-llmapi", fallback_repo=fb.out_dir)
    assert (st["current"], st["fallback"]) == (l1, fb.engine_unit)
    assert [r["serving_route"] for r in st["releases"]] == ["llm_api", "engine"]
    assert release_configs.current_of_configs(repo) == (fb.engine_unit, l1)
    # the install points model.yaml at the unit's checkpoint/ in the serving repository (release_units.served_path)
    assert f"/{repo.name}/{l1}/checkpoint" in (repo / l1 / "1" / "model.yaml").read_text()
    assert release.rollback(repo, fallback=True)["unit"] == fb.engine_unit  # an LLM-API release falls back to an engine one
    assert release_configs.current_of_configs(repo) == (fb.engine_unit, fb.engine_unit)


class _Client:
    """A tritonclient stand-in for ``run_text_probe``: answers each context text from ``answers``."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    def infer(self, unit, inputs):
        self.calls.append(unit)
        self.inputs = sorted(x.name() for x in inputs)
        ans = self.answers(len(self.calls))
        return type("R", (), {"as_numpy": lambda _s, name: np.array([ans.encode()], dtype=object)})()

    def close(self):
        pass


def _probe_set(top1_min):
    rows = [(0, "ctx a", " Paris"), (2, "ctx b", "."), (3, "ctx c", "")]
    p = probe.ProbePrompt("p", "facts", [1, 2, 3, 4], slice(0, 4), None, np.zeros(4), np.array([True, True, False, True]),
                          rows)
    return probe.ProbeSet([p], GateThresholds(top1_min=top1_min, kl_p99_max=0.5), 0, Path("/gate"), "k")


@pytest.mark.parametrize("answers, top1_min, passed, top1", [
    (lambda i: [" Paris", ".", ""][i - 1], 0.9, True, 1.0),
    (lambda i: [" Paris", ",", ""][i - 1], 0.9, False, 2 / 3),
    (lambda i: [" Paris", ".", ""][i - 1], None, False, 1.0),  # no top1_min: it cannot judge, so it does not pass
])
def test_text_probe_judges_top1_through_text_and_never_passes_what_it_cannot_judge(answers, top1_min, passed, top1):
    srv = type("S", (), {})()
    cl = _Client(answers)
    srv.http_client = lambda: cl
    res = probe.run_probe(srv, "llm_api_0123456789ab", _probe_set(top1_min))
    assert cl.calls == ["llm_api_0123456789ab"] * 3 and res.method == "text"
    assert cl.inputs == sorted(["text_input", "sampling_param_max_tokens", "sampling_param_top_k",
                                "sampling_param_exclude_input_from_output"])  # greedy, one token, the new text only
    assert (res.passed, res.top1, res.tokens, res.kl_p99) == (passed, pytest.approx(top1), 3, None)
    assert res.gate_same_prompts == {"top1": pytest.approx(2 / 3), "tokens": 3}  # the gate's rows 0, 2, 3
    assert res.checks["kl_p99"]["passed"] is None and "no logits" in res.checks["kl_p99"]["why"]
    if top1_min is None:
        assert res.checks["judged"]["passed"] is False and res.failures == ["judged"]
    else:
        assert res.failures == ([] if passed else ["top1"])


def test_text_rows_are_what_the_runtime_would_tokenize(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "Capital of France?"},
                                   {"role": "assistant", "content": "Paris is the capital."}], tokenize=True)
    n = len(ids)
    answer = slice(n - 8, n - 1)
    ref = list(ids[answer.start + 1:answer.stop + 1])  # a reference whose top-1 is the next token everywhere
    ref[1] = tok.convert_tokens_to_ids("Ġ")  # a whole-character token: kept
    byte_tok = next(t for t in range(tok.vocab_size) if "\ufffd" in tok.decode([t]))
    ref[2] = byte_tok  # part of a character: equal texts would not mean equal tokens, so the row is left out
    rows = probe.text_rows(tok, ids, answer, ref)
    assert [k for k, _c, _w in rows] == [0, 1, 3, 4, 5, 6]
    for k, ctx, want in rows:
        assert tok(ctx).input_ids == list(ids[:answer.start + k + 1]) and want == tok.decode([ref[k]], skip_special_tokens=True)
