"""inference="server": the workers step envs only, a copy of the user's policy runs in this
process, one forward pass over the envs of every worker waiting for actions. Complete programs
on real CartPole envs and real worker processes: the same data as worker inference for the same
seed, the training loop with updates to its natural end (weights loaded into the server's copy,
per-frame versions), the policy's extra outputs in the batch, vector envs and async delivery, a
policy that raises, a worker replaced after a failure, and the options it refuses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import anyio
import gymnasium as gym
import pytest
import torch
from tensordict.nn import TensorDictModule

from aiocollect import Collector, ConfigError
from aiocollect.events import EpisodeEnded, WeightsApplied, WorkerRestarted
from aiocollect.testing import CountingEnv

from test_user_programs import Greedy, check_batch, train


async def _collect(inference: str, *, delivery: str = "sync", updates: bool = False, **kw) -> list:
    torch.manual_seed(0)
    policy = Greedy()
    out = []
    async with Collector("CartPole-v1", policy, frames_per_batch=2 * 4 * 16, total_frames=2 * 4 * 16 * 4, seed=3,
                         num_workers=2, envs_per_worker=4, delivery=delivery, inference=inference, prefetch=0,
                         **kw) as c:
        async for batch in c:
            out.append(batch.clone())
            if updates:
                train(policy)
                await c.update_weights(policy)
    return out


@pytest.mark.parametrize("updates", [False, True], ids=["fixed", "training"])
async def test_server_gives_the_data_of_worker_inference_for_the_same_seed(updates):
    """A deterministic policy, the same seed: every frame (observations, actions, next
    observations, rewards, ends, trajectory ids) is the one worker inference collects, and the
    frames follow CartPole's dynamics; with the training loop's updates (prefetch=0: each batch
    collected after the previous update) the versions match too."""
    with anyio.fail_after(60):
        served = await _collect("server", updates=updates)
        replicas = await _collect("worker", updates=updates)
    assert len(served) == len(replicas) == 4
    for s, r in zip(served, replicas):
        check_batch(s)
        for key in ("observation", "action", ("next", "observation"), ("next", "reward"), ("next", "done"),
                    ("collector", "traj_ids"), ("collector", "policy_version")):
            assert torch.equal(s[key], r[key]), key
    if updates:
        assert [int(b["collector", "policy_version"].max()) for b in served] == [0, 1, 2, 3]


async def test_training_loop_loads_new_weights_into_the_servers_copy_and_stamps_each_frame():
    """`async for batch in c: ...; await c.update_weights(state_dict)` to the natural end with
    async delivery: the state dict of another module is loaded into the server's own copy of the
    weights (the policy the collector was given is left as it is), every update is acknowledged by
    every worker at once, and every frame's version is that of the forward pass that chose its
    action (a batch may span an update; versions never go back within an env's row)."""
    torch.manual_seed(0)
    policy, trained = Greedy(), Greedy()
    before = [p.detach().clone() for p in policy.parameters()]
    applied: list[WeightsApplied] = []
    frames = 0
    with anyio.fail_after(60):
        c = Collector("CartPole-v1", policy, frames_per_batch=64, total_frames=64 * 8, num_workers=2,
                      envs_per_worker=2, delivery="async", inference="server", seed=0)
        c.on(WeightsApplied, applied.append)
        async with c:
            async for batch in c:
                frames += batch.numel()
                check_batch_rows(batch)
                train(trained)
                version = await c.update_weights(trained.state_dict())
                assert all(torch.equal(p, q) for p, q in zip(policy.parameters(), before))
                assert version == c.policy_version
    assert frames == 64 * 8
    assert {(e.version, e.worker) for e in applied} == {(v, w) for v in range(1, 9) for w in (0, 1)}


def check_batch_rows(batch) -> None:
    obs, nxt, done = batch["observation"], batch["next", "observation"], batch["next", "done"][..., 0]
    assert not bool((~(nxt[:, :-1] == obs[:, 1:]).all(-1) & ~done[:, :-1]).any()), "a frame breaks continuity"
    versions = batch["collector", "policy_version"][..., 0] if batch["collector", "policy_version"].dim() > 2 else \
        batch["collector", "policy_version"]
    assert bool((versions[:, 1:] >= versions[:, :-1]).all()), "a row's versions go back"


class Logits(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def forward(self, observation):
        logits = self.net(observation)
        return logits.argmax(-1), logits


async def test_policy_extra_outputs_are_in_the_batch():
    """A TensorDictModule writing the action and its logits: the logits land in the batch, and
    are what the policy gives for each frame's observation (the server's forward pass, row for
    row); frames of init_random_frames have zero logits."""
    torch.manual_seed(0)
    module = Logits()
    policy = TensorDictModule(module, in_keys=["observation"], out_keys=["action", "logits"])
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=2 * 3 * 10, total_frames=2 * 3 * 10 * 3,
                             num_workers=2, envs_per_worker=3, inference="server", init_random_frames=2 * 3 * 5,
                             seed=1) as c:
            batches = [b.clone() async for b in c]
    first = batches[0]
    assert first["logits"].shape == (6, 10, 2)
    assert bool((first["logits"][:, :5] == 0).all()), "random frames have no logits"
    for b in batches[1:]:
        with torch.no_grad():
            expected = module.net(b["observation"])
        torch.testing.assert_close(b["logits"], expected)
        assert torch.equal(b["action"], expected.argmax(-1))


async def test_vector_envs_with_async_delivery():
    """Gymnasium's CartPole vector entry point (8 sub-envs per worker) with async delivery: each
    batch is one worker's rows, every frame follows CartPole's dynamics and the actions are the
    policy's for the frames' observations."""
    torch.manual_seed(0)
    policy = Greedy()

    def make():
        return gym.make_vec("CartPole-v1", num_envs=8, vectorization_mode="vector_entry_point")

    with anyio.fail_after(60):
        async with Collector(make, policy, frames_per_batch=8 * 12, total_frames=8 * 12 * 6, num_workers=2,
                             delivery="async", inference="server", seed=2) as c:
            batches = [b.clone() async for b in c]
    assert len(batches) == 6
    for b in batches:
        check_batch_rows(b)
        with torch.no_grad():
            assert torch.equal(b["action"], policy(b["observation"]))


class Exploding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)
        self.calls = 0

    def forward(self, observation):
        self.calls += 1
        if self.calls == 30:
            raise ValueError("the policy failed on purpose")
        return self.net(observation).argmax(-1)


