"""The benchmark scripts start (``--help``: every import resolves), most run to their end on a
tiny scale (a sliced comparison: the limit's processes and the collector's take turns, SIGSTOP and
SIGCONT), the report is printed, and no process is left. No figure is checked: timings are for
the scripts' own output, never for a test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(name for name in os.listdir(os.path.join(ROOT, "benchmarks"))
                 if name.endswith(".py") and not name.startswith("_"))


def run_script(name: str, *args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", name), *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
    assert proc.returncode == 0, f"{name} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


# the scripts a test below runs to its end, read from this file's calls (a run starts them too: no
# `--help` run of their own)
with open(__file__) as _this_file:
    RUN_BELOW = set(re.findall(r'run_script\("(\w+\.py)", "(?!--help")', _this_file.read()))


def test_the_scripts_run_below_are_benchmark_scripts():
    assert RUN_BELOW <= set(SCRIPTS), RUN_BELOW - set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(set(SCRIPTS) - RUN_BELOW))
@pytest.mark.timeout(240)
def test_benchmark_script_starts(name):
    # (a script imports torch, some Ray, before it parses its arguments: on a loaded machine that
    # alone has taken over a minute)
    assert "usage:" in run_script(name, "--help", timeout=220)


@pytest.mark.timeout(180)
def test_sliced_vector_comparison_runs_to_its_report_and_leaves_nothing():
    out = run_script("vector_envs.py", "--sliced", "--turns", "2", "--turn-seconds", "0.3", "--warmup", "0.2",
                     "--num-envs", "8", "--steps", "8")
    lines = out.splitlines()
    # the report's rows end with the batches copied ("0 of 315"); the progress lines do not
    rows = [line for line in lines if line.startswith("aiocollect vector sync") and re.search(r"\d+ of \d+$", line)]
    assert len(rows) == 2, out  # with and without zero_copy, each with both rates and a ratio
    assert any("turn ratios min / median / max" in line for line in lines), out
    assert "still running" not in out, out  # (the benchmark's reaper names any process left over)


@pytest.mark.timeout(120)
def test_server_load_benchmark_runs_both_modes_to_its_table(tmp_path):
    """benchmarks/server_load.py in a short mode: both servers started, loaded, stopped; the
    table's two rows, and the JSON with latency and loop-lag percentiles for each."""
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    out = run_script("server_load.py", "--requests", "100", "--warmup-requests", "20", "--concurrency", "10",
                     "--workers", "1", "--envs-per-worker", "2", "--frames-per-batch", "64", "--settle", "0.5",
                     "--json", str(tmp_path / "load.json"))
    assert re.search(r"^idle\s+[\d,]+\s", out, re.M) and re.search(r"^collecting\s+[\d,]+\s.*[\d,]+$", out, re.M), out
    with open(tmp_path / "load.json") as f:
        results = json.load(f)["results"]
    for mode in ("idle", "collecting"):
        assert results[mode]["latency_ms"]["p99"] >= results[mode]["latency_ms"]["p50"] > 0
        assert results[mode]["loop_lag_ms"]["p99"] is not None and results[mode]["runs"][0]["requests"] == 100
    assert results["collecting"]["collector_fps"] > 0 and results["idle"]["collector_fps"] is None


def warnings_in(out: str) -> list[str]:
    """The benchmark's warnings, less the idle server's starvation warning: on a machine whose
    cores are busy (a loaded CI machine) the idle server thread starves, says so, and its setup
    ends by ``--patience`` with what it had, by design."""
    return [line for line in out.splitlines() if "WARNING" in line and "server_priority='idle'" not in line]


@pytest.mark.timeout(300)
def test_loop_lag_benchmark_runs_both_parts_to_their_tables():
    """benchmarks/loop_lag.py on CartPole at a tiny scale, weights published after each batch: the
    in-process table (four setups) and the other-process table (four rows), and nothing left behind (the script reaps and warns).
    A setup that starves (the idle server on a loaded machine) ends after ``--patience``."""
    out = run_script("loop_lag.py", "--env", "cartpole", "--seconds", "0.3", "--warmup", "0.2", "--other-process",
                     "--patience", "5", "--update-weights", timeout=280)
    assert "The loop that collects (cartpole, 2 workers x 4 envs, update_weights after each batch)" in out
    setups = ("worker", "server", "server, idle") + (("idle, pinned",) if len(os.sched_getaffinity(0)) > 1 else ())
    assert all(re.search(rf"^{re.escape(s)}\s+[\d,]+\s+[\d.]+ / ", out, re.M) for s in setups), out
    assert len(re.findall(r"^(worker|server, idle)\s+(this session|its own session)\s+[\d,]+", out, re.M)) == 4, out
    assert not warnings_in(out), out


