"""The stage runner's cache decisions on a toy stage (fast; the full builds are in test_stages.py).

A stage is reused only when its key is unchanged, its typed record in ``.stages/`` has that key and
names that stage, the artifact says ``done`` and is present, and its output folder exists; otherwise
it runs again, atomically, and writes its record and manifest row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar, Optional

import pytest

from precision_pipeline.core import stage as S


class ToyInputs(S.Frozen):
    value: int


class ToyArtifact(S.Artifact):
    value: int

    def summary(self):
        return {"value": self.value}

    def present(self, out_dir: Path) -> bool:
        return (Path(out_dir) / "toy" / "out.txt").is_file()


class Toy(S.Stage[ToyInputs, ToyArtifact]):
    name = "toy"
    version = 1
    code = ("core",)
    output: ClassVar[Optional[str]] = "toy"
    artifact_type = ToyArtifact

    def __init__(self, value=1, status="done"):
        self.value, self.status, self.runs = value, status, 0

    def inputs(self, plan, request, upstream):
        return ToyInputs(value=self.value)

    def run(self, inputs, workdir):
        import time

        self.runs += 1
        time.sleep(0.0123)  # a duration with more than 3 decimals, so the row's rounding shows
        (Path(workdir) / "out.txt").write_text(str(inputs.value))
        return ToyArtifact(value=inputs.value, status=self.status)


class PlainArtifact(S.Artifact):
    value: int


class NoOutput(Toy):
    name = "nooutput"
    output = None
    artifact_type = PlainArtifact

    def run(self, inputs, workdir):
        assert workdir is None
        self.runs += 1
        return PlainArtifact(value=inputs.value)


def runner(out: Path) -> S.StageRunner:
    return S.StageRunner(out, S.Manifest.open(out / "manifest.json", profile="p", profile_source="p", model_dir="m",
                                              out_dir=str(out)))


def once(out: Path, stage) -> S.Done:
    return runner(out).run(stage, None, None, {})


def test_first_run_writes_folder_record_and_row(tmp_path):
    st = Toy(7)
    d = once(tmp_path, st)
    assert st.runs == 1 and d.record.status == "done" and d.dir == tmp_path / "toy"
    assert (tmp_path / "toy" / "out.txt").read_text() == "7"
    rec = json.loads((tmp_path / S.RECORDS_DIR / "toy.json").read_text())
    assert rec["stage"] == "toy" and rec["key"] == d.key and rec["artifact"]["value"] == 7
    assert d.record.numbers == {"value": 7} and d.record.key == d.key
    assert 0.0 <= d.record.seconds < 60.0  # wall seconds of this run, not a clock reading


def test_unchanged_key_is_reused(tmp_path):
    once(tmp_path, Toy(7))
    st = Toy(7)
    d = once(tmp_path, st)
    assert st.runs == 0 and d.record.status == "cached" and d.artifact.value == 7 and d.record.seconds == 0.0


def test_changed_inputs_or_version_run_again(tmp_path):
    k1 = once(tmp_path, Toy(7)).key
    st = Toy(8)
    d = once(tmp_path, st)
    assert st.runs == 1 and d.key != k1 and (tmp_path / "toy" / "out.txt").read_text() == "8"

    class Toy2(Toy):
        version = 2

    st2 = Toy2(8)
    assert once(tmp_path, st2).key != d.key and st2.runs == 1


@pytest.mark.parametrize("damage", ["folder", "file", "record", "record_key", "record_stage", "record_garbage"])
def test_missing_or_mismatched_pieces_run_again(tmp_path, damage):
    d = once(tmp_path, Toy(7))
    rec_path = tmp_path / S.RECORDS_DIR / "toy.json"
    rec = json.loads(rec_path.read_text())
    if damage == "folder":
        import shutil

        shutil.rmtree(tmp_path / "toy")
    elif damage == "file":
        (tmp_path / "toy" / "out.txt").unlink()
    elif damage == "record":
        rec_path.unlink()
    elif damage == "record_key":
        rec_path.write_text(json.dumps({**rec, "key": "0" * 64}))
    elif damage == "record_stage":
        rec_path.write_text(json.dumps({**rec, "stage": "other"}))
    else:
        rec_path.write_text("{not json")
    st = Toy(7)
    again = once(tmp_path, st)
    assert st.runs == 1 and again.record.status == "done" and again.key == d.key


@pytest.mark.parametrize("status", ["failed", "skipped"])
def test_a_not_done_artifact_is_never_reused(tmp_path, status):
    once(tmp_path, Toy(7, status=status))
    st = Toy(7, status=status)
    d = once(tmp_path, st)
    assert st.runs == 1 and d.record.status == status


def test_a_failed_verdict_is_reused_when_the_stage_says_so(tmp_path):
    """``reuse_failed`` (the gates): a failed artifact of an unchanged key is a result, not re-run; a
    skipped one still runs again, and a changed key runs again."""
    class Verdict(Toy):
        reuse_failed = True

    once(tmp_path, Verdict(7, status="failed"))
    st = Verdict(7, status="failed")
    d = once(tmp_path, st)
    assert st.runs == 0 and d.record.status == "cached" and d.artifact.status == "failed"
    st = Verdict(8, status="failed")
    assert once(tmp_path, st).record.status == "failed" and st.runs == 1
    once(tmp_path, Verdict(9, status="skipped"))
    st = Verdict(9, status="skipped")
    assert once(tmp_path, st).record.status == "skipped" and st.runs == 1


def test_a_stage_that_is_not_cacheable_always_runs(tmp_path):
    class Always(Toy):
        cacheable = False

    once(tmp_path, Always(1))
    st = Always(1)
    once(tmp_path, st)
    assert st.runs == 1 and not (tmp_path / S.RECORDS_DIR / "toy.json").exists()


def test_a_stage_without_output_folder_is_cached_by_record(tmp_path):
    st = NoOutput(3)
    d = once(tmp_path, st)
    assert d.dir is None and (tmp_path / S.RECORDS_DIR / "nooutput.json").is_file()
    st2 = NoOutput(3)
    assert once(tmp_path, st2).record.status == "cached" and st2.runs == 0


def test_wrong_artifact_type_is_an_error_and_leaves_no_folder(tmp_path):
    class Liar(Toy):
        def run(self, inputs, workdir):
            return S.Artifact()

    with pytest.raises(TypeError, match="returned Artifact, not ToyArtifact"):
        once(tmp_path, Liar(1))
    assert not (tmp_path / "toy").exists() and not (tmp_path / S.RECORDS_DIR / "toy.json").exists()


def test_manifest_row_and_render(tmp_path):
    r = runner(tmp_path)
    d = r.run(Toy(5), None, None, {})
    row = json.loads((tmp_path / "manifest.json").read_text())["stages"]["toy"]
    assert row == {"status": "done", "seconds": round(d.record.seconds, 3), "reason": "", "key": d.key,
                   "numbers": {"value": 5}}
    assert row["seconds"] >= 0.012 and row["seconds"] == round(row["seconds"], 3) != d.record.seconds
    assert [x.name for x in r.records] == ["toy"]
    r.manifest.finish(engine_present=False)
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["engine_present"] is False and m["finished"] >= m["started"]


def test_execute_without_output_dir_runs_in_place():
    st = NoOutput(4)
    d = S.execute(st, None, None, {}, out_dir=None, cached=None)
    assert st.runs == 1 and d.dir is None and d.record.status == "done"
