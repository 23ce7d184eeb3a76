"""quantize.ptq.captured_warnings: third-party warnings go to the stage's log; expected ones print nothing."""

from __future__ import annotations

import logging
import warnings

from precision_pipeline.core.progress import StageProgress
from precision_pipeline.quantize.ptq import QUANTIZE_LOG, QUANTIZE_WARNINGS, captured_warnings, read_quantize_warnings


def test_warnings_are_logged_and_only_unexpected_ones_printed(tmp_path):
    out: list[str] = []
    prog = StageProgress("quantize", mode="lines", write=out.append, heartbeat=False)
    log = tmp_path / QUANTIZE_LOG
    with captured_warnings(log, prog):
        warnings.warn("Enable lm_head quantization. lm_head quantization may lead to additional accuracy loss.")
        warnings.warn("Cannot export tensorrt_llm checkpoint config due to the following error. Trying the manual "
                      "approach: \nNo module named 'tensorrt_llm'")
        warnings.warn("amax of layer 3 is zero")
        warnings.warn("amax of layer 3 is zero")  # another line: recorded again, printed once with a count
        logging.getLogger("modelopt.torch.export").warning("odd export %s", "thing")
    text = log.read_text()
    assert text.startswith("# quantize run ") and ": 5 warning(s)" in text.splitlines()[0]
    for s in ("Enable lm_head quantization", "No module named 'tensorrt_llm'", "amax of layer 3 is zero",
              "WARNING modelopt.torch.export: odd export thing"):
        assert s in text
    assert "UserWarning (test_quantize_log.py:20): amax of layer 3 is zero" in text  # the log keeps the origin
    assert out == [f"[quantize] warning: UserWarning: amax of layer 3 is zero (2 times) (see {log})",
                   f"[quantize] warning: WARNING modelopt.torch.export: odd export thing (see {log})"]


def test_warnings_expected_by_the_run_itself_print_nothing(tmp_path):
    """SmoothQuant's "X is not calibrated, skip smoothing" is expected for the modules the run kept in
    high precision (added to ``expected`` inside the block), and still printed for any other module."""
    import json

    out: list[str] = []
    prog = StageProgress("quantize", mode="lines", write=out.append, heartbeat=False)
    expected: dict[str, str] = {}
    with captured_warnings(tmp_path / QUANTIZE_LOG, prog, record_path=tmp_path / QUANTIZE_WARNINGS, expected=expected):
        warnings.warn("model.layers.11.mlp.down_proj is not calibrated, skip smoothing")
        warnings.warn("model.layers.1.mlp.down_proj is not calibrated, skip smoothing")
        expected[r"\bmodel\.layers\.11\.mlp\.down_proj is not calibrated, skip smoothing"] = "kept in high precision"
    assert out == [f"[quantize] warning: UserWarning: model.layers.1.mlp.down_proj is not calibrated, skip smoothing "
                   f"(see {tmp_path / QUANTIZE_LOG})"]
    recs = json.loads((tmp_path / QUANTIZE_WARNINGS).read_text())["warnings"]
    assert [r["expected"] for r in recs] == ["kept in high precision", None]


def test_nothing_to_log_writes_no_file(tmp_path):
    prog = StageProgress("quantize", mode="lines", write=lambda s: None, heartbeat=False)
    with captured_warnings(tmp_path / QUANTIZE_LOG, prog):
        pass
    assert not (tmp_path / QUANTIZE_LOG).exists()


def test_a_failed_run_writes_no_log(tmp_path):
    import pytest

    prog = StageProgress("quantize", mode="lines", write=lambda s: None, heartbeat=False)
    with pytest.raises(RuntimeError), captured_warnings(tmp_path / QUANTIZE_LOG, prog):
        warnings.warn("something before the refusal")
        raise RuntimeError("refused")
    assert not (tmp_path / QUANTIZE_LOG).exists()