@pytest.mark.timeout(300)
def test_inference_benchmark_runs_every_cpu_setup_to_its_table():
    """benchmarks/inference.py on CartPole at a tiny scale (one round): every CPU setup (the pinned
    ones where this process may use two CPUs) measured and in the table, nothing left behind."""
    out = run_script("inference.py", "--skip-pong", "--rounds", "1", "--seconds", "0.3", "--warmup", "0.2",
                     "--patience", "10", timeout=280)
    setups = ["worker", "server", "server, 2 groups", "server, idle", "idle, 2 groups"]
    setups += ["idle, pinned", "pinned, 2 groups"] if len(os.sched_getaffinity(0)) > 1 else []
    table = out[out.index("CartPole-v1, 4-64-2 MLP"):]
    assert [line.split("  ")[0].strip() for line in table.splitlines()[2:] if line.strip()][:len(setups)] == setups, out
    assert "Pong: skipped (--skip-pong)" in out and not warnings_in(out), out


@pytest.mark.timeout(120)
def test_inference_benchmark_beside_a_busy_trainer_reports_the_trainers_rate():
    """``--busy-trainer --setups server``: worker inference (the ratios' base, always measured) and
    the server, each with the trainer's products per second, and the trainer alone first."""
    out = run_script("inference.py", "--skip-pong", "--rounds", "1", "--seconds", "0.3", "--warmup", "0.2",
                     "--busy-trainer", "--setups", "server", "--patience", "10", timeout=110)
    assert re.search(r"the busy trainer alone \(nothing collecting\): [\d,]+ products/s", out), out
    rows = re.findall(r"^(worker|server)\s+[\d,]+\s+[\d.]+\s+.*\s([\d,]+)\s+[\d,]+$", out, re.M)
    assert [r[0] for r in rows] == ["worker", "server"] and all(int(r[1].replace(",", "")) > 0 for r in rows), out
    assert "trainer/s" in out and not warnings_in(out), out


@pytest.mark.timeout(120)
def test_inference_benchmark_times_each_part_of_a_server_pass():
    """``--pass-parts``: one more window of the server with its pass timed part by part (the
    parts' rows, the instrumented pass, the wait between passes)."""
    out = run_script("inference.py", "--skip-pong", "--rounds", "1", "--seconds", "0.3", "--warmup", "0.2",
                     "--setups", "server", "--pass-parts", "--patience", "10", timeout=110)
    table = out[out.index("CartPole-v1: server, one forward pass part by part"):]
    ms = {m[0]: float(m[1]) for m in re.findall(r"^  (gather|forward|read back|write|answer|other|pass|between)\s+"
                                                r"(-?[\d.]+)", table, re.M)}
    assert set(ms) == {"gather", "forward", "read back", "write", "answer", "other", "pass", "between"}, out
    assert ms["pass"] > 0 and ms["forward"] > 0 and ms["forward"] <= ms["pass"], out
    assert re.search(r"one instrumented pass \(([\d,]+) passes\)", table) and not warnings_in(out), out


FAKE_BENCHMARK = """
import argparse, json, os, aiocollect
p = argparse.ArgumentParser(); p.add_argument("--json"); p.add_argument("--scale", type=float, default=1.0)
a = p.parse_args()
here = os.path.dirname(os.path.dirname(os.path.abspath(aiocollect.__file__)))
with open(a.json, "w") as f:
    json.dump({"machine": {"cpu": "x"}, "cartpole": {"limit_fps": 10.0, "results": [
        {"name": "limit", "ratio_to_limit": 1.0}, {"name": "ours", "ratio_to_limit": 0.5 * a.scale}]},
        "pong": {"skipped": "no envpool"}, "tree": here,
        "runs": [{"obs": "raw", "results": {"ours": {"ratio": 0.8}}},
                 {"obs": "84x84x4", "results": {"ours": {"ratio": 0.6}}}],
    }, f)
"""


