"""quantize.ptq.captured_warnings: third-party warnings go to the stage's log; expected ones print nothing."""

from __future__ import annotations

import logging
import warnings

from precision_pipeline.core.progress import StageProgress
from precision_pipeline.quantize.ptq import QUANTIZE_LOG, captured_warnings


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
