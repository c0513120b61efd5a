#!/usr/bin/env bash
# The Ray backend's tests (tests/test_ray.py) in .venv-ray: a venv layered on .venv (it sees
# .venv's packages, aiocollect's editable install among them) that adds Ray and whatever of Ray's
# dependencies .venv lacks. .venv itself is left as the README's install makes it, so that the main
# suite can run at the same time (scripts/run.sh test runs this beside it).
#   bash scripts/ray-tests.sh [pytest args]   set up if needed, then run tests/test_ray.py
#   bash scripts/ray-tests.sh setup           set up only (scripts/run.sh test does it beside the main suite)
# Needs .venv set up first (scripts/run.sh does that). Ray's wheel is taken from .venv/ray-wheels
# where scripts/run.sh downloaded it, else from the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=.venv
VENV=.venv-ray
. scripts/layered-venv.sh
layered_venv ray "$BASE" "$VENV"
stamp="$VENV/.aiocollect-installed"
if [ ! -f "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ] || [ "$BASE/.aiocollect-installed" -nt "$stamp" ]; then
  echo "[ray] installing Ray into $VENV (the pin of scripts/constraints.txt)"
  "$VENV/bin/python" -m pip install -q -c scripts/constraints.txt --find-links "$BASE/ray-wheels" ray 2>&1 \
    | { grep -v "^WARNING: Location 'file://" || true; }
  touch "$stamp"
fi
"$VENV/bin/python" -c 'import aiocollect, ray, torch; print(f"[ray] Ray {ray.__version__}, torch {torch.__version__}, aiocollect from {aiocollect.__file__}")'
if [ "${1:-}" = setup ]; then
  exit 0
fi
exec "$VENV/bin/python" -m pytest tests/test_ray.py -p no:cacheprovider "$@"
