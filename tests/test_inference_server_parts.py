"""The inference server's parts, driven without worker processes: the policy runner's one way to
be driven (``act(obs, rows=..., is_init=...)``, and :meth:`attach` for what the server shares
among its runners, so that nothing outside a runner sets its internals), the server's options
as one frozen object, when waiting requests make a pass, and a server serving seats through its
shared segment and eventfds, with its weights' versions and a recurrent policy's rows."""

from __future__ import annotations

import os
import select
import threading
from functools import partial

import anyio
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict.nn import TensorDictModule

from aiocollect._collector.inference_server import InferenceServer
from aiocollect._collector.server_parts import Requests, ServerOptions
from aiocollect._core.layout import Leaf, action_leaves, observation_leaves
from aiocollect._worker.inference_client import ACTIONS_READY, IDLE, REQUEST, SERVER_STOPPED
from aiocollect._worker.policy import ModuleRunner, PolicySpec, TensorDictRunner, build_runner
from aiocollect._worker.recurrent import RecurrentMemory

OBS = spaces.Box(-10, 10, (1,), np.float32)
ACT = spaces.Discrete(4)
STATE = (Leaf(("recurrent_state",), (1,), "float32"),)


class Count(torch.nn.Module):
    """The action is the state carried so far; the next state adds the observation (a sum per row)."""

    def forward(self, observation, state, is_init):
        return state[:, 0].round().long().clamp(0, 3), state + observation


def counting() -> TensorDictModule:
    return TensorDictModule(Count(), in_keys=["observation", "recurrent_state", "is_init"],
                            out_keys=["action", ("next", "recurrent_state")])


