#!/usr/bin/env bash
# Compatibility check: aiocollect installed beside TorchRL 0.14.1, which wants tensordict<0.15
# (the main .venv has tensordict 0.15). Creates or updates .venv-torchrl, a venv layered on .venv
# (scripts/layered-venv.sh: it sees .venv's packages, torch among them, so torch is not installed
# a second time; its own packages come first), then runs the TorchRL interop tests and the
# tensordict-heavy test modules on tensordict 0.14. pip resolves TorchRL's requirements with
# aiocollect's and installs into .venv-torchrl what .venv does not satisfy (tensordict 0.14,
# TorchRL), leaving .venv as it is. aiocollect goes in as a user gets it: the wheel built from
# this tree (not an editable install), and the tests import that installed copy (python -P: the
# source tree is not on sys.path; the wheel comes before .venv's editable install).
# Needs .venv set up first (scripts/run.sh does that).
#   bash scripts/torchrl-compat.sh            set up if needed, then run the tests
#   bash scripts/torchrl-compat.sh setup      set up only
#   bash scripts/torchrl-compat.sh deps       the venv and its dependencies only (builds nothing in
#                                             the source tree: scripts/run.sh test runs it beside the
#                                             main suite)
#   bash scripts/torchrl-compat.sh bench [args]   benchmarks/throughput.py here, TorchRL's collector included
#   bash scripts/torchrl-compat.sh [pytest args]   run these instead of the default modules
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=.venv
VENV=.venv-torchrl
TORCHRL_VERSION=0.14.1
TENSORDICT_RANGE=">=0.14,<0.15"

. scripts/layered-venv.sh
layered_venv setup "$BASE" "$VENV"
stamp="$VENV/.aiocollect-installed"
constraints="$VENV/constraints.txt"
quiet_pip() {
  # pip -q, less the machine's "Location ... is ignored" notes about its local indexes
  "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }
}
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/torchrl-compat.sh -nt "$stamp" ] \
  || [ "$BASE/.aiocollect-installed" -nt "$stamp" ]; then
  start=$SECONDS
  # the same pins for every install step: the torch pin (.venv's) keeps pip from fetching a CUDA build
  torch_version=$("$BASE/bin/python" -c 'import importlib.metadata as m; print(m.version("torch"))')
  printf 'torch==%s\ntensordict%s\ntorchrl==%s\n' "$torch_version" "$TENSORDICT_RANGE" "$TORCHRL_VERSION" >"$constraints"
  echo "[setup] installing torchrl==$TORCHRL_VERSION, tensordict$TENSORDICT_RANGE and aiocollect's dependencies and test extras"
  # aiocollect's own requirements and its test extra, read from pyproject.toml (not ".[test]", which
  # would build the package in the source tree: the wheel below is built once the main suite is done)
  mapfile -t requirements < <("$VENV/bin/python" -c '
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["test"]))')
  quiet_pip install -q -c "$constraints" "torchrl==$TORCHRL_VERSION" "tensordict$TENSORDICT_RANGE" "${requirements[@]}"
  touch "$stamp"
  echo "[setup] done in $((SECONDS - start)) s:" \
    "$("$VENV/bin/python" -m pip freeze | grep -iE '^(torch|tensordict|torchrl)==' | tr '\n' ' ')"
fi
if [ "${1:-}" = deps ]; then
  exit 0
fi
# this tree's code as a wheel, installed over whatever copy is there (every run: the code changes)
wheels="$VENV/wheel"
rm -rf "$wheels"
quiet_pip wheel -q --no-deps --no-build-isolation -w "$wheels" .
quiet_pip install -q --no-deps --force-reinstall "$wheels"/aiocollect-*.whl
quiet_pip check
echo "[setup] aiocollect installed from $(cd "$wheels" && ls aiocollect-*.whl):" \
  "$(cd /tmp && "$OLDPWD/$VENV/bin/python" -c 'import aiocollect; print(aiocollect.__file__)')"

if [ "${1:-}" = setup ]; then
  exit 0
fi
if [ "${1:-}" = bench ]; then
  shift
  exec "$VENV/bin/python" benchmarks/throughput.py "$@"
fi
if [ $# -eq 0 ]; then
  # the TorchRL interop tests (and the migration page checked against TorchRL's signatures), then aiocollect's own tensordict-heavy modules on tensordict 0.14
  # (and the PPO example's TorchRL variant: its loss and GAE against TorchRL's, and a short run)
  set -- tests/test_torchrl.py tests/test_torchrl_migration.py tests/test_torchrl_names.py tests/test_torchrl_recurrent.py tests/test_torchrl_porting.py tests/test_collector.py tests/test_replay.py tests/test_split.py \
    tests/test_trajs.py tests/test_ppo_example.py::test_torchrl_short_run_learns \
    tests/test_ppo_example.py::test_hand_written_gae_and_loss_match_torchrl_on_a_real_batch \
    -q -x -p no:cacheprovider -n "${AIOCOLLECT_TEST_JOBS:-2}"
fi
echo "[test] $VENV/bin/python -P -m pytest $*"
exec "$VENV/bin/python" -P -m pytest "$@"
