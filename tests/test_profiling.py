"""Profiling: torch.profiler traces from chosen workers and from the collector's process, valid
Chrome trace JSON, announced as events; the errors TorchRL users know."""

from __future__ import annotations

import json

import anyio
import pytest
import torch

from aiocollect import AiocollectError, Collector, ConfigError, ProfileConfig
from aiocollect.events import ProfileTraceReady


class ArgmaxMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def forward(self, obs):
        return self.net(obs).argmax(-1)


@pytest.mark.parametrize("num_workers", [0, 2])
async def test_traces_are_written_per_worker_and_for_the_collector_and_announced(tmp_path, num_workers):
    c = Collector("CartPole-v1", ArgmaxMLP(), frames_per_batch=64, total_frames=64 * 6, num_workers=num_workers, envs_per_worker=2)
    seen = []
    profiled = [0, 1] if num_workers else [0]
    c.enable_profile(workers=profiled, num_rollouts=3, warmup_rollouts=1,
                     save_path=str(tmp_path / "trace_{worker_idx}.json"), on_trace_ready=seen.append)
    with c.subscribe(ProfileTraceReady) as sub:
        with anyio.fail_after(30):
            async with c:
                [b async for b in c]
        events = [e async for e in sub]
    # the local backend's envs run in the collector's process: one trace (one profiler per process)
    expected = profiled + [None] if num_workers else [None]
    assert sorted(map(str, (e.worker for e in events))) == sorted(map(str, expected))
    assert seen == events
    for e in events:
        name = "collector" if e.worker is None else e.worker
        assert e.path == str(tmp_path / f"trace_{name}.json")
        with open(e.path) as f:
            trace = json.load(f)  # Chrome's trace viewer reads JSON with traceEvents
        assert trace["traceEvents"], e.path
    with open(tmp_path / ("trace_0.json" if num_workers else "trace_collector.json")) as f:
        worker_trace = json.load(f)
    names = {ev.get("name", "") for ev in worker_trace["traceEvents"]}
    assert any("linear" in n or "addmm" in n for n in names), "the policy's forward passes were recorded"


async def test_profile_errors_as_in_torchrl(tmp_path):
    c = Collector("CartPole-v1", frames_per_batch=8, num_workers=1)
    with pytest.raises(ConfigError, match="num_rollouts=2 must be greater than warmup_rollouts=2"):
        c.enable_profile(num_rollouts=2, warmup_rollouts=2)
    with pytest.raises(ConfigError, match="names workers \\[3\\]"):
        c.enable_profile(workers=[0, 3])
    with pytest.raises(ConfigError, match="worker_idx"):
        c.enable_profile(workers=[0], save_path=str(tmp_path / "one.json"))
    with pytest.raises(ConfigError, match="activities"):
        ProfileConfig(activities=("gpu",))
    async with c:
        await c.collect()
        with pytest.raises(ConfigError, match="names workers \\[3\\]"):
            c.enable_profile(workers=[3])
    with pytest.raises(AiocollectError, match="closed"):
        c.enable_profile()
    with pytest.raises(ConfigError, match="names workers \\[1\\]"):
        Collector("CartPole-v1", frames_per_batch=8, num_workers=1, profile=ProfileConfig(workers=[1]))


def _trace_ok(path: str) -> bool:
    with open(path) as f:
        return bool(json.load(f)["traceEvents"])


