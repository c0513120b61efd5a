"""examples/ppo_cartpole.py, run as a user runs it: its short mode learns (the mean return of the
episodes that ended rises from the first progress line to the last), writes its learning curve,
exits non-zero when a ``--target`` is missed, and leaves no process behind.

The ``--torchrl`` tests run only where TorchRL is installed (``.venv-torchrl``, built by
``scripts/torchrl-compat.sh``): there the hand-written GAE and PPO loss are also checked against
TorchRL's ``GAE`` and ``ClipPPOLoss`` on a real batch.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
import time
import uuid
from types import ModuleType

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "ppo_cartpole.py")
PROGRESS = re.compile(r"^frames\s+(\d+)\s+fps\s+\d+\s+episodes\s+(\d+)\s+mean return\s+(\S+)", re.MULTILINE)
FINAL = re.compile(r"^final mean return (\S+) \(last \d+ of (\d+) training episodes\), (\d+) frames, "
                   r"wall time \S+ s since launch \(training loop \S+ s\)$", re.MULTILINE)


@functools.cache
def load_example() -> ModuleType:
    """The example as a module (its ``if __name__ == "__main__"`` part does not run)."""
    spec = importlib.util.spec_from_file_location("ppo_cartpole_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while being made
    spec.loader.exec_module(module)
    return module


def _marked_pids(mark: str) -> list[int]:
    """Processes whose environment holds ``PPO_TEST_MARK=mark``: the example and every process
    it started (the launcher, the collector's workers, the Evaluator's worker inherit it)."""
    needle = f"PPO_TEST_MARK={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def run_example(*args: str, timeout: float = 200, example: str = EXAMPLE) -> subprocess.CompletedProcess[str]:
    """Runs the example (or another ``example`` file) in a fresh interpreter; checks that it
    started processes of its own and that none of them is left once it exited."""
    mark = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, example, *args], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, PPO_TEST_MARK=mark))
    children: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:  # (stdout is a few KB: no pipe fills up)
            children.update(p for p in _marked_pids(mark) if p != proc.pid)
            time.sleep(0.1)
        stdout, stderr = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert children, f"no worker process of the example was seen:\n{stdout}\n{stderr}"
    deadline = time.monotonic() + 10  # the launcher's children exit once it is gone: give them a moment
    while _marked_pids(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _marked_pids(mark), f"processes of the example left running: {_marked_pids(mark)}"
    return result


def check_learns(result: subprocess.CompletedProcess[str], total_frames: int) -> list[float]:
    """The run ended well, collected ``total_frames``, and its mean return rose clearly from the
    first progress line to the last; returns the mean return of each line."""
    assert result.returncode == 0, f"the example failed:\n{result.stdout}\n{result.stderr}"
    lines = PROGRESS.findall(result.stdout)
    assert len(lines) >= 4, result.stdout
    frames = [int(f) for f, _, _ in lines]
    assert frames == sorted(frames) and frames[-1] == total_frames, result.stdout
    assert all(int(n) > 0 for _, n, _ in lines), f"a progress window without an ended episode:\n{result.stdout}"
    returns = [float(r) for _, _, r in lines]
    first, last = returns[0], returns[-1]
    # CartPole's random policy averages about 22; a learning PPO is many times that by the end of
    # the short run, one that does not learn (a sign error, stale weights) stays where it began
    assert last >= 2 * first and last >= first + 50, f"the mean return did not rise: {returns}\n{result.stdout}"
    final = FINAL.search(result.stdout)
    assert final is not None, result.stdout
    assert int(final.group(3)) == total_frames
    assert "greedy evaluation of the final actor: return_mean" in result.stdout
    return returns


@pytest.mark.timeout(240)  # (about 40 s on 2 idle cores; several times that on a loaded machine)
def test_short_run_learns_writes_its_curve_and_leaves_nothing(tmp_path):
    short = load_example().SHORT
    png = tmp_path / "curve.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") else []
    result = run_example("--short", *plot)
    check_learns(result, short["total_frames"])
    if plot:
        assert f"learning curve written to {png}" in result.stdout
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        import matplotlib.image

        pixels = matplotlib.image.imread(png)  # it decodes, and is not blank
        assert pixels.ndim == 3 and len(set(map(tuple, pixels.reshape(-1, pixels.shape[-1]).tolist()))) > 2


@pytest.mark.timeout(240)
def test_a_missed_target_exits_with_status_1():
    result = run_example("--short", "--total-frames", "2048", "--eval-episodes", "0", "--target", "501")
    assert result.returncode == 1, f"{result.stdout}\n{result.stderr}"
    final = FINAL.search(result.stdout)
    assert final is not None and float(final.group(1)) < 501
    assert "target not reached" in result.stderr and "< 501" in result.stderr


def test_bad_sizes_are_refused_before_anything_starts():
    result = subprocess.run([sys.executable, EXAMPLE, "--total-frames", "5000"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "total_frames=5000 is not a multiple of frames_per_batch=1024" in result.stderr


@pytest.mark.skipif(importlib.util.find_spec("torchrl") is not None, reason="TorchRL is installed here")
def test_torchrl_flag_without_torchrl_says_what_to_install():
    result = subprocess.run([sys.executable, EXAMPLE, "--short", "--torchrl"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1
    assert "--torchrl needs TorchRL" in result.stderr and "pip install torchrl" in result.stderr
    assert "Traceback" not in result.stderr and "frames" not in result.stdout


# -- with TorchRL -----------------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_torchrl_short_run_learns():
    pytest.importorskip("torchrl")
    result = run_example("--short", "--torchrl")
    assert "TorchRL GAE + ClipPPOLoss" in result.stdout
    check_learns(result, load_example().SHORT["total_frames"])


async def test_hand_written_gae_and_loss_match_torchrl_on_a_real_batch():
    """On a batch with episodes that terminate and that are truncated, and a trajectory cut by the
    batch's end: the example's GAE gives TorchRL's advantages and value targets, and its loss
    TorchRL's loss terms and gradients."""
    pytest.importorskip("torchrl")
    import anyio
    import torch

    from aiocollect import Collector

    ppo = load_example()
    cfg = ppo.Config(frames_per_batch=512, total_frames=512)
    torch.manual_seed(0)
    actor, critic = ppo.make_models(cfg, 4, 2)
    with anyio.fail_after(30):
        async with Collector("CartPole-v1", actor, frames_per_batch=512, total_frames=512, num_workers=2,
                             envs_per_worker=2, seed=0, max_frames_per_traj=40) as collector:
            batch = (await collector.collect()).clone()  # ours: not a view on the workers' memory
    assert batch["next", "terminated"].any() and batch["next", "truncated"].any()
    assert not batch["next", "done"][:, -1].all(), "no trajectory crosses the batch's end"

    torchrl_gae, torchrl_loss = ppo.torchrl_objectives(actor, critic, cfg)
    ours = ppo.gae(batch.clone(), critic, cfg.gamma, cfg.gae_lambda)
    theirs = torchrl_gae(batch.clone())
    for key in ("advantage", "value_target"):
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-4, rtol=1e-4)

    # change the actor so that the probability ratios are not all 1 (the clipping matters)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.3 * torch.randn_like(p))
    minibatch = theirs.reshape(-1)[:256]
    params = [*actor.parameters(), *critic.parameters()]
    losses = ("loss_objective", "loss_critic", "loss_entropy")

    def terms_and_grads(loss_module):
        for p in params:
            p.grad = None
        terms = loss_module(minibatch)
        sum(terms[key] for key in losses).backward()
        return {key: terms[key].detach() for key in losses}, [p.grad.clone() for p in params]

    ours_terms, ours_grads = terms_and_grads(ppo.PPOLoss(actor, critic, cfg))
    theirs_terms, theirs_grads = terms_and_grads(torchrl_loss)
    for key in losses:
        torch.testing.assert_close(ours_terms[key], theirs_terms[key], atol=1e-5, rtol=1e-4)
    for ours_grad, theirs_grad in zip(ours_grads, theirs_grads, strict=True):
        torch.testing.assert_close(ours_grad, theirs_grad, atol=1e-5, rtol=1e-4)