def test_warnings_are_recorded_for_the_gate_report(tmp_path):
    """record_path: the same warnings as records (level, origin, message, why expected) in the checkpoint folder."""
    prog = StageProgress("quantize", mode="lines", write=lambda s: None, heartbeat=False)
    rec = tmp_path / "ckpt" / QUANTIZE_WARNINGS
    (tmp_path / "ckpt").mkdir()
    with captured_warnings(tmp_path / QUANTIZE_LOG, prog, record_path=rec):
        warnings.warn("Enable lm_head quantization. lm_head quantization may lead to additional accuracy loss.")
        warnings.warn("Warning: Large KV activation detected: 0.71, Quantized KV cache may lead to higher accuracy drop.")
        logging.getLogger("modelopt.torch.quantization").warning("amax of %s is zero", "layer 4")
        logging.getLogger("modelopt").info("Inserted 210 quantizers")  # info: not a warning, not recorded
    d = read_quantize_warnings(tmp_path / "ckpt")
    assert d is not None and d["source"]
    assert [(w["level"], w["message"], w["expected"]) for w in d["warnings"]] == [
        ("UserWarning", "Enable lm_head quantization. lm_head quantization may lead to additional accuracy loss.",
         "lm_head stays BF16 in the exported checkpoint (excluded)"),
        ("UserWarning", "Warning: Large KV activation detected: 0.71, Quantized KV cache may lead to higher accuracy drop.",
         None),
        ("WARNING", "amax of layer 4 is zero", None)]
    assert d["warnings"][0]["origin"].startswith("test_quantize_log.py:")
    assert d["warnings"][2]["origin"] == "modelopt.torch.quantization"


def test_an_empty_record_is_written_and_a_missing_one_reads_none(tmp_path):
    prog = StageProgress("quantize", mode="lines", write=lambda s: None, heartbeat=False)
    with captured_warnings(tmp_path / QUANTIZE_LOG, prog, record_path=tmp_path / QUANTIZE_WARNINGS):
        pass
    assert read_quantize_warnings(tmp_path) == {"source": read_quantize_warnings(tmp_path)["source"], "warnings": []}
    assert not (tmp_path / QUANTIZE_LOG).exists()
    assert read_quantize_warnings(tmp_path / "nowhere") is None
    (tmp_path / QUANTIZE_WARNINGS).write_text("[1, 2]")
    assert read_quantize_warnings(tmp_path) is None


def test_test_checkpoints_carry_the_real_modelopt_warnings(fp8_checkpoint):
    """The session's FP8 checkpoint is recorded as run_quantize records (tests/conftest.py build_test_checkpoint)."""
    d = read_quantize_warnings(fp8_checkpoint)
    assert d is not None
    assert any("lm_head" in w["message"] and w["expected"] and w["origin"].startswith("postprocess.py:") for w in d["warnings"])


def test_third_party_prints_are_labelled_and_ours_pass_through(capsys):
    """ModelOpt print()s ("Inserted 756 quantizers") get a label saying whose line it is; our own
    ``[stage] ...`` lines and blank lines are left as they are / dropped."""
    import sys

    from precision_pipeline.quantize.ptq import labelled_prints

    with labelled_prints("quantize"):
        print("Inserted 756 quantizers")
        print("[quantize] calibration pass 1: 32/32 samples")
        print()
        print("current rank: 0, tp rank: 0, ", end="")
        sys.stdout.write("[quantize] export: running (10s)\n")  # a heartbeat line in between
        print("pp rank: 0")
        print("no newline at the end", end="")
    assert capsys.readouterr().out.splitlines() == [
        "[quantize] ModelOpt: Inserted 756 quantizers",
        "[quantize] calibration pass 1: 32/32 samples",
        "[quantize] export: running (10s)",
        "[quantize] ModelOpt: current rank: 0, tp rank: 0, pp rank: 0",
        "[quantize] ModelOpt: no newline at the end"]