@pytest.mark.parametrize("num_workers", [0, 2], ids=["local", "process"])
@pytest.mark.parametrize("when", ["inside_async_with", "after_some_batches", "from_another_task", "constructor"])
async def test_enable_profile_where_users_write_it_profiles_the_next_rollouts(tmp_path, num_workers, when):
    """enable_profile() right after entering `async with`, between batches, or from another task
    (or profile= in the constructor) profiles the next rollouts: each chosen worker and the
    collector's process write a trace once num_rollouts more batches are collected, the run goes
    on to its natural end, and the data stay continuous."""
    config = ProfileConfig(workers=[0], num_rollouts=2, warmup_rollouts=1, save_path=str(tmp_path / "t_{worker_idx}.json"))
    c = Collector("CartPole-v1", ArgmaxMLP(), frames_per_batch=32, total_frames=32 * 8, num_workers=num_workers,
                  envs_per_worker=2, profile=config if when == "constructor" else None)
    seen: list[ProfileTraceReady] = []
    c.on(ProfileTraceReady, seen.append)
    batches = 0
    with anyio.fail_after(60):
        async with c:
            if when == "inside_async_with":
                c.enable_profile(config)
            async with anyio.create_task_group() as tg:
                if when == "from_another_task":
                    tg.start_soon(anyio.sleep, 0.001)  # another task, that runs first
                    tg.start_soon(lambda: _enable_soon(c, config))
                async for batch in c:
                    batches += 1
                    if when == "after_some_batches" and batches == 3:
                        c.enable_profile(config)
                    obs, nxt, done = batch["observation"], batch["next", "observation"], batch["next", "done"][..., 0]
                    assert bool(((nxt[:, :-1] == obs[:, 1:]).all(-1) | done[:, :-1]).all())
    assert batches == 8
    expected = {None} | ({0} if num_workers else set())
    assert {e.worker for e in seen} == expected, seen
    assert all(_trace_ok(e.path) for e in seen)


async def _enable_soon(c: Collector, config: ProfileConfig) -> None:
    await anyio.sleep(0)
    c.enable_profile(config)


async def test_disable_profile_before_start_records_nothing(tmp_path):
    c = Collector("CartPole-v1", frames_per_batch=8, total_frames=40, num_workers=1)
    c.enable_profile(num_rollouts=2, warmup_rollouts=0, save_path=str(tmp_path / "t_{worker_idx}.json"))
    c.disable_profile()
    seen = []
    c.on(ProfileTraceReady, seen.append)
    async with c:
        [b async for b in c]
    assert seen == [] and not list(tmp_path.iterdir())


async def test_local_backend_worker_trace_when_the_collector_is_not_profiled(tmp_path):
    c = Collector("CartPole-v1", ArgmaxMLP(), frames_per_batch=16, total_frames=64, num_workers=0)
    c.enable_profile(num_rollouts=2, warmup_rollouts=0, profile_collector=False, save_path=str(tmp_path / "w{worker_idx}.json"))
    seen = []
    c.on(ProfileTraceReady, seen.append)
    async with c:
        [b async for b in c]
    assert [(e.worker, e.path) for e in seen] == [(0, str(tmp_path / "w0.json"))]
    with open(seen[0].path) as f:
        assert json.load(f)["traceEvents"]


def test_a_profiler_that_fails_to_start_is_not_stopped_later(monkeypatch, tmp_path):
    """A profiler whose start raises is not kept: stopping the recording afterwards (the run's
    end, a cancellation) does not call ``__exit__`` on a profiler that never ran (torch raises
    "Can't disable Kineto profiler when it's not running" there)."""
    import torch.profiler as tp

    from aiocollect._core.profiling import Recorder

    exits = []

    class Refuses(tp.profile):
        def __enter__(self):
            raise RuntimeError("profiler unavailable")

        def __exit__(self, *exc):
            exits.append(exc)

    monkeypatch.setattr(tp, "profile", Refuses)
    settings = ProfileConfig(num_rollouts=1, warmup_rollouts=0, save_path=str(tmp_path / "w{worker_idx}.json")).for_worker()
    recorder = Recorder(settings, str(tmp_path / "t.json"))
    with pytest.raises(RuntimeError, match="profiler unavailable"):
        recorder.before(0)
    recorder.abort()
    assert recorder.after(0) is None
    assert exits == []


def test_one_recording_raises_no_warning_of_the_profiler(tmp_path):
    """One recorded cycle gives a trace and no warning (torch 2.11 warns on a profiler's first
    cycle unless events are kept across cycles; the suite turns warnings into errors)."""
    import warnings

    from aiocollect._core.profiling import Recorder

    path = str(tmp_path / "one.json")
    settings = ProfileConfig(num_rollouts=1, warmup_rollouts=0, save_path=str(tmp_path / "w{worker_idx}.json")).for_worker()
    recorder = Recorder(settings, path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        recorder.before(0)
        torch.ones(3).sum()
        assert recorder.after(0) == path
    with open(path) as f:
        assert json.load(f)["traceEvents"]
