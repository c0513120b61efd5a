"""``python -m aiocollect``, run as a user runs it (a fresh interpreter): ``info`` reports this
environment's real versions and platform, ``bench`` runs its four setups to the end on
CartPole-v1 and prints a row for each, and bad input fails at once with a message that names
the cause and the fix. No figure is checked: timings are for the command's output, never for a
test."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from importlib import metadata

import pytest
import torch
from procs import alive, child_env

import aiocollect

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROW = r"([\d,]+)\s+(\d+\.\d\d)$"  # frames/s, ratio to limit


def run_cli(*args: str, timeout: float = 60, session: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m aiocollect ARGS`` from another directory than the repository's (the installed
    package is what runs)."""
    return subprocess.run(
        [sys.executable, "-m", "aiocollect", *args],
        capture_output=True, text=True, timeout=timeout, cwd="/", start_new_session=session,
    )  # fmt: skip


def in_session(sid: int) -> list[int]:
    """Live processes of session ``sid``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and alive(int(entry)):
            found.append(int(entry))
    return found


@pytest.mark.parametrize("args", [(), ("info",), ("bench",)])
def test_help(args):
    proc = run_cli(*args, "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m aiocollect")
    if args == ("bench",):
        assert all(f"--{option}" in proc.stdout for option in
                   ("env", "workers", "envs-per-worker", "frames-per-batch", "seconds", "warmup", "import", "progress"))


def test_no_command_is_a_usage_error():
    proc = run_cli()
    assert proc.returncode == 2 and "required" in proc.stderr and "{info,bench}" in proc.stderr


def test_info_reports_this_environment():
    """The text names every field, with the versions installed here."""
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    fields = dict(re.findall(r"^(\S+)\s+(\S+)", out, re.M))
    assert fields["aiocollect"] == aiocollect.__version__
    assert fields["python"] == ".".join(map(str, sys.version_info[:3]))
    for name in ("torch", "tensordict", "gymnasium", "numpy", "anyio", "cloudpickle", "uvloop", "trio"):
        assert fields[name] == metadata.version(name), name
    assert re.search(r"^  progress\s+yes\s+\(tqdm ", out, re.M)  # tqdm is in the test extra
    for line in ("platform:", "  system", "  cores", "  memory", "  memfd      yes", "  pidfd      yes",
                 "  workers    supported", "CUDA: "):  # fmt: skip
        assert line in out, line
    assert re.search(rf"^  cores\s+{os.cpu_count()}\b", out, re.M)


def test_info_json_matches_this_process():
    proc = run_cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["aiocollect"]["version"] == aiocollect.__version__
    assert os.path.samefile(info["aiocollect"]["path"], os.path.dirname(aiocollect.__file__))
    assert info["python"]["executable"] == sys.executable
    assert info["packages"]["torch"] == metadata.version("torch")
    assert info["extras"]["progress"] == {"tqdm": metadata.version("tqdm")}
    platform = info["platform"]
    assert platform["cores"] == os.cpu_count() and platform["memfd"] and platform["pidfd"] and platform["supported"]
    assert 0 < platform["memory"]["available_gib"] <= platform["memory"]["total_gib"]
    assert info["cuda"]["available"] == torch.cuda.is_available()
    assert info["cuda"]["torch_cuda"] == torch.version.cuda
    assert "names" not in info["cuda"]  # only with --cuda: that initialises CUDA


@pytest.mark.timeout(180)
@pytest.mark.parametrize("workers, progress", [(1, "auto"), (2, "bar")])
def test_bench_prints_every_setup_and_leaves_nothing(workers, progress):
    """A tiny window: the four rows (the limit's ratio 1.00), the machine line, the limit's two
    runs; progress on stderr (lines where stderr is no terminal, or tqdm's bar when asked);
    exit status 0, no process of the benchmark left once it exited."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "aiocollect", "bench", "--env", "CartPole-v1", "--workers", str(workers),
         "--envs-per-worker", "2", "--seconds", "0.5", "--warmup", "0.2", "--progress", progress],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/", start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert proc.returncode == 0, f"{out}\n{err}"
    n = workers * 2
    assert out.startswith(f"aiocollect bench: CartPole-v1, random actions, {workers} worker{'s' * (workers > 1)} x 2 envs, "
                          f"{n * 128} frames per batch")
    assert re.search(rf"^machine: {os.cpu_count()} cores.*Python {sys.version_info[0]}\.{sys.version_info[1]}.*"
                     rf"torch {re.escape(metadata.version('torch'))}", out, re.M), out  # fmt: skip
    rows = {name: re.search(rf"^{re.escape(name)}\s+{ROW}", out, re.M) for name in
            (f"limit ({workers} proc{'s' * (workers > 1)} x 2 envs)", f"AsyncVectorEnv x{n} ({n} procs, shm)", "aiocollect sync",
             "aiocollect async")}  # fmt: skip
    assert all(rows.values()), out
    assert all(int(m.group(1).replace(",", "")) > 0 for m in rows.values() if m), out
    assert next(iter(rows.values())).group(2) == "1.00"  # type: ignore[union-attr]
    assert "limit at the start / at the end:" in out and "WARNING" not in out and "FAILED" not in out
    if progress == "auto":  # stderr is a pipe: a line per setup
        assert re.findall(r"^\[(\d)/5\]", err, re.M) == list("12345") and err.count("  -> ") == 5, err
    else:
        assert "[0/5] measuring limit:" in err and "[5/5] done" in err, err  # tqdm's bar, redrawn in place
    deadline = time.monotonic() + 5
    while in_session(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not in_session(proc.pid)


def test_bench_unknown_env_id_says_what_to_do():
    proc = run_cli("bench", "--env", "CartPol-v1")
    assert proc.returncode == 2
    assert proc.stdout == ""  # nothing was started
    err = proc.stderr
    assert "bench: error: unknown environment id 'CartPol-v1'" in err
    assert "Did you mean: `CartPole`?" in err  # gymnasium's own hint
    assert "pprint_registry" in err and "--import PACKAGE" in err


def test_bench_missing_package_and_bad_sizes_fail_at_once():
    proc = run_cli("bench", "--env", "CartPole-v1", "--import", "no_such_module_registering_envs")
    assert proc.returncode == 2 and "--import no_such_module_registering_envs: No module named" in proc.stderr
    assert "install the package that provides it" in proc.stderr
    proc = run_cli("bench", "--env", "CartPole-v1", "--workers", "2", "--envs-per-worker", "3",
                   "--frames-per-batch", "100")  # fmt: skip
    assert proc.returncode == 2
    assert "--frames-per-batch 100 must be a multiple of --workers x --envs-per-worker (6)" in proc.stderr
    proc = run_cli("bench", "--env", "CartPole-v1", "--workers", "0")
    assert proc.returncode == 2 and "argument --workers: 0 must be > 0 (worker processes)" in proc.stderr


TEXT_ENV_PLUGIN = """
import gymnasium as gym
from gymnasium import spaces


class TextEnv(gym.Env):
    observation_space = spaces.Text(8)  # a space gymnasium steps, and aiocollect refuses
    action_space = spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "a", {}

    def step(self, action):
        return "b", 0.0, False, False, {}


gym.register("TextObs-v0", entry_point=TextEnv, max_episode_steps=10)
"""


@pytest.mark.timeout(180)
def test_bench_env_of_a_package_and_a_failing_setup(tmp_path):
    """--import registers an id in every process (the limit's are spawned: they import it
    themselves); a setup that fails (aiocollect refuses a Text observation space) gets a FAILED
    row with the library's message, the others are still measured, and the exit status is 1."""
    (tmp_path / "textobs_plugin.py").write_text(TEXT_ENV_PLUGIN)
    proc = subprocess.run(
        [sys.executable, "-m", "aiocollect", "bench", "--env", "TextObs-v0", "--import", "textobs_plugin",
         "--workers", "1", "--envs-per-worker", "2", "--seconds", "0.3", "--warmup", "0.1"],
        capture_output=True, text=True, timeout=150, cwd="/", env=child_env(tmp_path),
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 1, f"{out}\n{proc.stderr}"
    assert re.search(rf"^limit \(1 proc x 2 envs\)\s+{ROW}", out, re.M), out
    assert re.search(rf"^AsyncVectorEnv x2 \(2 procs, shm\)\s+{ROW}", out, re.M), out
    for name in ("aiocollect sync", "aiocollect async"):
        assert re.search(rf"^{name}\s+FAILED: SpecError: unsupported space Text.*FlattenObservation", out, re.M), out


def test_info_text_for_each_cuda_case():
    """The CUDA line in each case (this machine has one of them; the others from edited data)."""
    from aiocollect._cli.commands import format_info, gather_info

    info = gather_info()
    cases = [
        ({"torch_cuda": None, "available": False}, "CUDA: not available (this torch is built without CUDA)"),
        ({"torch_cuda": "12.8", "available": False},
         "CUDA: not available (torch built with CUDA 12.8, but it finds no device)"),
        ({"torch_cuda": "12.8", "available": True, "devices": 2},
         "CUDA: available, 2 device(s) (--cuda for their names; that initialises CUDA); torch built with CUDA 12.8"),
        ({"torch_cuda": "12.8", "available": True, "devices": 1, "names": ["NVIDIA H100"]},
         "CUDA: available, 1 device(s): NVIDIA H100; torch built with CUDA 12.8"),
    ]  # fmt: skip
    for cuda, line in cases:
        assert format_info({**info, "cuda": cuda}).splitlines()[-1] == line
