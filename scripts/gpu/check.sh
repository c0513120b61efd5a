#!/usr/bin/env bash
# aiocollect's GPU check: the CUDA code path (server inference with a CUDA policy_device on its own
# stream, pinned staging, non-blocking copies, cudagraph_policy, compile_policy, a CUDA
# storing_device) on a machine with an NVIDIA GPU and no package index. From the project root, after
# fetch-wheels.sh made .whl/ (the wheels the machine's image lacks, and this script):
#   bash .whl/check.sh
# Steps, each run even when an earlier one failed:
#   1. install the wheels into a folder of their own (no index, no network), and the fallback ones
#      where the image's own copy is older than a wheel needs
#   2. the GPU, Python, torch, CUDA and package versions, `python -m aiocollect info --cuda`, and a
#      smoke test of what the CUDA path uses (pinned memory, a side stream, a CUDA graph)
#   3. a Pong env as benchmarks/inference.py makes it (ale-py, OpenCV, gymnasium's wrappers)
#   4. tests/test_devices.py alone, one process, in file order (so that "collecting on the CPU never
#      initialises CUDA" runs before the CUDA tests), with a per-test timeout of 180 s; then the CUDA
#      cases of tests/test_in_place_training.py (a policy trained in place on the same GPU while the
#      server infers: plain, 2 groups, compile_policy, cudagraph_policy, a CUDA storing_device) and
#      benchmarks/weight_sync.py --server-only (an update's latency and the server's extra memory)
#   5. benchmarks/inference.py --device cuda, short (one round of 3 s per setup, 8 workers)
#   6. the many-core scale step: benchmarks/throughput.py at SCALE_WORKERS (cores - 1, at most 15)
#      workers x 8 and x 32 CartPole envs, benchmarks/startup.py at 1, 4 and SCALE_WORKERS workers, and
#      benchmarks/step_cost.py (a worker's step against the limit's loop, on one core)
#   7. every other test file, on CHECK_JOBS processes (tests of optional extras the image lacks,
#      such as Ray, EnvPool, TorchRL or the docs site, skip and say which package they need)
# Logs go to $OUT when it is set, else to ${TMPDIR:-/tmp}/aiocollect-gpu-check: check.log (all),
# summary.txt (what to keep), env.txt, pytest-devices.log, inference.log, inference.json,
# scale-8.log, scale-32.log, startup.log, step-cost.log, pytest-suite.log. Exit status 0 when every step passed on a CUDA device, else 1; without a CUDA
# device it says "no CUDA device", runs what it can and exits 1 at the end.
# Settings (environment): PYTHON (python3), CHECK_JOBS (15), CHECK_BUDGET_S (540: steps are cut to
# end by then), BENCH_ARGS (the benchmark's options, default below), SKIP_BENCH=1, SCALE_WORKERS,
# SKIP_SCALE=1.
set -uo pipefail

PY=${PYTHON:-python3}
WHEELS=.whl
SITE=${CHECK_SITE:-${TMPDIR:-/tmp}/aiocollect-gpu-site}
LOG=${OUT:-${TMPDIR:-/tmp}/aiocollect-gpu-check}
JOBS=${CHECK_JOBS:-15}
BUDGET=${CHECK_BUDGET_S:-540}
BENCH_ARGS=${BENCH_ARGS:---rounds 1 --seconds 3 --warmup 1 --workers 8 --gpu-envs 64,256 --pass-parts}
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1

if [ ! -f pyproject.toml ] || ! grep -q '^name = "aiocollect"' pyproject.toml; then
  echo "check.sh: run it from aiocollect's project root: bash .whl/check.sh" >&2
  exit 2
fi
mkdir -p "$LOG" || exit 2

results=()   # one line per step, for the summary: PASS, FAIL, SKIP or NONE (no CUDA device)
cuda=0       # CUDA devices torch sees

record() {  # record STATUS NAME DETAIL
  results+=("$(printf '%-5s %s%s' "$1" "$2" "${3:+ ($3)}")")
}

