#!/usr/bin/env bash
# The lowest supported versions, tested: creates (or updates) .venv-lowest with Python 3.12,
# pins every `>=X` lower bound of pyproject.toml's dependencies and of its `test` extra to `==X`
# (torch included: it is installed first, at its lower bound, so pip never resolves a torch by
# itself), installs aiocollect with the `test` extra against those pins, prints the installed
# versions, then runs the main suite as `bash scripts/run.sh test` does (two test processes, the
# Ray backend's tests aside). The pins are derived from pyproject.toml on every run, so this
# always tests what pyproject.toml states.
#   bash scripts/lowest-versions.sh                 set up if needed, then the main suite
#   bash scripts/lowest-versions.sh [pytest args]   with these pytest arguments added (a module, -k ...)
#   PYTHON=/path/to/python3.12 bash scripts/lowest-versions.sh   another interpreter for the venv
# About 20-30 minutes on 2 cores: the set-up (a few minutes once pip's cache has torch) and the
# suite (about 19 minutes on a loaded 2-core machine). Not part of CI (.ci/run): torch 2.11 comes
# from PyPI as a CUDA build, about 4.6 GB with its nvidia libraries.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.12}
VENV=.venv-lowest

if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null; then
    echo "[setup] the lowest versions are tested on Python 3.12; PYTHON=$PY is $("$PY" --version 2>/dev/null || echo 'not found')." \
      "Point PYTHON at a Python 3.12: PYTHON=/path/to/python3.12 bash $0" >&2
    exit 1
  fi
  echo "[setup] creating $VENV with $("$PY" --version)"
  "$PY" -m venv "$VENV"
fi
constraints="$VENV/constraints.txt"
# every `>=X` of [project].dependencies and of the `test` extra as `==X` (markers kept)
"$VENV/bin/python" - >"$constraints" <<'EOF'
import tomllib

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
for line in project["dependencies"] + project["optional-dependencies"]["test"]:
    req = Requirement(line)
    lowest = [spec.version for spec in req.specifier if spec.operator == ">="]
    if not lowest:
        raise SystemExit(f"pyproject.toml: {line!r} has no '>=' lower bound to test; give it one")
    marker = f"; {req.marker}" if req.marker else ""
    print(f"{req.name}=={lowest[0]}{marker}")
EOF
stamp="$VENV/.aiocollect-installed"
if [ ! -f "$stamp" ] || ! cmp -s "$constraints" "$stamp" || [ pyproject.toml -nt "$stamp" ]; then
  torch_pin=$(grep '^torch==' "$constraints")
  echo "[setup] installing $torch_pin first"
  "$VENV/bin/python" -m pip install -q -c "$constraints" "$torch_pin"
  echo "[setup] installing aiocollect with the test extra (.[test]) at the lowest versions"
  "$VENV/bin/python" -m pip install -q -c "$constraints" -e ".[test]"
  cp "$constraints" "$stamp"
fi
echo "[versions] $("$VENV/bin/python" --version)"
"$VENV/bin/python" - "$constraints" <<'EOF'
import sys
from importlib.metadata import version

for line in open(sys.argv[1]):
    name = line.split("==")[0]
    try:
        print(f"[versions] {name:<16} {version(name)}")
    except Exception:  # a dependency whose marker excludes this platform
        print(f"[versions] {name:<16} (not installed)")
EOF

exec "$VENV/bin/python" -m pytest -n "${AIOCOLLECT_TEST_JOBS:-2}" --ignore=tests/test_ray.py "$@"
