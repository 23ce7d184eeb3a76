"""Findings of the session-9 hostile round (issue 25; log /work/helpers/s9/hostile-round-s9.md) outside the serving
repository code, as regression tests (each seen failing before its fix)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from precision_pipeline.core.errors import UserError

ROOT = Path(__file__).resolve().parent.parent


def test_a_full_stdout_is_one_line_on_stderr_exit_2():
    """F5: `invoke schema > /dev/full` ended in a double traceback, exit 1 (report() printed to the same stdout)."""
    with open(os.devnull if not Path("/dev/full").exists() else "/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "invoke", "schema"], cwd=ROOT, stdout=full, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    assert r.returncode == 2, r.stderr
    assert r.stderr == ("error: cannot write the standard output: No space left on device (a redirect to a full disk "
                        "or /dev/full?)\n")


def test_a_refusal_with_a_full_stdout_goes_to_stderr(capfd, monkeypatch):
    """F5, a refusal: its text is not lost when stdout cannot be written."""
    from precision_pipeline.cli import console

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(console, "_print_report", full)
    monkeypatch.setattr(console, "_silence_stdout", lambda: None)  # pytest's captured stdout stays
    code = console.report(UserError("--repo", "/x does not exist.", "pass the repository."))
    assert code == 2
    assert capfd.readouterr().err == "error: --repo: /x does not exist. Fix: pass the repository.\n"


@pytest.mark.parametrize("path, reason", [("/dev/zero", "is not a regular file (a device, a FIFO or a folder)."),
                                          ("/tmp", "is not a regular file (a device, a FIFO or a folder).")])
def test_route_explain_refuses_a_device_or_folder_as_prompt_file_before_reading(path, reason):
    """F7: `--prompt-file /dev/zero` was read whole (MemoryError traceback after 128 s, or the OOM killer)."""
    from precision_pipeline.cli.routing import explain

    with pytest.raises(UserError) as e:
        explain("explain", "fp8-h100-routed", prompt_file=path)
    assert (e.value.problems[0].field, e.value.problems[0].reason) == ("--prompt-file", f"{path} {reason}")


def test_route_explain_refuses_a_prompt_file_over_the_bound(tmp_path, monkeypatch):
    from precision_pipeline.cli import routing

    monkeypatch.setattr(routing, "PROMPT_FILE_MAX_BYTES", 1000)
    big = tmp_path / "big.txt"
    big.write_text("x" * 1001)
    with pytest.raises(UserError, match="is over 0 MiB, longer than any prompt"):
        routing.explain("explain", "fp8-h100-routed", prompt_file=str(big))
    big.write_text("x" * 1000)
    assert routing._read_prompt_file(str(big)) == "x" * 1000


def test_url_with_the_http_scheme_is_the_endpoint():
    """F8: `--url http://127.0.0.1:8000` was reported as "no Triton server answers at http://http://..." even with a
    server there."""
    from precision_pipeline.serving.triton_server import TritonServer, free_port

    port = free_port()
    for url in (f"http://127.0.0.1:{port}", f"HTTP://127.0.0.1:{port}/"):
        with pytest.raises(UserError) as e:
            TritonServer.attach(url)
        assert e.value.problems[0].reason == f"no Triton server answers at http://127.0.0.1:{port}.", url
    with pytest.raises(UserError, match="speaks plain http, not https"):
        TritonServer.attach(f"https://127.0.0.1:{port}")