failures() {  # how many steps failed
  local n=0 line
  for line in "${results[@]}"; do [ "${line%% *}" = FAIL ] && n=$((n + 1)); done
  echo "$n"
}

step() {  # step NAME LOGFILE LIMIT_S CMD...: runs CMD under a time limit (cut to the budget left),
          # shows its output and keeps it in $LOG/LOGFILE (none if ""), records PASS or FAIL
  local name=$1 file=$2 limit=$3 t0=$SECONDS rc left
  shift 3
  STEP_RC=""
  left=$((BUDGET - SECONDS - 15))
  [ "$left" -lt "$limit" ] && limit=$left
  echo
  echo "=== $name"
  if [ "$limit" -lt 20 ]; then
    echo "not run: the check's budget of $BUDGET s is spent (CHECK_BUDGET_S)"
    record SKIP "$name" "no time left"
    return 1
  fi
  if [ -n "$file" ]; then
    timeout -k 15 "$limit" "$@" 2>&1 | tee "$LOG/$file"
    rc=${PIPESTATUS[0]}
  else
    timeout -k 15 "$limit" "$@" 2>&1
    rc=$?
  fi
  STEP_RC=$rc
  if [ "$rc" -eq 0 ]; then
    record PASS "$name" "$((SECONDS - t0)) s"
  elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    record FAIL "$name" "timed out after $limit s"
  else
    record FAIL "$name" "exit $rc, $((SECONDS - t0)) s"
  fi
  return "$rc"
}

pytest_tail() {  # the counts line pytest ends with, from a log
  grep -E '(passed|failed|error|skipped|no tests ran).* in [0-9.]+s' "$1" 2>/dev/null | tail -n 1 | sed -E 's/^=+ //; s/ =+$//'
}

install_wheels() {
  local t0=$SECONDS wheels unmet name f n round extra="" todo
  echo "=== install the wheels of $WHEELS/ into $SITE"
  shopt -s nullglob
  wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "no wheels in $WHEELS/: run fetch-wheels.sh in the project root where PyPI is reached, then copy .whl/ with the tree"
    record FAIL "install wheels" "no $WHEELS/*.whl"
    return 1
  fi
  rm -rf "$SITE"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"; then
    record FAIL "install wheels" "pip failed"
    return 1
  fi
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  printf '  %s\n' "${wheels[@]##*/}"
  # what the installed wheels need and the image lacks or has too old: the fallback wheels fill in
  for round in 1 2 3 4; do
    unmet=$("$PY" - "$SITE" <<'EOF'
import sys
from importlib import metadata

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # needed for the check itself: fallback/ has it
    print("  packaging is missing: the requirements cannot be checked without it", file=sys.stderr)
    print("packaging")
    sys.exit(0)
names = set()
for dist in metadata.distributions(path=[sys.argv[1]]):
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            print(f"  {dist.metadata['Name']} needs {req}: {'missing' if have is None else have}", file=sys.stderr)
            names.add(canonicalize_name(req.name))
print(" ".join(sorted(names)))
EOF
    )
    if [ -z "$unmet" ] || [ "$round" -eq 4 ]; then
      break
    fi
    todo=()
    for f in "$WHEELS"/fallback/*.whl; do
      name=${f##*/}
      name=${name%%-*}
      name=$(echo "${name//_/-}" | tr '[:upper:]' '[:lower:]')
      for n in $unmet; do [ "$n" = "$name" ] && todo+=("$f"); done
    done
    [ ${#todo[@]} -eq 0 ] && break
    echo "  the image's own copy falls short: installing ${todo[*]##*/}"
    extra="$extra ${todo[*]##*/}"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${todo[@]}" || break
  done
  if [ -n "$unmet" ]; then  # the tests still run: they show whether it matters
    echo "  still unmet (no wheel for it in $WHEELS/fallback/): $unmet"
    record FAIL "install wheels" "unmet: $unmet"
    return 0
  fi
  echo "  every requirement of the installed wheels is met"
  record PASS "install wheels" "${#wheels[@]} wheels${extra:+, and from fallback/:$extra}, $((SECONDS - t0)) s"
}

environment() {
  echo "=== GPU, Python, torch, CUDA, packages"
  if command -v nvidia-smi >/dev/null; then
    timeout 30 nvidia-smi -L
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,utilization.gpu --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  timeout -k 10 120 "$PY" - <<'EOF'
import importlib.metadata as md
import importlib.util
import platform
import sys

import torch

print(f"python {platform.python_version()} ({sys.executable}); {platform.platform()}")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), "
      f"{torch.get_num_threads()} threads")
