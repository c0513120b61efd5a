"""Evaluation videos: ``Evaluator(record_video=True)`` records its first episode of each
evaluation (``env.render()`` after the reset and after each step), as frames in the metrics or
as an mp4 file written by its worker (the ``video`` extra)."""

from __future__ import annotations

import importlib.util
import os
import sys

import anyio
import numpy as np
import pytest

from aiocollect import ConfigError, Evaluator, SpecError
from aiocollect.events import WorkerRestarted
from aiocollect.testing import CountingEnv

H, W = 16, 24
LENGTH = 7  # steps per episode

needs_extra = pytest.mark.skipif(
    importlib.util.find_spec("imageio") is None or importlib.util.find_spec("imageio_ffmpeg") is None,
    reason="the video extra (imageio, imageio-ffmpeg) is not installed",
)


class RenderingEnv(CountingEnv):
    """CountingEnv whose ``render()`` (with ``render_mode="rgb_array"``) is a frame filled with
    the step of the episode: frame ``k`` of an episode is all ``k``."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(self, render_mode=None, crash_once_flag=None, **kwargs):
        super().__init__(**kwargs)
        self.render_mode = render_mode
        self.step_of_episode = 0
        if crash_once_flag is not None:  # the first process to build one crashes at its 3rd step
            try:
                os.close(os.open(crash_once_flag, os.O_CREAT | os.O_EXCL))
                self.crash_at_step = 3
            except FileExistsError:
                pass

    def reset(self, *, seed=None, options=None):
        self.step_of_episode = 0
        return super().reset(seed=seed, options=options)

    def step(self, action):
        self.step_of_episode += 1
        return super().step(action)

    def render(self):
        if self.render_mode != "rgb_array":
            return None
        return np.full((H, W, 3), self.step_of_episode, np.uint8)


def rendering_env(**kwargs):
    return RenderingEnv(episode_length=LENGTH, **kwargs)


def read_mp4(path, height=H, width=W):
    """The frames of an mp4 file of ``height x width`` frames, ``uint8 [T, H, W, 3]``, decoded by the
    ffmpeg that imageio-ffmpeg ships (its own frame readers leave their pipes open)."""
    import subprocess

    import imageio_ffmpeg

    proc = subprocess.run([imageio_ffmpeg.get_ffmpeg_exe(), "-v", "error", "-i", str(path), "-f", "rawvideo",
                           "-pix_fmt", "rgb24", "-"], capture_output=True, check=True, timeout=60)
    return np.frombuffer(proc.stdout, np.uint8).reshape(-1, height, width, 3)


def check_frames(frames, count=LENGTH + 1):
    assert isinstance(frames, np.ndarray) and frames.dtype == np.uint8
    assert frames.shape == (count, H, W, 3)
    assert [int(f[0, 0, 0]) for f in frames] == list(range(count))  # the reset's, then one per step


async def test_the_first_episode_comes_back_as_frames_of_its_length():
    async with Evaluator(rendering_env, num_trajectories=3, num_envs=2, seed=0, record_video=True,
                         env_kwargs={"render_mode": "rgb_array"}) as ev:
        with anyio.fail_after(60):
            first = await ev.evaluate(step=1)
            second = await ev.evaluate(step=2)
    check_frames(first["video"])
    check_frames(second["video"])  # each evaluation records its own first episode
    assert first["episode_length_mean"] == LENGTH


@pytest.mark.loops("asyncio")
async def test_video_max_frames_caps_the_frames_and_log_prefix_names_the_metric():
    async with Evaluator(rendering_env, num_trajectories=1, record_video=True, video_max_frames=3,
                         env_kwargs={"render_mode": "rgb_array"}, log_prefix="eval") as ev:
        with anyio.fail_after(60):
            metrics = await ev.evaluate()
    check_frames(metrics["eval/video"], 3)


@needs_extra
@pytest.mark.loops("asyncio")
async def test_with_video_dir_the_worker_writes_a_readable_mp4(tmp_path):
    async with Evaluator(rendering_env, num_trajectories=2, record_video=True, video_dir=tmp_path / "videos",
                         video_fps=10, env_kwargs={"render_mode": "rgb_array"}) as ev:
        with anyio.fail_after(60):
            tagged = await ev.evaluate(step=40)
            untagged = await ev.evaluate()
    assert tagged["video"] == str(tmp_path / "videos" / "eval_40.mp4")
    assert untagged["video"] == str(tmp_path / "videos" / "eval_2.mp4")  # the evaluation's number
    frames = read_mp4(tagged["video"])
    assert frames.shape == (LENGTH + 1, H, W, 3)
    # (lossy: the fill values come back within a few levels)
    assert np.abs(frames[:, :, :, 0].mean(axis=(1, 2)) - np.arange(LENGTH + 1)).max() < 3


@pytest.mark.loops("asyncio")
async def test_an_env_that_does_not_render_rgb_arrays_fails_naming_render_mode():
    async with Evaluator(rendering_env, num_trajectories=1, record_video=True) as ev:
        with anyio.fail_after(60), pytest.raises(Exception) as info:
            await ev.evaluate()
        text = str(info.value) + str(info.value.__cause__)
        assert "render() returned None" in text and "render_mode='rgb_array'" in text
        assert "env_kwargs={'render_mode': 'rgb_array'}" in text
        assert isinstance(info.value, SpecError) or isinstance(info.value.__cause__, SpecError)
        # the worker stays usable: without the video the same env evaluates
    async with Evaluator(rendering_env, num_trajectories=1) as ev:
        with anyio.fail_after(60):
            assert "video" not in await ev.evaluate()


def test_a_missing_extra_is_said_at_construction_with_the_pip_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "imageio", None)  # (import imageio raises ImportError)
    monkeypatch.setitem(sys.modules, "imageio.v2", None)
    with pytest.raises(ConfigError, match=r"pip install 'aiocollect\[video\]'"):
        Evaluator(rendering_env, record_video=True, video_dir=tmp_path)
    Evaluator(rendering_env, record_video=True)  # frames need no extra


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(video_dir="videos"), r"video_dir='videos' .*, so it needs record_video=True"),
        (dict(record_video=1), r"record_video=1"),
        (dict(record_video=True, video_fps=0), r"video_fps=0"),
        (dict(record_video=True, video_max_frames=0), r"video_max_frames=0"),
        (dict(record_video=True, video_prefix="a/b"), r"video_prefix='a/b'"),
    ],
)
def test_bad_video_options_name_themselves(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Evaluator(rendering_env, **kwargs)


@pytest.mark.loops("asyncio")
@pytest.mark.parametrize("on_worker_failure", ["raise", "restart"])
async def test_a_worker_replaced_after_a_crash_records_the_rerun_evaluation(tmp_path, on_worker_failure):
    flag = str(tmp_path / "crashed")
    restarts = []
    async with Evaluator(rendering_env, num_trajectories=1, record_video=True, on_worker_failure=on_worker_failure,
                         env_kwargs={"render_mode": "rgb_array", "crash_once_flag": flag}) as ev:
        ev.on(WorkerRestarted, restarts.append)
        with anyio.fail_after(60):
            if on_worker_failure == "raise":
                with pytest.raises(Exception):
                    await ev.evaluate()  # the crash fails it; the next one gets a new worker
            metrics = await ev.evaluate()
    check_frames(metrics["video"])
    assert len(restarts) == (on_worker_failure == "restart")


@needs_extra
@pytest.mark.loops("asyncio")
@pytest.mark.timeout(120)
async def test_a_user_records_cartpole_as_frames_and_as_an_mp4(tmp_path):
    """gymnasium's own CartPole, rendered by pygame (``gymnasium[classic-control]``): the first
    episode of an evaluation as frames, then as a file, both of its length plus one."""
    pytest.importorskip("pygame")
    from test_user_programs import Greedy

    policy = Greedy()
    kwargs = dict(num_trajectories=2, seed=3, record_video=True, env_kwargs={"render_mode": "rgb_array"})
    with anyio.fail_after(100):
        async with Evaluator("CartPole-v1", policy, **kwargs) as ev:
            frames = (await ev.evaluate(step=1))["video"]
        async with Evaluator("CartPole-v1", policy, video_dir=tmp_path, **kwargs) as ev:
            path = (await ev.evaluate(step=1))["video"]
    assert frames.dtype == np.uint8 and frames.shape[1:] == (400, 600, 3) and 2 <= len(frames) <= 501
    assert frames.std() > 0  # a picture, not a blank
    written = read_mp4(path, 400, 600)
    assert written.shape == frames.shape  # the same seed: the same first episode
    assert np.abs(written.astype(np.int16) - frames).mean() < 8  # (lossy)