async def test_a_policy_that_raises_ends_the_run_with_its_error():
    """The policy raises in the server's 30th forward pass: the consumer gets that ValueError
    (with a note that the server raised it), and no worker, thread or shared memory is left
    (the test's fixture checks)."""
    with anyio.fail_after(60):
        c = Collector("CartPole-v1", Exploding(), frames_per_batch=2 * 2 * 8, num_workers=2, envs_per_worker=2,
                      inference="server")
        with pytest.raises(ValueError, match="on purpose") as info:
            async with c:
                async for _ in c:
                    pass
    assert any("inference server" in note for note in getattr(info.value, "__notes__", []))


async def test_a_failed_worker_is_replaced_and_served(tmp_path):
    """on_worker_failure="restart": an env that raises once; its worker's replacement is linked
    to the server and the run reaches total_frames with every frame continuous."""
    flag = str(tmp_path / "flag")

    def make():
        try:
            os.close(os.open(flag, os.O_CREAT | os.O_EXCL))
            return CountingEnv(episode_length=9, fail_at_step=7)
        except FileExistsError:
            return CountingEnv(episode_length=9)

    class Half(torch.nn.Module):
        def forward(self, observation):
            return (observation[..., 0] % 2).long()

    restarts = []
    with anyio.fail_after(60):
        c = Collector(make, Half(), frames_per_batch=2 * 10, total_frames=2 * 10 * 5, num_workers=2,
                      on_worker_failure="restart", inference="server", seed=0)
        c.on(WorkerRestarted, restarts.append)
        async with c:
            batches = [b.clone() async for b in c]
    assert len(restarts) == 1 and len(batches) == 5
    for b in batches:
        assert torch.equal(b["action"], (b["observation"][..., 0] % 2).long())


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_workers=0), "num_workers=0"),
    (dict(policy=None), "needs a policy"),
    (dict(policy=None, policy_factory=(Greedy, Greedy), num_workers=2), "one policy_factory per worker"),
    (dict(inference="gpu"), "'worker' or 'server'"),
])
def test_options_it_refuses_say_what_to_use(kwargs, match):
    args = dict(policy=Greedy(), frames_per_batch=16, num_workers=1, inference="server") | kwargs
    with pytest.raises(ConfigError, match=match):
        Collector("CartPole-v1", **args)


async def test_update_weights_for_some_workers_is_refused():
    """One policy serves every worker: worker_ids is a ConfigError naming the fix."""
    with anyio.fail_after(30):
        async with Collector("CartPole-v1", Greedy(), frames_per_batch=16, num_workers=2, inference="server") as c:
            with pytest.raises(ConfigError, match="worker_ids"):
                await c.update_weights(worker_ids=[0])


