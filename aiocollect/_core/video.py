"""Evaluation videos: the frames of an evaluation's first episode, recorded in the evaluator's
worker (:class:`VideoRecorder`, from ``env.render()``), and written as an mp4 file there
(:func:`write_video`, with imageio and its ffmpeg plugin: the ``video`` extra), or handed back
in the result as one ``uint8`` array ``[T, H, W, 3]``.

Both sides use it: the evaluator checks the extra at construction (:func:`require_writer`), the
worker records and writes. numpy only (imageio when a file is written).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from .errors import ConfigError, SpecError

EXTRA = "pip install 'aiocollect[video]'"


def require_writer() -> Any:
    """imageio's v2 API (what writes mp4 files through imageio-ffmpeg); :class:`ConfigError`
    naming the extra if either is missing."""
    try:
        import imageio.v2 as iio
        import imageio_ffmpeg  # noqa: F401 - the ffmpeg plugin imageio writes mp4 files with
    except ImportError as exc:
        raise ConfigError(
            f"record_video=True with video_dir writes mp4 files with imageio and imageio-ffmpeg, which are not "
            f"installed ({exc}); install them with {EXTRA}, or leave video_dir=None to get the frames in the "
            f"result instead"
        ) from exc
    return iio


class VideoRecorder:
    """The frames of one episode of one env: :meth:`start` after its reset, :meth:`add` after
    each of its steps, at most ``max_frames`` of them (``None``: all)."""

    def __init__(self, max_frames: int | None) -> None:
        self.max_frames = max_frames
        self.frames: list[np.ndarray] = []
        self.env: Any = None  # the env being recorded (None: not recording)

    def start(self, env: Any, name: str) -> None:
        self.frames, self.env, self.name = [], env, name
        self.add()

    def add(self) -> None:
        if self.max_frames is not None and len(self.frames) >= self.max_frames:
            return
        frame = self.env.render()
        if not isinstance(frame, np.ndarray) or frame.ndim != 3 or frame.shape[-1] not in (3, 4):
            mode = getattr(self.env, "render_mode", None)
            self.env = None
            raise SpecError(
                f"record_video=True: {self.name}'s render() returned {_describe(frame)}, not an RGB image "
                f"[H, W, 3] (its render_mode is {mode!r}); make the env with render_mode='rgb_array': "
                f"gymnasium.make(id, render_mode='rgb_array'), or env_kwargs={{'render_mode': 'rgb_array'}}"
            )
        self.frames.append(np.asarray(frame[..., :3], dtype=np.uint8))

    def stop(self) -> None:
        self.env = None

    def take(self) -> np.ndarray | None:
        """The frames recorded, as one array ``[T, H, W, 3]`` (``None``: none), and forget them."""
        frames, self.frames = self.frames, []
        self.env = None
        return np.stack(frames) if frames else None


def write_video(frames: np.ndarray, directory: str, name: str, fps: int) -> str:
    """Write ``frames`` as ``<directory>/<name>.mp4`` (the directory is made if needed); its path."""
    iio = require_writer()
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{name}.mp4")
    # macro_block_size=2: H.264 in yuv420p needs even sizes only (imageio's default, 16, would
    # resize most renders, CartPole's 600x400 included)
    iio.mimwrite(path, list(frames), fps=fps, macro_block_size=2)
    return path


def _describe(frame: Any) -> str:
    if isinstance(frame, np.ndarray):
        return f"an array of shape {frame.shape}"
    return "None" if frame is None else f"a {type(frame).__name__}"


__all__ = ["EXTRA", "VideoRecorder", "require_writer", "write_video"]