@pytest.mark.timeout(180)
def test_compare_trees_runs_a_script_with_each_tree_and_prints_its_ratios_side_by_side(tmp_path):
    script = tmp_path / "fake_benchmark.py"
    script.write_text(FAKE_BENCHMARK)
    out = run_script("compare_trees.py", "--with", ROOT, "--rounds", "2", "--", str(script), "--scale", "1.5")
    assert "[4/4]" in out, out  # two rounds of each tree (here the same tree twice: an A/A run)
    rows = {line.split()[2]: line.split() for line in out.splitlines() if line.startswith("cartpole / ")}
    assert rows["ours"][3:6] == ["0.75", "0.75", "+0.0%"], out
    assert rows["limit"][3:5] == ["1.00", "1.00"], out
    assert "pong" not in "".join(rows), out  # (a skipped table has no ratio)
    # runs of the same setups in a list (pixels.py: one per observation format), each under its own
    runs = {line.split()[2]: line.split()[5:7] for line in out.splitlines() if line.startswith("runs / ")}
    assert runs == {"raw": ["0.80", "0.80"], "84x84x4": ["0.60", "0.60"]}, out


@pytest.mark.timeout(120)
def test_compare_trees_refuses_a_directory_without_aiocollect(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "compare_trees.py"), "--with", str(tmp_path), "--",
         "benchmarks/vector_envs.py"], capture_output=True, text=True, timeout=100, cwd=ROOT,
    )
    assert proc.returncode != 0
    assert "compare_trees:" in proc.stderr and str(tmp_path) in proc.stderr, proc.stderr


@pytest.mark.timeout(240)
def test_weight_sync_benchmark_measures_the_servers_updates_and_extra_memory():
    """benchmarks/weight_sync.py --server-only at a tiny scale: each model's update into the
    inference server's own copy of the weights is timed on the CPU (and CUDA where present), and
    the copy's bytes are in the table."""
    out = run_script("weight_sync.py", "--server-only", "--n", "2", "--n-big", "1", "--big-params", "20000",
                     "--envs-per-worker", "2", "--frames-per-batch", "64", timeout=220)
    table = out[out.index("inference='server': update_weights(policy)"):]
    assert re.search(r"^MLP 4-64-2\s+cpu\s+[\d.]+ / [\d.]+ ms\s+[\d.]+ ms\s+1\.8 kB", table, re.M), out
    assert re.search(r"^MLP ~0\.02M\s+cpu\s+[\d.]+ / [\d.]+ ms", table, re.M), out


@pytest.mark.timeout(300)
def test_throughput_benchmark_measures_each_prefetch_side_by_side():
    """benchmarks/throughput.py --prefetch 0,1 at a tiny scale: a row per delivery and prefetch,
    each measured (frames per second and its ratio to the limit), with the trainer's wait."""
    out = run_script("throughput.py", "--skip-baselines", "--seconds", "0.5", "--warmup", "0.1", "--workers", "1",
                     "--envs-per-worker", "2", "--frames-per-batch", "64", "--prefetch", "0,1", "--train-ms", "5",
                     "--lag-seconds", "0.2", timeout=280)
    for delivery in ("sync", "async"):
        for prefetch in (0, 1):
            assert re.search(rf"^aiocollect {delivery} prefetch={prefetch}\s+[\d,]+\s+[\d.]+", out, re.M), out


@pytest.mark.timeout(300)
def test_sliced_throughput_reports_ratio_and_per_core_ratio_of_each_setup(tmp_path):
    """benchmarks/throughput.py --sliced at a tiny scale: the limit meeting at each batch (its
    processes at a barrier every 16 steps here) and each delivery take turns with the limit
    (SIGSTOP and SIGCONT), a row each with both rates, the ratio and the per-core ratio (frames per
    CPU-second of its processes over the limit's), sync's figures over the meeting limit's, the
    same in its JSON in the form compare_trees.py reads, and no process left (the barrier is broken
    at the end, not waited out)."""
    path = tmp_path / "sliced.json"
    out = run_script("throughput.py", "--sliced", "--turns", "2", "--turn-seconds", "0.3", "--warmup", "0.1",
                     "--workers", "2", "--envs-per-worker", "2", "--frames-per-batch", "64", "--json", str(path),
                     timeout=280)
    for name in ("limit meeting at each batch", "aiocollect sync", "aiocollect async"):
        assert re.search(rf"^{name}\s+[\d,]+\s+[\d,]+\s+[\d.]+\s+[\d.]+\s+[\d.]+ / ", out, re.M), out
    assert "every 16 steps" in out, out
    assert re.search(r"^aiocollect sync over the limit meeting at each batch: [\d.]+ \(per core [\d.]+\)$", out, re.M), out
    assert "still running" not in out, out
    data = json.loads(path.read_text())
    results = data["results"]
    assert set(results) == {"limit meeting at each batch", "aiocollect sync", "aiocollect async"}
    assert all(r["ratio"] > 0 and r["per_core"] > 0 for r in results.values())
    sync, meeting = results["aiocollect sync"], results["limit meeting at each batch"]
    assert sync["over_lockstep"] == pytest.approx(sync["ratio"] / meeting["ratio"])
    assert sync["per_core_over_lockstep"] == pytest.approx(sync["per_core"] / meeting["per_core"])
    assert meeting["batches"] is None and "over_lockstep" not in results["aiocollect async"]
    assert {r["name"] for r in data["per_core"].values()} == {
        "limit meeting at each batch, per core", "aiocollect sync, per core", "aiocollect async, per core"}