for name, module in (("tensordict", "tensordict"), ("gymnasium", "gymnasium"), ("ale-py", "ale_py"),
                     ("opencv-python-headless", "cv2"), ("numpy", "numpy"), ("anyio", "anyio"), ("trio", "trio"),
                     ("uvloop", "uvloop"), ("cloudpickle", "cloudpickle"), ("pytest", "pytest"),
                     ("pytest-asyncio", "pytest_asyncio"), ("pytest-xdist", "xdist"), ("pytest-timeout", "pytest_timeout"),
                     ("hypothesis", "hypothesis"), ("typing-extensions", "typing_extensions"), ("psutil", "psutil")):
    try:
        version = md.version(name)
    except md.PackageNotFoundError:
        version = "-"
    spec = importlib.util.find_spec(module)
    print(f"  {name:<24} {version:<12} {spec.origin if spec else 'NOT IMPORTABLE'}")
if not torch.cuda.is_available():
    print("CUDA: no CUDA device (torch.cuda.is_available() is False)")
    sys.exit(3)
n = torch.cuda.device_count()
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    print(f"CUDA device {i}: {p.name}, capability {p.major}.{p.minor}, {p.total_memory / 2**30:.1f} GiB, "
          f"{p.multi_processor_count} SMs")
# what the server's CUDA path uses: pinned staging, a copy on a side stream, a captured graph
x = torch.arange(4096, dtype=torch.float32).pin_memory()
stream = torch.cuda.Stream()
with torch.cuda.stream(stream):
    y = x.to("cuda", non_blocking=True) * 2
stream.synchronize()
assert torch.equal(y.cpu(), x * 2)
net = torch.nn.Linear(4, 2).cuda()
static = torch.zeros(8, 4, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(3):
        net(static)
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = net(static)
static.copy_(torch.ones(8, 4))
graph.replay()
torch.cuda.synchronize()
assert torch.allclose(out, net(torch.ones(8, 4, device="cuda")))
print("CUDA smoke: pinned memory, a non-blocking copy on a side stream and a CUDA graph's replay work")
EOF
}