class Scaled(torch.nn.Module):
    """The action is ``round(scale * observation)``: ``scale`` is a weight to update."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))

    def forward(self, observation):
        return (observation[:, 0] * self.scale).round().long().clamp(0, 3)


def runner_of(policy, n: int, state: tuple = ()):
    return build_runner(PolicySpec("local", state=state), ACT, action_leaves(ACT), observation_leaves(OBS), n, [],
                        policy)


def obs(*values: float) -> list[np.ndarray]:
    return [np.array(values, np.float32)[:, None]]


def test_a_workers_recurrent_runner_carries_the_state_of_all_its_rows_and_shows_their_episode_starts():
    runner = runner_of(counting(), 2, STATE)
    assert isinstance(runner, TensorDictRunner) and runner.memory is not None
    assert runner.is_init is runner.memory.is_init and runner.is_init.all()  # (the rollout marks episode starts here)
    runner.act(obs(1, 2))
    runner.act(obs(1, 2))
    assert runner.memory.state[0][:, 0].tolist() == [2, 4] and not runner.is_init.any()
    runner.is_init[1] = True  # (an episode ends in row 1: its state starts again from zeros)
    runner.act(obs(1, 1))
    assert runner.memory.state[0][:, 0].tolist() == [3, 1]


def test_a_runner_attached_to_a_shared_memory_steps_only_the_rows_each_pass_names():
    """The server's runners of 2 rows share a memory of 6: a pass names its rows and their
    ``is_init``; a step without rows (a probe, a warm-up) is the first rows."""
    shared = RecurrentMemory(STATE, 6)
    runner = runner_of(counting(), 2, STATE).attach(memory=shared)
    assert runner.memory is shared
    runner.act(obs(5, 7), rows=np.array([4, 5]), is_init=np.array([True, True]))
    assert shared.state[0][:, 0].tolist() == [0, 0, 0, 0, 5, 7]
    assert shared.is_init.tolist() == [True] * 4 + [False, False]
    _, actions, _ = runner.act(obs(1, 1), rows=np.array([4, 5]), is_init=np.array([False, True]))
    assert actions[0].tolist() == [3, 0] and shared.state[0][4:, 0].tolist() == [6, 1]  # (row 5 started again)
    runner.act(obs(2, 2))
    assert shared.state[0][:, 0].tolist() == [2, 2, 0, 0, 6, 1]
    whole = runner_of(counting(), 6, STATE).attach(memory=shared)
    whole.act(obs(1, 1, 1, 1, 1, 1), is_init=np.zeros(6, bool))  # (every row: the whole memory)
    assert shared.state[0][:, 0].tolist() == [3, 3, 1, 1, 7, 2]


def test_attach_wraps_the_callable_once_stages_the_inputs_and_keeps_the_module_as_the_weights():
    module, wrapped, staged = Scaled(), [], []

    def wrap(fn):
        wrapped.append(fn)
        return lambda *args: fn(*args)

    def to_device(arr):
        staged.append(arr.shape)
        return torch.from_numpy(arr)

    runner = runner_of(module, 3).attach(wrap=wrap, to_device=to_device, memory=RecurrentMemory(STATE, 9))
    assert isinstance(runner, ModuleRunner) and runner.memory is None  # (a module carries no state)
    assert wrapped == [module] and runner.model is module
    for _ in range(2):  # (the first call checks the outputs, the next takes the fast path)
        _, actions, _ = runner.act(obs(1, 2, 3))
        assert actions[0].tolist() == [1, 2, 3]
    assert staged == [(3, 1), (3, 1)]


def test_the_server_options_are_one_frozen_object():
    opts = ServerOptions(exploration_type="mode", env_batch_size=4, priority="idle")
    assert opts == ServerOptions(exploration_type="mode", env_batch_size=4, priority="idle")
    with pytest.raises(AttributeError):
        opts.priority = "normal"  # type: ignore[misc]
    assert not opts.wraps and ServerOptions(compile_policy=True).wraps


def test_waiting_requests_make_a_pass_at_once_or_once_they_hold_env_batch_size_rows():
    fds = [os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(3)]
    requests = Requests(fds, rows=2, min_rows=4)
    try:
        os.eventfd_write(fds[0], REQUEST)  # (the others have not asked yet: between batches)
        assert requests.ready(1) == [0]
        for fd in fds[:2]:
            os.eventfd_write(fd, REQUEST)
        assert requests.ready(1) == [0, 1]  # 4 rows
        os.eventfd_write(fds[2], REQUEST)
        assert requests.ready(1) == []  # 2 rows, and seats 0 and 1 may still ask
        os.eventfd_write(fds[0], IDLE)
        os.eventfd_write(fds[1], REQUEST)
        assert sorted(requests.ready(1) or requests.ready(1) or []) == [1, 2]
        requests.stop()
        assert requests.ready(1) is None
    finally:
        requests.close()
        for fd in fds:
            os.close(fd)


def _ask(server: InferenceServer, seat: int, values: list[float], is_init: list[bool] | None = None) -> None:
    segment = server.segment
    assert segment is not None
    segment.obs[0][seat, :, 0] = values
    if is_init is not None:
        assert segment.init_req is not None
        segment.init_req[seat] = is_init
    os.eventfd_write(segment.req_fds[seat], REQUEST)


def _answer(server: InferenceServer, seat: int) -> tuple[list[int], int]:
    segment = server.segment
    assert segment is not None
    fd = segment.resp_fds[seat]
    assert select.select([fd], [], [], 10)[0], "no answer within 10 s"
    assert os.eventfd_read(fd) == ACTIONS_READY
    return segment.act[0][seat].tolist(), int(segment.versions[seat])


async def _answered(server: InferenceServer, seat: int) -> tuple[list[int], int]:
    """:func:`_answer`, waited for on the event loop."""
    segment = server.segment
    assert segment is not None
    with anyio.fail_after(10):
        await anyio.wait_readable(segment.resp_fds[seat])
    return _answer(server, seat)


def _server(policy, **options) -> InferenceServer:
    spec = {"obs": observation_leaves(OBS), "act": action_leaves(ACT), "act_space": ACT}
    server = InferenceServer(policy, spec, 2, 3, ServerOptions(**options))
    server.allocate(server.probe())
    server.start()
    return server


def test_a_server_answers_each_seat_with_the_version_of_the_weights_that_acted_and_stops_cleanly():
    user = Scaled()
    server = _server(user)
    try:
        assert len(vars(server)) <= 9, sorted(vars(server))  # (its parts, each owning its own: 43 before)
        _ask(server, 1, [1, 2, 3])
        assert _answer(server, 1) == ([1, 2, 3], 0)
        with torch.no_grad():
            user.scale.fill_(0)  # (the trainer's own module: not what the server runs)
        _ask(server, 0, [1, 1, 1])
        assert _answer(server, 0) == ([1, 1, 1], 0)
        anyio.run(server.load, {"scale": torch.tensor(2.0)}, 7)
        _ask(server, 0, [1, 0, 1])
        _ask(server, 1, [0, 1, 1])
        assert _answer(server, 0) == ([2, 0, 2], 7) and _answer(server, 1) == ([0, 2, 2], 7)
        assert (server.forward_passes, server.rows_served) in {(3, 12), (4, 12)}
        assert server.policy_attr("scale").item() == 2.0 and user.scale.item() == 0.0
        resp = os.dup(server.segment.resp_fds[0])  # type: ignore[union-attr]
    finally:
        server.stop()
    try:
        assert os.eventfd_read(resp) == SERVER_STOPPED
    finally:
        os.close(resp)
    assert server.segment is None and server.thread is None and server.requests is None
    server.stop()  # (twice: nothing left to do)


class Gate:
    """Holds a forward pass of :class:`Held` while :attr:`hold` is set, until :attr:`release`."""

    def __init__(self) -> None:
        self.hold, self.entered, self.release = False, threading.Event(), threading.Event()


GATE = Gate()  # (module-level: the server runs a deep copy of the policy)


class Held(Scaled):
    """:class:`Scaled` whose forward pass can be held (a long pass: a big model, or one a busy
    Python thread slows)."""

    def forward(self, observation):
        if GATE.hold:
            GATE.entered.set()
            GATE.release.wait(60)
        return super().forward(observation)


async def _held_pass() -> tuple[InferenceServer, Gate]:
    """A server of :class:`Held` whose pass for seat 0 (observations 1, 1, 1) is under way, held."""
    global GATE
    GATE = gate = Gate()
    server = _server(Held())
    try:
        gate.hold = True
        _ask(server, 0, [1, 1, 1])
        with anyio.fail_after(60):  # (no thread of anyio's here: trio keeps its idle threads 10 s)
            while not gate.entered.is_set():
                await anyio.sleep(0.005)
    except BaseException:
        gate.release.set()
        server.stop()
        raise
    return server, gate


@pytest.mark.timeout(120)
@pytest.mark.loops("asyncio", "uvloop", "trio")
@pytest.mark.asyncio_and_uvloop  # (a thread wakes the loop)
async def test_a_weight_load_waits_for_the_pass_in_progress_without_stopping_the_event_loop():
    """``update_weights`` under server inference while a forward pass holds the weights: the load
    waits for that pass off the loop (the loop's other tasks run meanwhile), then the next pass
    acts with the new weights and version, and the pass in progress kept the old ones."""
    server, gate = await _held_pass()
    try:
        ticks, loaded = 0, anyio.Event()

        async def load() -> None:
            await server.load({"scale": torch.tensor(2.0)}, 7)
            loaded.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(load)
            while ticks < 20:  # the loop runs while the load waits for the pass in progress
                await anyio.sleep(0.001)
                ticks += 1
            assert not loaded.is_set() and server.weights.version == 0
            gate.hold = False
            gate.release.set()
        assert await _answered(server, 0) == ([1, 1, 1], 0)  # (the pass in progress: the old weights)
        _ask(server, 1, [1, 0, 1])
        assert await _answered(server, 1) == ([2, 0, 2], 7)
    finally:
        gate.release.set()
        server.stop()


@pytest.mark.timeout(120)
@pytest.mark.loops("asyncio", "uvloop", "trio")
@pytest.mark.asyncio_and_uvloop  # (a thread wakes the loop)
async def test_loads_left_during_a_pass_are_made_in_order_cancelled_or_not_and_a_failed_one_raises():
    """Three ``update_weights`` while one pass holds the weights: one whose copy fails (its error
    is raised to its caller), then two more, the first of them cancelled while it waits (a made
    version still reaches the server). Once the pass ends, the last version and its weights act,
    and the server goes on serving."""
    server, gate = await _held_pass()
    try:
        failed: list[BaseException] = []

        async def bad() -> None:
            try:
                await server.load({"scale": torch.ones(3)}, 7)  # (a scalar weight: the copy fails)
            except RuntimeError as exc:
                failed.append(exc)

        async def cancelled() -> None:
            with anyio.CancelScope() as scope:
                scope.cancel()  # (as it starts waiting: the wait is shielded)
                await server.load({"scale": torch.tensor(2.0)}, 8)

        async with anyio.create_task_group() as tg:
            for load in (bad, cancelled, partial(server.load, {"scale": torch.tensor(3.0)}, 9)):
                tg.start_soon(load)
                await anyio.sleep(0.01)  # (in this order)
            assert server.weights.version == 0  # (the pass still holds the weights)
            gate.hold = False
            gate.release.set()
        assert len(failed) == 1 and "shape" in str(failed[0]), failed
        assert await _answered(server, 0) == ([1, 1, 1], 0)
        _ask(server, 1, [1, 0, 1])
        assert await _answered(server, 1) == ([3, 0, 3], 9)
    finally:
        gate.release.set()
        server.stop()


def test_a_recurrent_servers_passes_carry_each_seats_own_rows():
    server = _server(counting(), state=STATE)
    try:
        memory = server.runners.memory
        assert memory is not None and not memory.state[0].any() and memory.is_init.all()  # (the probe left none)
        _ask(server, 1, [1, 2, 3], [True] * 3)
        assert _answer(server, 1) == ([0, 0, 0], 0)
        _ask(server, 1, [1, 1, 1], [False, False, True])
        assert _answer(server, 1) == ([1, 2, 0], 0)
        assert memory.state[0][:, 0].tolist() == [0, 0, 0, 2, 3, 1]
    finally:
        server.stop()