def test_server_workers_never_load_torch(tmp_path):
    """In a fresh interpreter (its own worker launcher), a collector with inference="server":
    no worker process has torch's library mapped; with worker inference they do (the check can
    tell)."""
    script = tmp_path / "check.py"
    script.write_text(textwrap.dedent("""
        import anyio, torch
        from aiocollect import Collector

        class Greedy(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(4, 2)

            def forward(self, observation):
                return self.net(observation).argmax(-1)

        def mapped(pid):
            with open(f"/proc/{pid}/maps") as f:
                return "libtorch" in f.read()

        async def main():
            for inference in ("server", "worker"):
                async with Collector("CartPole-v1", Greedy(), frames_per_batch=16, num_workers=2, envs_per_worker=2,
                                     inference=inference) as c:
                    it = aiter(c)
                    await anext(it)
                    print(inference, [mapped(pid) for pid in c.worker_pids])

        anyio.run(main)
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "server [False, False]" in out.stdout and "worker [True, True]" in out.stdout, out.stdout


async def test_updates_before_the_first_batch_and_from_another_task():
    """update_weights right after entering `async with` (before any batch), then from a task of
    its own every few milliseconds while the consumer iterates to total_frames: every update is
    a new version, the frames carry versions that never go back within a row, and the run ends
    cleanly with the updater still going."""
    torch.manual_seed(0)
    policy = Greedy()
    seen: list[int] = []
    with anyio.fail_after(60):
        async with Collector("CartPole-v1", policy, frames_per_batch=2 * 2 * 16, total_frames=2 * 2 * 16 * 6,
                             num_workers=2, envs_per_worker=2, inference="server", seed=0) as c:
            assert await c.update_weights(policy) == 1

            async def updater() -> None:
                while True:
                    train(policy)
                    seen.append(await c.update_weights(policy))
                    await anyio.sleep(0.005)

            async with anyio.create_task_group() as tg:
                tg.start_soon(updater)
                batches = [b.clone() async for b in c]
                tg.cancel_scope.cancel()
    assert len(batches) == 6 and seen == list(range(2, 2 + len(seen)))
    for b in batches:
        check_batch_rows(b)
    assert int(batches[-1]["collector", "policy_version"].max()) > 1


@pytest.mark.timeout(150)
async def test_compile_policy_runs_the_compiled_policy_from_the_start():
    """compile_policy={"backend": "eager"} (torch.compile's compiler-free backend: this machine
    need not have a C++ compiler): warmed up before collection for every number of rows a pass
    can have, and the frames are those of the plain policy."""
    calls = []

    @torch.compiler.disable
    def record(rows: int) -> None:  # (outside the graph: traced, the list's length is a guard, and
        calls.append(rows)  # every call recompiled)

    class Counting(Greedy):
        def forward(self, observation):
            record(observation.shape[0])
            return super().forward(observation)

    torch.manual_seed(0)
    policy = Counting()
    with anyio.fail_after(120):
        async with Collector("CartPole-v1", policy, frames_per_batch=2 * 2 * 8, total_frames=2 * 2 * 8 * 2,
                             num_workers=2, envs_per_worker=2, inference="server", seed=0,
                             compile_policy={"backend": "eager"}) as c:
            await c.start()
            assert {2, 4} <= set(calls), "warmed up for one worker's rows and both workers'"
            batches = [b.clone() async for b in c]
    for b in batches:
        check_batch_rows(b)
        with torch.no_grad():
            assert torch.equal(b["action"], Greedy.forward(policy, b["observation"]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(compile_policy=True, inference="worker"), "use inference='server'"),
    (dict(compile_policy="yes"), "must be False, True or a dict"),
    (dict(cudagraph_policy=True), "needs the policy on a CUDA device"),
])
async def test_wrapping_options_it_refuses(kwargs, match):
    args = dict(frames_per_batch=16, num_workers=1, inference="server") | kwargs
    with anyio.fail_after(30), pytest.raises(ConfigError, match=match):
        async with Collector("CartPole-v1", Greedy(), **args) as c:
            await c.start()


class Half(torch.nn.Module):
    def forward(self, observation):
        return (observation[..., 0] % 2).long()


def fast_and_slow(flag: str):
    """Envs of the first worker process to make one step at once; the other's take 50 ms a step
    waiting (CountingEnv's step_sleep: an env waiting on I/O, so that a loaded machine, which
    slows the fast worker's steps, does not slow the slow one's as much and close the gap)."""
    def make():
        try:
            fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        except FileExistsError:
            pass
        with open(flag) as f:
            fast = f.read() == str(os.getpid())
        return CountingEnv(episode_length=20, step_sleep=0.0 if fast else 0.05)

    return make


@pytest.mark.parametrize("env_batch_size", [None, 2, 4])
async def test_first_ready_passes_do_not_let_a_slow_worker_stall_a_fast_one(tmp_path, env_batch_size):
    """Async delivery, one worker's envs much slower to step than the other's: served as they
    come (None) or in passes of one worker's envs (env_batch_size=2), the fast worker delivers
    most batches; with env_batch_size=4 (both workers' envs) every pass waits for the slow one,
    so both deliver alike. Every frame's action is the policy's, and the run ends at total_frames
    (the last passes do not wait for a worker that has finished)."""
    with anyio.fail_after(60):
        async with Collector(fast_and_slow(str(tmp_path / "fast")), Half(), frames_per_batch=2 * 10,
                             total_frames=2 * 10 * 12, num_workers=2, envs_per_worker=2, inference="server",
                             env_batch_size=env_batch_size, delivery="async", seed=0) as c:
            batches = [b.clone() async for b in c]
    assert len(batches) == 12
    by_worker = [0, 0]
    for b in batches:
        assert torch.equal(b["action"], (b["observation"][..., 0] % 2).long())
        by_worker[int(b["collector", "traj_ids"][0, 0]) % 4 // 2] += 1
    server = c.stats().server  # (the server's totals, kept after the run)
    assert server is not None and server["rows"] >= 240 and server["seconds"] > 0
    if env_batch_size == 4:
        # (Which worker delivers more batches is not the measure here: a pass serves one worker's
        # rows alone by design while the other is between batches, more often on a loaded
        # machine.) Most passes hold both workers' 4 rows; some hold one worker's 2 by design
        # (while the other is between batches, and at the end); a server that never waited for
        # both gives about 2 rows a pass.
        rows = server["rows"] / server["passes"]
        assert rows > 2.4, f"{rows:.2f} rows a pass: passes did not wait for both workers' envs"
    else:
        assert max(by_worker) >= 9, f"batches per worker {by_worker}: the fast worker was held back"


def test_env_batch_size_outside_server_inference_or_out_of_range_is_refused():
    with pytest.raises(ConfigError, match="use inference='server'"):
        Collector("CartPole-v1", Greedy(), frames_per_batch=16, env_batch_size=2)
    with pytest.raises(ConfigError, match="positive int"):
        Collector("CartPole-v1", Greedy(), frames_per_batch=16, inference="server", env_batch_size=0)


async def test_env_batch_size_above_the_envs_is_refused_at_start():
    with anyio.fail_after(30), pytest.raises(ConfigError, match="use at most 4"):
        async with Collector("CartPole-v1", Greedy(), frames_per_batch=16, num_workers=2, envs_per_worker=2,
                             inference="server", env_batch_size=5) as c:
            await c.start()


@pytest.mark.parametrize("delivery", ["sync", "async"])
async def test_worker_groups_give_the_data_of_worker_inference(delivery):
    """worker_groups=2 (each worker's 4 envs in two groups that step in turn, each asking for its
    next actions while the other steps): with the same seed and a deterministic policy, every
    frame is the one worker inference collects (sync: batch for batch; async: the same frames per
    env), and the episodes' events are the same."""
    async def run(**kw):
        torch.manual_seed(0)
        policy = Greedy()
        events: list[EpisodeEnded] = []
        c = Collector("CartPole-v1", policy, frames_per_batch=2 * 4 * 12, total_frames=2 * 4 * 12 * 4, seed=5,
                      num_workers=2, envs_per_worker=4, delivery=delivery, prefetch=0, **kw)
        c.on(EpisodeEnded, events.append)
        out = []
        async with c:
            async for batch in c:
                out.append(batch.clone())
        return out, events

    with anyio.fail_after(60):
        grouped, grouped_events = await run(inference="server", worker_groups=2)
        plain, plain_events = await run()

    def frames(batches):
        rows = {}
        for b in batches:
            for r in range(b.batch_size[0]):
                env = int(b["collector", "traj_ids"][r, 0]) % 8
                rows.setdefault(env, []).append(torch.cat([b["observation"][r], b["action"][r, :, None].float()], -1))
        return {env: torch.cat(parts) for env, parts in rows.items()}

    for b in grouped:
        check_batch_rows(b)
    g, p = frames(grouped), frames(plain)
    if delivery == "sync":
        assert g.keys() == p.keys() == set(range(8))
    else:  # first come, first delivered: of 4 batches a worker slowed down by the machine may deliver none
        assert len(g.keys() & p.keys()) >= 4, (g.keys(), p.keys())
    for env in g.keys() & p.keys():  # (async: workers deliver different numbers of batches; each env's frames agree)
        n = min(len(g[env]), len(p[env]))
        assert n >= 12 and torch.equal(g[env][:n], p[env][:n]), f"env {env}"
    if delivery == "sync":
        for a, b in zip(grouped, plain):
            assert torch.equal(a["observation"], b["observation"]) and torch.equal(a["action"], b["action"])
        key = lambda e: (e.env, e.traj_id, e.length, e.ret)  # noqa: E731
        assert sorted(map(key, grouped_events)) == sorted(map(key, plain_events)) and grouped_events


@pytest.mark.parametrize("kwargs, match", [
    (dict(worker_groups=2, envs_per_worker=3), "must be even"),
    (dict(worker_groups=3, envs_per_worker=6), "must be 1 or 2"),
    (dict(worker_groups=2, envs_per_worker=2, inference="worker"), "use inference='server'"),
])
def test_worker_groups_options_it_refuses(kwargs, match):
    args = dict(frames_per_batch=12, num_workers=1, inference="server") | kwargs
    with pytest.raises(ConfigError, match=match):
        Collector("CartPole-v1", Greedy(), **args)


async def test_server_priority_idle_runs_the_server_thread_under_sched_idle_and_gives_the_same_data():
    """server_priority="idle": the server's thread (only it) runs under SCHED_IDLE while it
    serves, and the complete training loop gives the data of the default priority for the same
    seed (the priority changes when the server runs, never what it computes)."""
    import threading

    def server_thread() -> threading.Thread:
        (thread,) = [t for t in threading.enumerate() if t.name == "aiocollect inference server"]
        return thread

    with anyio.fail_after(60):
        normal = await _collect("server", updates=True)
        torch.manual_seed(0)
        policy = Greedy()
        idle = []
        async with Collector("CartPole-v1", policy, frames_per_batch=2 * 4 * 16, total_frames=2 * 4 * 16 * 4, seed=3,
                             num_workers=2, envs_per_worker=4, inference="server", prefetch=0,
                             server_priority="idle") as c:
            async for batch in c:
                if not idle:
                    tid = server_thread().native_id
                    assert os.sched_getscheduler(tid) == os.SCHED_IDLE
                    assert os.sched_getscheduler(threading.get_native_id()) == os.SCHED_OTHER  # (not the loop's)
                idle.append(batch.clone())
                train(policy)
                await c.update_weights(policy)
    assert len(idle) == len(normal) == 4
    for a, b in zip(idle, normal):
        check_batch(a)
        for key in ("observation", "action", ("next", "observation"), ("collector", "policy_version")):
            assert torch.equal(a[key], b[key]), key


async def test_a_starved_idle_server_says_so_once_with_the_way_out(caplog, monkeypatch):
    """server_priority="idle" beside threads that keep every core busy (a trainer on the CPU):
    the server's thread gets almost no CPU time, and the collector says so on the ``aiocollect``
    logger, once, naming the setting to change; the collection goes on and closes cleanly."""
    import logging
    import threading

    from aiocollect._collector.inference_server import StarvationWatch

    monkeypatch.setattr(StarvationWatch, "WINDOW", 1.0)
    stop = threading.Event()

    def busy() -> None:
        a = torch.randn(256, 256)
        while not stop.is_set():
            torch.mm(a, a)

    trainers = [threading.Thread(target=busy, daemon=True) for _ in range(len(os.sched_getaffinity(0)))]
    caplog.set_level(logging.WARNING, logger="aiocollect")
    try:
        with anyio.fail_after(90):
            async with Collector("CartPole-v1", Greedy(), frames_per_batch=2 * 4 * 4, num_workers=2, envs_per_worker=4,
                                 inference="server", server_priority="idle") as c:
                it = aiter(c)
                check_batch(await anext(it))
                for t in trainers:
                    t.start()
                while not [r for r in caplog.records if "waited for a CPU" in r.getMessage()]:
                    check_batch(await anext(it))
                for _ in range(3):
                    check_batch(await anext(it))
    finally:
        stop.set()
        for t in trainers:
            if t.is_alive():
                t.join()
    (record,) = [r for r in caplog.records if r.name == "aiocollect"]
    assert "server_priority='idle'" in record.getMessage() and "Use server_priority='normal'" in record.getMessage()


def test_server_priority_is_checked():
    with pytest.raises(ConfigError, match="'normal' or 'idle'"):
        Collector("CartPole-v1", Greedy(), frames_per_batch=16, inference="server", server_priority="low")
    with pytest.raises(ConfigError, match="use inference='server'"):
        Collector("CartPole-v1", Greedy(), frames_per_batch=16, server_priority="idle")