summary() {
  local line counts
  echo
  echo "==== summary: aiocollect GPU check ($(date -u '+%Y-%m-%d %H:%M UTC'), $SECONDS s)"
  [ -f "$LOG/env.txt" ] && grep -E '^(python [0-9]|torch [0-9]|CUDA device 0|CUDA: no CUDA device)|^  (tensordict|gymnasium|ale-py|pytest |numpy) ' "$LOG/env.txt"
  printf '%s\n' "${results[@]}"
  for f in pytest-devices.log pytest-in-place.log pytest-suite.log; do
    [ -f "$LOG/$f" ] || continue
    counts=$(pytest_tail "$LOG/$f")
    # (cut by its time limit: no counts line, the last progress mark says how far it went)
    [ -z "$counts" ] && counts="cut before its end, at $(grep -oE '\[ *[0-9]+%\]' "$LOG/$f" | tail -n 1 | tr -d '[] ') of the tests, $(grep -cE '^(FAILED|ERROR) ' "$LOG/$f") failed so far"
    echo "$f: $counts"
    grep -E '^(FAILED|ERROR) ' "$LOG/$f" | head -n 20
    grep -E '^SKIPPED ' "$LOG/$f" | head -n 10
  done
  if [ -f "$LOG/weight-sync.log" ]; then
    line=$(grep -n -m 1 "^inference='server': update_weights" "$LOG/weight-sync.log" | cut -d: -f1)
    [ -n "$line" ] && { echo "benchmarks/weight_sync.py --server-only:"; tail -n "+$line" "$LOG/weight-sync.log" | head -n 8; }
  fi
  if [ -f "$LOG/inference-busy.log" ]; then
    line=$(grep -n -m 1 '^the busy GPU trainer alone' "$LOG/inference-busy.log" | cut -d: -f1)
    [ -n "$line" ] && { echo "beside a GPU trainer:"; sed -n "${line}p" "$LOG/inference-busy.log";
                        sed -n '/^Pong (84x84/,$p' "$LOG/inference-busy.log"; }
  fi
  if [ -f "$LOG/inference.log" ]; then
    line=$(grep -n -m 1 '^Pong (84x84' "$LOG/inference.log" | cut -d: -f1)
    [ -n "$line" ] && { echo "benchmarks/inference.py --device cuda $BENCH_ARGS:"
                        tail -n "+$line" "$LOG/inference.log" | grep -vE 'A\.L\.E|Powered by Stella| \.\.\.$|^$'; }
  fi
  for f in scale-8.log scale-32.log; do  # the table and the limit's drift line of each
    [ -f "$LOG/$f" ] || continue
    echo "benchmarks/throughput.py, $(grep -m 1 -o '[0-9]* workers x [0-9]* envs' "$LOG/$f"):"
    sed -n '/^setup  /,/^limit at the start/p' "$LOG/$f"
  done
  if [ -f "$LOG/startup.log" ]; then
    echo "benchmarks/startup.py:"
    grep -E '^(machine|import torch|from aiocollect|launch|first batch|second collector)' "$LOG/startup.log" | head -n 24
  fi
  if [ -f "$LOG/step-cost.log" ]; then
    echo "benchmarks/step_cost.py:"
    sed -n '/^setup  /,/^ratio:/p' "$LOG/step-cost.log"
  fi
  local failed
  failed=$(failures)
  if [ "$cuda" -eq 0 ]; then
    echo "RESULT: no CUDA device: the CUDA tests were skipped and the GPU benchmark not run (exit 1);" \
      "$([ "$failed" -eq 0 ] && echo "no step failed" || echo "$failed step(s) FAILED")"
  elif [ "$failed" -ne 0 ]; then
    echo "RESULT: FAILED, $failed step(s) (see the FAIL lines; logs in $LOG)"
  else
    echo "RESULT: all steps passed on $cuda CUDA device(s)"
  fi
}

main() {
  echo "aiocollect GPU check in $PWD, logs in $LOG"
  installed=0
  install_wheels && installed=1

  echo
  environment 2>&1 | tee "$LOG/env.txt"
  case ${PIPESTATUS[0]} in
    0) cuda=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
       record PASS "GPU and versions" "$(grep -m 1 '^CUDA device 0' "$LOG/env.txt" | cut -d: -f2 | cut -d, -f1 | sed 's/^ //')" ;;
    3) echo "no CUDA device"; record NONE "GPU and versions" "no CUDA device" ;;
    *) record FAIL "GPU and versions" "the CUDA smoke test or an import failed: see env.txt" ;;
  esac
  echo
  echo "=== python -m aiocollect info --cuda"
  timeout -k 10 60 "$PY" -m aiocollect info --cuda 2>&1 | tee -a "$LOG/env.txt"

  if [ "$installed" -ne 1 ]; then
    record SKIP "the tests and the benchmark" "the wheels are not installed"
    return
  fi

  step "Pong env (ale-py, OpenCV, gymnasium's Atari wrappers)" "" 60 "$PY" -c '
import sys
sys.path.insert(0, "benchmarks")
import inference
env = inference.make_pong()
obs, _ = env.reset(seed=0)
for _ in range(50):
    obs, *_ = env.step(env.action_space.sample())
