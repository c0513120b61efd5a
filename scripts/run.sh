#!/usr/bin/env bash
# One entry point for a fresh clone: creates .venv if needed, installs torch first (so pip never
# resolves an open-ended torch requirement by itself), then aiocollect, then runs what was asked.
#   bash scripts/run.sh demo   [args]   collect from CartPole-v1 with worker processes
#   bash scripts/run.sh test   [args]   the test suite (what CI runs); without args, also mypy on the
#                                       package (beside it), then the Ray backend's tests
#                                       (scripts/ray-tests.sh, in .venv-ray, set up beside the suite;
#                                       AIOCOLLECT_SKIP_RAY=1 skips them) and beside them the TorchRL
#                                       0.14 compatibility check (scripts/torchrl-compat.sh;
#                                       AIOCOLLECT_SKIP_TORCHRL=1 skips it)
#   bash scripts/run.sh ray-test [args] tests/test_ray.py (scripts/ray-tests.sh: Ray in .venv-ray)
#   bash scripts/run.sh bench  [args]   benchmarks/throughput.py
#   bash scripts/run.sh pixels [args]   benchmarks/pixels.py (installs the `atari` extra: ale-py, opencv)
#   bash scripts/run.sh envpool-test [args]
#                                       tests/test_envpool.py in .venv-envpool, a venv with EnvPool
#                                       (about 700 MB with its assets: not in the main venv)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
TORCH_VERSION=${AIOCOLLECT_TORCH_VERSION:-2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "[setup] aiocollect needs Python 3.11 or newer; $PY is $("$PY" --version 2>/dev/null || echo 'not found')." \
      "Point PYTHON at one: PYTHON=python3.11 bash $0 ..." >&2
    exit 1
  fi
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.aiocollect-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/constraints.txt -nt "$stamp" ]; then
  echo "[setup] installing torch==$TORCH_VERSION first"
  "$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
  echo "[setup] installing aiocollect with its test, example and video extras (.[dev])"
  "$VENV/bin/python" -m pip install -q -c scripts/constraints.txt -e ".[dev]"
  touch "$stamp"
fi

cmd=${1:-test}
shift || true
case "$cmd" in
  demo)  exec "$VENV/bin/python" examples/demo.py "$@" ;;
  test)
    # the tree's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set (many CI images), an
    # editable install's modules would otherwise be compiled again in every process the tests start
    # (about 0.2 s of CPU each; an installed package's bytecode is written by pip)
    "$VENV/bin/python" -m compileall -q aiocollect tests benchmarks examples scripts
    if [ $# -gt 0 ] || [ "${AIOCOLLECT_SKIP_TORCHRL:-0}" = 1 ]; then
      exec "$VENV/bin/python" -m pytest "$@"
    fi
    # beside the main suite, each into a log: mypy on the package (it ships py.typed), the TorchRL
    # venv's dependencies, and Ray's set-up (its wheel, ~80 MB, downloaded, then installed into
    # .venv-ray, so .venv stays as the README's install makes it). Each in a process group of its
    # own (setsid), stopped with whatever it started if this script stops first. Ray's tests run
    # after the suite: beside it, both took longer (a fresh clone on 2 cores, one run each: the
    # suite 25.6 min with them beside it, 19.5 min after; theirs 9.2 and 4.6 min; in all 29.1 and
    # 27.2 min).
    logs="$VENV/test-logs"
    mkdir -p "$logs"
    trap 'for job in $(jobs -p); do kill -- "-$job" 2>/dev/null || true; done' EXIT
    setsid "$VENV/bin/python" -m mypy > "$logs/mypy.log" 2>&1 &
    mypy_job=$!
    setsid bash scripts/torchrl-compat.sh deps > "$logs/torchrl-deps.log" 2>&1 &
    torchrl_deps=$!
    if [ "${AIOCOLLECT_SKIP_RAY:-0}" != 1 ]; then
      mkdir -p "$VENV/ray-wheels"
      setsid bash -c '"$1" -m pip download -q --no-deps -c scripts/constraints.txt -d "$2" ray && exec bash scripts/ray-tests.sh setup' \
        ray-setup "$VENV/bin/python" "$VENV/ray-wheels" > "$logs/ray.log" 2>&1 &
      ray_job=$!
    fi
    # two test processes (CI has 2 cores; the tests mostly wait on worker processes)
    "$VENV/bin/python" -m pytest -n "${AIOCOLLECT_TEST_JOBS:-2}" --ignore=tests/test_ray.py
    echo "[test] the main suite passed; mypy on the package (run beside it):"
    wait "$mypy_job" || { cat "$logs/mypy.log" >&2; exit 1; }
    cat "$logs/mypy.log"
    # the TorchRL check beside Ray's tests, its output into a log shown when it ends (Ray's tests
    # leave about a quarter of 2 cores idle while actors start)
    wait "$torchrl_deps" || { cat "$logs/torchrl-deps.log" >&2; exit 1; }
    setsid bash scripts/torchrl-compat.sh > "$logs/torchrl.log" 2>&1 &
    torchrl_job=$!
    if [ "${AIOCOLLECT_SKIP_RAY:-0}" != 1 ]; then
      echo "[test] the Ray backend's tests (Ray set up beside the suite; waiting for it if it is not done):"
      wait "$ray_job" || { cat "$logs/ray.log" >&2; exit 1; }
      cat "$logs/ray.log"
      bash scripts/ray-tests.sh -q
    fi
    echo "[test] aiocollect beside TorchRL 0.14.1 (tensordict 0.14), run beside Ray's tests:"
    cat "$logs/torchrl-deps.log"
    wait "$torchrl_job" || { cat "$logs/torchrl.log" >&2; exit 1; }
    trap - EXIT
    cat "$logs/torchrl.log" ;;
  ray-test) exec bash scripts/ray-tests.sh "$@" ;;
  bench) exec "$VENV/bin/python" benchmarks/throughput.py "$@" ;;
  pixels)
    "$VENV/bin/python" -m pip install -q -c scripts/constraints.txt -e ".[atari]"
    exec "$VENV/bin/python" benchmarks/pixels.py "$@" ;;
  envpool-test)
    EV=.venv-envpool
    [ -x "$EV/bin/python" ] || { echo "[setup] creating $EV"; "$PY" -m venv "$EV"; }
    "$EV/bin/python" -m pip install -q "torch==$TORCH_VERSION"
    "$EV/bin/python" -m pip install -q -c scripts/constraints.txt -e ".[test]" envpool
    exec "$EV/bin/python" -m pytest tests/test_envpool.py "$@" ;;
  *) echo "usage: bash scripts/run.sh {demo|test|bench|pixels|envpool-test|ray-test} [args]" >&2; exit 2 ;;
esac
