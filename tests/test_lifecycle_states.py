"""The lifecycle as a state machine (hypothesis' stateful testing): start, collect, iterate, break,
update_weights, pause, enable_profile, set_seed, state_dict, load_state_dict, a cancelled collect
and aclose, in random orders and from the first state on. Every call either works or raises the
error its docstring documents; no batch is lost to a cancellation (the collector's count is the
consumer's); and after each sequence no process, thread or shared memory is left (the autouse
fixture of conftest checks that after the test, this machine checks the workers after each run).

The collector lives in one event loop for the whole sequence: an anyio blocking portal, whose
thread runs the loop while hypothesis drives the rules from the test's thread; every call, even
a synchronous one, is made in the loop's thread, as a program would."""

from __future__ import annotations

import tempfile

import anyio
import pytest
import torch
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from aiocollect import AiocollectError, Collector, CollectorClosedError, EndOfCollection, ProfileConfig, State
from procs import alive

BATCHES = 6
FRAMES = 32


class Greedy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def forward(self, observation):
        return self.net(observation).argmax(-1)


def _continuous(batch) -> bool:
    obs, nxt, done = batch["observation"], batch["next", "observation"], batch["next", "done"][..., 0]
    return not bool((~(nxt[:, :-1] == obs[:, 1:]).all(-1) & ~done[:, :-1]).any())


class CollectorLifecycle(RuleBasedStateMachine):
    num_workers = 1

    def __init__(self) -> None:
        super().__init__()
        self.portal_cm = start_blocking_portal("asyncio")
        self.portal = self.portal_cm.__enter__()
        self.policy = Greedy()
        self.traces = tempfile.TemporaryDirectory()
        self.c = Collector("CartPole-v1", self.policy, frames_per_batch=FRAMES, total_frames=FRAMES * BATCHES,
                           num_workers=self.num_workers, envs_per_worker=2, prefetch=1)
        self.received = 0
        self.started = False
        self.closed = False
        self.pids: set[int] = set()

    def call(self, fn, *args):
        result = self.portal.call(fn, *args)
        self.pids.update(self.c.worker_pids)
        return result

    def _received(self, batch) -> None:
        assert _continuous(batch)
        self.received += 1

    # -- rules ------------------------------------------------------------------------------------
    @rule()
    def start(self) -> None:
        if self.closed:
            with pytest.raises(CollectorClosedError):
                self.call(self.c.start)
            return
        self.call(self.c.start)
        self.started = True

    @rule()
    def collect(self) -> None:
        if self.closed:
            with pytest.raises(CollectorClosedError):
                self.call(self.c.collect)
        elif self.received == BATCHES:
            with pytest.raises(EndOfCollection):
                self.call(self.c.collect)
        else:
            self._received(self.call(self.c.collect))
        self.started = True

    @rule(n=st.integers(1, 3))
    def iterate_then_break(self, n: int) -> None:
        async def loop() -> int:
            got = 0
            async for batch in self.c:
                self._received(batch)
                got += 1
                if got == n:
                    break
            return got

        if self.closed:
            with pytest.raises(CollectorClosedError):
                self.call(loop)
            return
        before = self.received
        got = self.call(loop)
        assert got == min(n, BATCHES - before)
        self.started = True

    @rule(delay=st.floats(0, 0.05))
    def cancelled_collect(self, delay: float) -> None:
        async def attempt() -> None:
            with anyio.move_on_after(delay):
                self._received(await self.c.collect())

        if self.closed or self.received == BATCHES:
            return
        self.call(attempt)
        self.started = True

    @rule(wait=st.booleans())
    def update_weights(self, wait: bool) -> None:
        if self.closed:
            with pytest.raises(CollectorClosedError):
                self.call(lambda: self.c.update_weights(self.policy, wait=wait))
            return
        before = self.c.policy_version
        assert self.call(lambda: self.c.update_weights(self.policy, wait=wait)) == before + 1
        self.started = True

    @rule()
    def pause_and_resume(self) -> None:
        async def paused() -> None:
            async with self.c.pause():
                assert self.c.paused
                await anyio.sleep(0.01)
            assert not self.c.paused

        self.call(paused)

    @rule()
    def enable_profile(self) -> None:
        config = ProfileConfig(workers=[0], num_rollouts=2, warmup_rollouts=1,
                               save_path=self.traces.name + "/t_{worker_idx}.json")

        # The collector's synchronous methods are called in its loop's thread, as in a program, and
        # its state is read there in the same step: a run that reaches total_frames stops on its own
        # (the loop's thread moves it to STOPPED), so a state read from this thread may be stale.
        def attempt() -> tuple[bool, bool]:
            stopped = self.c.state in (State.STOPPED, State.CLOSED)
            try:
                self.c.enable_profile(config)
            except CollectorClosedError:
                return stopped, True
            return stopped, False

        stopped, raised = self.call(attempt)
        assert raised == stopped, f"enable_profile() on a {self.c.state.value} collector: raised={raised}"

    @rule()
    def disable_profile(self) -> None:
        self.call(self.c.disable_profile)

    @rule(seed=st.integers(0, 2**31))
    def set_seed(self, seed: int) -> None:
        if self.c.state is State.CREATED:
            assert self.c.set_seed(seed) == seed + 2 * max(self.num_workers, 1)
        else:
            with pytest.raises(AiocollectError, match="before the collector starts"):
                self.c.set_seed(seed)

    @rule()
    def state_dict_round_trip(self) -> None:
        state = self.c.state_dict()
        assert state["batches"] == self.received
        if self.c.state is State.CREATED:
            self.c.load_state_dict(state)
        else:
            with pytest.raises(AiocollectError, match="before the collector starts"):
                self.c.load_state_dict(state)

    @rule()
    def aclose(self) -> None:
        self.call(self.c.aclose)
        self.closed = True

    @precondition(lambda self: self.started and not self.closed)
    @rule()
    def stats(self) -> None:
        s = self.c.stats()
        assert s.batches == self.received and s.frames == FRAMES * self.received

    # -- invariants -------------------------------------------------------------------------------
    @invariant()
    def nothing_is_lost(self) -> None:
        assert self.c.batches == self.received

    @invariant()
    def state_is_consistent(self) -> None:
        if self.closed:
            assert self.c.state is State.CLOSED
        elif not self.started:
            assert self.c.state is State.CREATED

    def teardown(self) -> None:
        try:
            self.portal.call(self.c.aclose)
        finally:
            self.portal_cm.__exit__(None, None, None)
            self.traces.cleanup()
        assert not [p for p in self.pids if alive(p)]


class LocalCollectorLifecycle(CollectorLifecycle):
    num_workers = 0


_settings = settings(max_examples=25, stateful_step_count=15, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.timeout(180)
def test_any_order_of_calls_works_or_raises_the_documented_error_process_backend():
    CollectorLifecycle.TestCase.settings = _settings
    CollectorLifecycle.TestCase().runTest()


@pytest.mark.timeout(180)
def test_any_order_of_calls_works_or_raises_the_documented_error_local_backend():
    LocalCollectorLifecycle.TestCase.settings = _settings
    LocalCollectorLifecycle.TestCase().runTest()