print("ALE/Pong-v5, AtariPreprocessing, 4 stacked frames:", obs.shape, obs.dtype)
env.close()'

  step "pytest tests/test_devices.py" pytest-devices.log 240 \
    "$PY" -m pytest -p no:cacheprovider -v --timeout 180 --durations 10 tests/test_devices.py

  # a policy trained in place on the same GPU (optimizer steps on the default stream) while the server
  # infers on its own stream: every frame acts with the weights its version names, in every CUDA mode
  step "pytest tests/test_in_place_training.py (CUDA server: plain, groups, compile, cudagraph, storing)" \
    pytest-in-place.log 240 \
    "$PY" -m pytest -p no:cacheprovider -v --timeout 200 tests/test_in_place_training.py -k cuda

  if [ "${SKIP_BENCH:-0}" != 1 ] && [ "$cuda" -gt 0 ]; then
    step "benchmarks/weight_sync.py --server-only (an update's latency, the server's extra memory)" \
      weight-sync.log 120 "$PY" benchmarks/weight_sync.py --server-only --n 10 --n-big 5
  fi

  if [ "${SKIP_BENCH:-0}" = 1 ]; then
    record SKIP "benchmarks/inference.py --device cuda" "SKIP_BENCH=1"
  elif [ "$cuda" -eq 0 ]; then
    # run all the same: it checks the options, then says that CUDA is not available (exit 2)
    # shellcheck disable=SC2086
    step "benchmarks/inference.py --device cuda" inference.log 60 "$PY" benchmarks/inference.py --device cuda $BENCH_ARGS
    [ "$STEP_RC" = 2 ] && { unset 'results[-1]'; record SKIP "benchmarks/inference.py --device cuda" "no CUDA device; its options were accepted"; }
  else
    # shellcheck disable=SC2086
    step "benchmarks/inference.py --device cuda" inference.log 200 \
      "$PY" benchmarks/inference.py --device cuda $BENCH_ARGS --json "$LOG/inference.json"
    # the learner trains on the same GPU (its default stream) while the server infers on its own
    step "benchmarks/inference.py --device cuda --busy-trainer (64 envs)" inference-busy.log 90 \
      "$PY" benchmarks/inference.py --device cuda --busy-trainer --rounds 1 --seconds 3 --warmup 1 --workers 8 \
      --gpu-envs 64
  fi

  # the machine users train on: many cores (the per-core ratio and the start-up carry over from here)
  if [ "${SKIP_SCALE:-0}" != 1 ]; then
    scale=${SCALE_WORKERS:-$(( $(nproc) - 1 ))}
    [ "$scale" -gt 15 ] && scale=15
    [ "$scale" -lt 1 ] && scale=1
    step "benchmarks/throughput.py, $scale workers x 8 envs" scale-8.log 90 \
      "$PY" benchmarks/throughput.py --skip-baselines --seconds 3 --workers "$scale" --envs-per-worker 8 \
      --frames-per-batch $((scale * 8 * 16))
    step "benchmarks/throughput.py, $scale workers x 32 envs" scale-32.log 90 \
      "$PY" benchmarks/throughput.py --skip-baselines --seconds 3 --workers "$scale" --envs-per-worker 32 \
      --frames-per-batch $((scale * 32 * 16))
    step "benchmarks/startup.py, 1, 4 and $scale workers" startup.log 120 \
      "$PY" benchmarks/startup.py --repeat 2 --workers "1,4,$scale"
    step "benchmarks/step_cost.py (a worker's step against the limit's loop, one core)" step-cost.log 90 \
      "$PY" benchmarks/step_cost.py --turns 8
  fi

  # Last, with the time left: every other test file. The CUDA ones among them (server inference,
  # weights, devices in the collector's tests) use the GPU where it is.
  step "pytest the whole suite but test_devices.py (-n $JOBS)" pytest-suite.log 420 \
    "$PY" -m pytest -p no:cacheprovider -q -n "$JOBS" --maxfail 50 --durations 15 --ignore tests/test_devices.py tests
}

{
  main
  summary | tee "$LOG/summary.txt"
  [ "$cuda" -gt 0 ] && [ "$(failures)" -eq 0 ]
} 2>&1 | tee "$LOG/check.log"
exit "${PIPESTATUS[0]}"
