"""run.sh's set-up: which machine it is on (NVIDIA's TensorRT-LLM container or not) and what it installs.

Simulated, nothing installed: run.sh runs in a copy of the repository's set-up files with a fake
``python3`` (``PYTHON``) that logs every call. Its stdin scripts (the detection and the "what does
the container lack" step) run for real, on the real interpreter with ``-S`` and only a fake
site-packages on ``PYTHONPATH`` (a ``tensorrt_llm`` package, a ``torch/version.py`` as torch writes
it, ``*.dist-info`` metadata), so the container is the only thing made up.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK = "accelerate==1.15.0\ninvoke==2.2.1\ntorch==2.13.0\ntransformers==4.57.6\n"

FAKE_PY = r"""#!/usr/bin/env bash
echo "python $*" >> "$FAKE_LOG"
if [[ "${1:-}" == -m && "${2:-}" == venv ]]; then
  d="${@: -1}"; mkdir -p "$d/bin"; ln -sf "$FAKE_SELF" "$d/bin/python"
  printf '#!/usr/bin/env bash\necho "invoke $*" >> "$FAKE_LOG"\n' > "$d/bin/invoke"; chmod +x "$d/bin/invoke"; exit 0
fi
if [[ "${1:-}" == -m && "${2:-}" == pip ]]; then
  prev=""; for a in "$@"; do if [[ "$prev" == -r ]]; then sed "s/^/  req: /" "$a" >> "$FAKE_LOG"; fi; prev="$a"; done; exit 0
fi
if [[ "${1:-}" == -c ]]; then exit 0; fi
if [[ "${1:-}" == - ]]; then exec "$REAL_PY" -S "$@"; fi
echo "unexpected call: $*" >&2; exit 99
"""


def _dist(site: Path, name: str, version: str) -> None:
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def _machine(tmp: Path, trt: bool, torch_cuda: str | None, dists: dict[str, str]) -> Path:
    site = tmp / "site"
    site.mkdir()
    if trt:
        (site / "tensorrt_llm").mkdir()
        (site / "tensorrt_llm" / "__init__.py").write_text("raise ImportError('detection must not import me')\n")
    if torch_cuda is not None or "torch" in dists:
        (site / "torch").mkdir()
        (site / "torch" / "__init__.py").write_text("raise ImportError('detection must not import torch')\n")
        cuda = repr(torch_cuda) if torch_cuda else "None"
        (site / "torch" / "version.py").write_text(
            "from typing import Optional\n\n__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip']\n"
            f"__version__ = '{dists.get('torch', '2.9.0')}'\ndebug = False\ncuda: Optional[str] = {cuda}\n"
            "git_version = 'abc'\nhip: Optional[str] = None\n")
    for n, v in dists.items():
        _dist(site, n, v)
    return site


def _run(tmp: Path, site: Path, args=("build", "--profile", "fp8-h100"), **env_extra):
    repo = tmp / "repo"
    if not repo.exists():
        repo.mkdir()
        shutil.copy(ROOT / "run.sh", repo / "run.sh")
        (repo / "requirements.lock").write_text(LOCK)
        shutil.copy(ROOT / "requirements-nodeps.txt", repo / "requirements-nodeps.txt")
    fake = tmp / "bin" / "python3"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    log = tmp / "calls.log"
    log.write_text("")
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp), "PYTHON": str(fake), "FAKE_SELF": str(fake),
           "FAKE_LOG": str(log), "REAL_PY": sys.executable, "PYTHONPATH": str(site), **env_extra}
    r = subprocess.run(["bash", str(repo / "run.sh"), *args], env=env, capture_output=True, text=True, timeout=60)
    return r, log.read_text(), repo


def test_inside_the_tensorrt_llm_container_only_what_it_lacks_is_installed(tmp_path):
    site = _machine(tmp_path, trt=True, torch_cuda="12.9", dists={"torch": "2.9.0a0", "transformers": "4.56.2"})
    r, log, repo = _run(tmp_path, site, NVIDIA_BUILD_ID="12345")
    assert r.returncode == 0, r.stderr
    assert ("[setup] NVIDIA TensorRT-LLM container detected (tensorrt_llm importable, torch built with CUDA 12.9, "
            "container variables NVIDIA_BUILD_ID)") in r.stderr
    assert f"python -m venv --system-site-packages --without-pip {repo / '.venv-container'}" in log
    assert not (repo / ".venv").exists()  # the CPU venv of a mounted checkout is left alone
    # exactly the pins the container lacks, never torch, never a newer transformers, and without dependencies
    assert "req: accelerate==1.15.0\n  req: invoke==2.2.1\n" in log
    assert "torch==" not in log and "transformers==" not in log
    pip_lines = [ln for ln in log.splitlines() if " -m pip install" in ln]
    assert pip_lines and all("--no-deps" in ln for ln in pip_lines), pip_lines
    assert "--upgrade pip" not in log
    assert ("[setup] kept the container's 2 packages; its versions differ from the lock for: torch 2.9.0a0 "
            "(lock 2.13.0), transformers 4.56.2 (lock 4.57.6)") in r.stderr
    assert "[setup] installing the 2 it lacks (--no-deps): accelerate==1.15.0, invoke==2.2.1" in r.stderr
    assert log.rstrip().endswith("invoke build --profile fp8-h100")
    # the second run finds it set up and says so, installing nothing
    r2, log2, _ = _run(tmp_path, site)
    assert r2.returncode == 0 and "-m pip" not in log2 and "-m venv" not in log2
    assert "[setup] NVIDIA TensorRT-LLM container detected (tensorrt_llm importable, torch built with CUDA 12.9): " \
           ".venv-container is set up (the container's torch, ModelOpt and tensorrt_llm in use)" in r2.stderr


@pytest.mark.parametrize("trt, cuda, why", [
    (False, None, "no TensorRT-LLM container (no tensorrt_llm, a CPU-only torch)"),
    (True, None, "no TensorRT-LLM container (tensorrt_llm importable, a CPU-only torch)"),
    (False, "12.9", "no TensorRT-LLM container (no tensorrt_llm, torch built with CUDA 12.9)"),
])
def test_elsewhere_the_pinned_cpu_venv_is_set_up(tmp_path, trt, cuda, why):
    site = _machine(tmp_path, trt=trt, torch_cuda=cuda, dists={"torch": "2.13.0"})
    r, log, repo = _run(tmp_path, site)
    assert r.returncode == 0, r.stderr
    assert f"python -m venv {repo / '.venv'}\n" in log
    assert "--system-site-packages" not in log
    assert "python -m pip install --quiet --disable-pip-version-check -r requirements.lock" in log  # with deps, as before
    assert "req: torch==2.13.0" in log
    assert "[setup] creating virtual environment at .venv" in r.stderr and why not in r.stderr  # quiet as before
    # the mode is readable when asked for explicitly
    r2, _, _ = _run(tmp_path, site, PRECISION_SETUP="venv")
    assert r2.returncode == 0


def test_forced_modes(tmp_path):
    site = _machine(tmp_path, trt=False, torch_cuda=None, dists={})
    r, log, _ = _run(tmp_path, site, PRECISION_SETUP="container")
    assert r.returncode == 3
    assert "the container has no torch: this is not NVIDIA's TensorRT-LLM container" in r.stderr
    assert "pip install" not in log and "invoke" not in log
    r, _, _ = _run(tmp_path, site, PRECISION_SETUP="gpu")
    assert r.returncode == 2 and "PRECISION_SETUP='gpu' is not venv or container" in r.stderr