@pytest.mark.timeout(240)
def test_step_cost_benchmark_times_the_rollout_against_the_limit(tmp_path):
    """benchmarks/step_cost.py at a tiny scale: a row per setup (CartPole and the no-op env, at
    each count of envs) with both loops' µs per step and their ratio, and the same in its JSON,
    in the form compare_trees.py reads (a name and a ratio per result)."""
    path = tmp_path / "step_cost.json"
    out = run_script("step_cost.py", "--envs", "1,3", "--steps", "8", "--turns", "2", "--json", str(path), timeout=220)
    for name in ("CartPole, 1 envs", "CartPole, 3 envs", "no-op env and policy, 1 envs", "no-op env and policy, 3 envs"):
        assert re.search(rf"^{name}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+-?[\d.]+ µs", out, re.M), out
    results = json.loads(path.read_text())["results"]
    assert [r["envs"] for r in results] == [1, 3, 1, 3]
    assert all(r["ratio"] > 0 and r["limit_us_per_step"] > 0 and r["rollout_us_per_step"] > 0 for r in results)


@pytest.mark.timeout(240)
def test_step_cost_benchmark_with_idle_turns_adds_their_rows_and_the_comparison():
    """``--idle-ms``: each CartPole setup also gets a row of the turns that start after a sleep, and
    a line comparing them with the busy turns, for both loops."""
    out = run_script("step_cost.py", "--envs", "2", "--steps", "8", "--turns", "2", "--idle-ms", "1", timeout=220)
    for name in ("CartPole, 2 envs", "CartPole, 2 envs, idle 1 ms a turn", "no-op env and policy, 2 envs"):
        assert re.search(rf"^{re.escape(name)}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+-?[\d.]+ µs", out, re.M), out
    assert re.search(r"^turns after 1 ms asleep, 2 envs: a step of the limit costs [+-]\d+% CPU, of the rollout "
                     r"[+-]\d+%", out, re.M), out
    assert "no-op env and policy, 2 envs, idle" not in out


@pytest.mark.timeout(240)
def test_startup_benchmark_times_each_part_from_fresh_processes(tmp_path):
    """benchmarks/startup.py, one round at 1 worker: the imports, launch -> first batch of both
    policies, what that is beyond ``import torch``, the second collector, and the raw figures in
    its JSON."""
    path = tmp_path / "startup.json"
    out = run_script("startup.py", "--repeat", "1", "--workers", "1", "--json", str(path), timeout=220)
    span = r"\s+[\d.]+ s  \[[\d.]+ - [\d.]+\]$"
    for row in ("import torch", "from aiocollect import Collector", "launch -> first batch, random policy, 1 worker",
                "launch -> first batch, MLP policy, 1 worker", "second collector, same process, MLP, 1 worker"):
        assert re.search(rf"^{re.escape(row)}{span}", out, re.M), out
    assert len(re.findall(r"^first batch beyond import torch, (random|MLP), 1 worker +[+-][\d.]+ s$", out, re.M)) == 2, out
    data = json.loads(path.read_text())
    assert sorted(data["first_batch"]) == ["MLP, 1 worker", "random, 1 worker"]
    assert all(len(runs) == 1 and runs[0]["launch_to_first_batch"] > runs[0]["imports_done"] > 0
               for runs in data["first_batch"].values())


def test_startup_benchmark_says_when_an_editable_install_compiles_at_each_import(monkeypatch, tmp_path):
    """With ``PYTHONDONTWRITEBYTECODE`` set and no bytecode for aiocollect (an editable install),
    every child compiles aiocollect's modules: found without importing the package, and said."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import startup
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    monkeypatch.setattr(sys, "pycache_prefix", str(tmp_path))  # (where no bytecode is)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert not startup._has_bytecode("aiocollect") and startup._has_bytecode("no_such_package_here")
    note = startup.bytecode_note()
    assert note is not None and "PYTHONDONTWRITEBYTECODE is set" in note and "unset it" in note
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    assert startup.bytecode_note() is None
    assert [startup._label("MLP", n, [1, 2]) for n in (1, 2)] == ["MLP, 1 worker", "MLP, 2 workers"]
    assert startup._label("MLP", 2, [2]) == "MLP"
