"""The Evaluator, with real worker processes and real gymnasium envs: its metrics are those of a
plain gymnasium loop, the weights it is given are the ones evaluated, background evaluations follow
their busy policy, results arrive as events, every error surfaces, and nothing is left behind
(the autouse fixture in conftest checks processes, threads and shared memory after each test)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential, TensorDictModule
from torch import nn

from aiocollect import (
    AiocollectError,
    BrokenWorkerError,
    Collector,
    ConfigError,
    SpecError,
    WorkerError,
)
from aiocollect._backends import workers as _workers
from aiocollect._evaluator.evaluator import (
    Evaluator,
    EvaluatorBusyError,
    EvaluatorClosedError,
    EvaluatorState,
)
from aiocollect._backends.launcher import get_launcher
from aiocollect.events import Event, EvaluationCompleted, EvaluationFailed
from aiocollect.testing import CountingEnv, InjectedFailure
from procs import alive as _alive

ROOT = Path(__file__).resolve().parent.parent
GOOD = (0.0, 0.0, 1.0, 1.0)  # push towards the side the pole falls to: balances for long
BAD = (0.0, 0.0, -1.0, -1.0)  # the other way: falls within ~10 steps


@pytest.fixture(scope="module", autouse=True)
def launcher_with_this_modules_imports():
    """Workers unpickle this module's policies by importing this module: have the launcher (the
    template they are forked from) import its heavy imports once, rather than every worker."""
    get_launcher().ensure_started(("torch", "tensordict", "tensordict.nn", "pytest", "anyio"))


# ---- policies and a plain gymnasium loop to compare with ------------------------------------------


class ArgmaxMLP(nn.Module):
    """The 4-64-2 MLP of the benchmarks, acting greedily."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs).argmax(-1)


class SignPolicy(nn.Module):
    """action = 1 if w . obs > 0: GOOD balances CartPole, BAD drops the pole at once."""

    def __init__(self, weight: tuple[float, ...] = BAD) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1, bias=False)
        with torch.no_grad():
            self.lin.weight.copy_(torch.tensor([weight]))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return (self.lin(obs)[..., 0] > 0).long()


class AlwaysOne(nn.Module):
    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.ones(obs.shape[0], dtype=torch.int64)


class FailingPolicy(nn.Module):
    """Raises from its ``fail_at``-th forward pass on (the first one is the start-up check)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls >= self.fail_at:
            raise InjectedFailure(f"policy failed at call {self.calls}")
        return torch.zeros(obs.shape[0], dtype=torch.int64)


def plain_loop(policy, n: int, seed: int, max_steps: int | None = None) -> tuple[list[float], list[int]]:
    """Episode j: ``reset(seed=seed + j)``, act greedily until the episode ends (or max_steps)."""
    env = gym.make("CartPole-v1")
    returns, lengths = [], []
    for j in range(n):
        obs, _ = env.reset(seed=seed + j)
        ret, length = 0.0, 0
        while True:
            with torch.no_grad():
                action = int(policy(torch.as_tensor(obs)[None])[0])
            obs, reward, terminated, truncated, _ = env.step(action)
            ret += float(reward)
            length += 1
            if terminated or truncated or (max_steps is not None and length >= max_steps):
                break
        returns.append(ret)
        lengths.append(length)
    env.close()
    return returns, lengths


def episodes(returns, lengths) -> dict:
    """metrics_fn that exposes every episode, to compare with a plain loop exactly."""
    return {"returns": returns.tolist(), "lengths": lengths.tolist()}


def assert_metrics(metrics: dict, returns: list[float], lengths: list[int]) -> None:
    assert metrics["returns"] == returns and metrics["lengths"] == lengths
    assert metrics["return_mean"] == pytest.approx(np.mean(returns))
    assert metrics["return_std"] == pytest.approx(np.std(returns))
    assert metrics["return_min"] == min(returns) and metrics["return_max"] == max(returns)
    assert metrics["episode_length_mean"] == pytest.approx(np.mean(lengths))
    assert metrics["num_trajectories"] == len(returns)


def slow(**kw):
    """A CountingEnv factory whose episodes take a while (10 ms per step by default)."""
    kw = {"episode_length": 99, "step_sleep": 0.01, **kw}
    return lambda: CountingEnv(**kw)


# ---- bad arguments ----------------------------------------------------------------------------------


class _Unpicklable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def forward(self, obs):
        return obs


BAD_ARGUMENTS = [
    pytest.param(dict(env="CartPol-v1"), r"env='CartPol-v1'.*'CartPole-v1'", id="unknown-env-id"),
    pytest.param(dict(env=42), r"env=42\b", id="env-not-callable"),
    pytest.param(dict(num_trajectories=0), r"num_trajectories=0\b", id="num_trajectories-zero"),
    pytest.param(dict(num_trajectories=2.5), r"num_trajectories=2\.5\b", id="num_trajectories-float"),
    pytest.param(dict(max_steps=0), r"max_steps=0\b.*None", id="max_steps-zero"),
    pytest.param(dict(exploration_type="bogus"), r"exploration_type='bogus'", id="exploration_type-bogus"),
    pytest.param(dict(busy_policy="sometimes"), r"busy_policy='sometimes'.*'skip', 'error' or 'queue'", id="busy_policy"),
    pytest.param(dict(busy_policy="queue", max_queued=0), r"max_queued=0\b", id="max_queued-zero"),
    pytest.param(dict(num_envs=0), r"num_envs=0\b", id="num_envs-zero"),
    pytest.param(dict(num_trajectories=2, num_envs=3), r"num_envs=3 is more than num_trajectories=2.*num_envs<=2", id="num_envs-too-many"),
    pytest.param(dict(env_kwargs=[("a", 1)]), r"env_kwargs=\[\('a', 1\)\]", id="env_kwargs-not-dict"),
    pytest.param(dict(seed="x"), r"seed='x'", id="seed-str"),
    pytest.param(dict(metrics_fn=42), r"metrics_fn=42\b", id="metrics_fn-not-callable"),
    pytest.param(dict(on_result="print"), r"on_result='print'", id="on_result-not-callable"),
    pytest.param(dict(policy=42), r"policy=42\b", id="policy-not-callable"),
    pytest.param(dict(policy=AlwaysOne(), policy_factory=AlwaysOne), r"policy or policy_factory", id="policy-and-factory"),
    pytest.param(dict(policy_factory="x"), r"policy_factory='x'", id="policy_factory-not-callable"),
    pytest.param(dict(shutdown_timeout=-1.0), r"shutdown_timeout=-1\.0\b", id="shutdown_timeout-negative"),
    pytest.param(dict(nice=20), r"nice=20\b.*19", id="nice-too-high"),
    pytest.param(dict(policy=_Unpicklable()), r"policy=.*could not be pickled.*policy_factory", id="policy-unpicklable"),
]


def test_bad_argument_raises_config_error_naming_it_and_starts_no_process(subtests):
    """Every invalid argument raises ConfigError at construction, naming the argument and the
    value; no worker (nor a launcher) is started for it."""
    for case in BAD_ARGUMENTS:
        kwargs, match = case.values
        with subtests.test(case.id):
            kwargs = dict(kwargs)
            env = kwargs.pop("env", "CartPole-v1")
            pids_before = list(_workers.started_pids)
            launcher_before = get_launcher().pid
            with pytest.raises(ConfigError, match=match):
                Evaluator(env, **kwargs)
            assert _workers.started_pids == pids_before
            assert get_launcher().pid == launcher_before


# ---- metrics ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_envs", [1, 3])
async def test_deterministic_policy_gives_the_metrics_of_a_plain_gymnasium_loop(num_envs):
    """Episode j starts from reset(seed=seed + j): the metrics equal a plain loop's with the same
    seeds, whatever the number of envs, and every evaluation sees the same episodes."""
    policy = ArgmaxMLP(seed=1)
    expected = plain_loop(policy, 6, seed=10)
    async with Evaluator("CartPole-v1", policy, num_trajectories=6, seed=10, num_envs=num_envs, metrics_fn=episodes) as ev:
        first = await ev.evaluate(step=3)
        again = await ev.evaluate()
    assert_metrics(first, *expected)
    assert first["step"] == 3 and again["step"] is None
    assert first["seconds"] > 0
    assert again["returns"] == first["returns"]


async def test_max_steps_truncates_each_episode():
    """max_steps ends an episode after that many steps (CountingEnv's reward is action + 1)."""
    env = lambda: CountingEnv(episode_length=50)  # noqa: E731 - a lambda travels with cloudpickle
    async with Evaluator(env, AlwaysOne(), num_trajectories=3, max_steps=7, metrics_fn=episodes) as ev:
        metrics = await ev.evaluate()
    assert metrics["lengths"] == [7, 7, 7] and metrics["returns"] == [14.0, 14.0, 14.0]


async def test_random_policy_with_a_seed_is_reproducible_across_evaluations_and_env_counts():
    """policy=None samples each episode's action space seeded with seed + j."""
    results = []
    for num_envs in (1, 2):
        async with Evaluator("CartPole-v1", num_trajectories=4, seed=5, num_envs=num_envs, metrics_fn=episodes) as ev:
            results += [await ev.evaluate(), await ev.evaluate()]
    assert all(r["returns"] == results[0]["returns"] for r in results)
    assert len(set(results[0]["returns"])) > 1


async def test_metrics_fn_adds_metrics_sync_or_async_and_a_non_mapping_fails_the_evaluation():
    async def success(returns, lengths):
        await anyio.sleep(0)
        return {"success_rate": float((lengths >= 5).mean()), "return_mean": -1.0}

    env = lambda: CountingEnv(episode_length=5)  # noqa: E731
    async with Evaluator(env, AlwaysOne(), num_trajectories=2, metrics_fn=success) as ev:
        metrics = await ev.evaluate(step=1)
    assert metrics["success_rate"] == 1.0
    assert metrics["return_mean"] == -1.0, "metrics_fn may replace a built-in metric"
    assert list(metrics)[-3:] == ["step", "num_trajectories", "seconds"]

    async with Evaluator(env, AlwaysOne(), num_trajectories=2, metrics_fn=lambda r, n: 1.0) as ev:
        with pytest.raises(TypeError, match="metrics_fn returned float") as raised:
            await ev.evaluate()
    assert isinstance(raised.value, ConfigError), "a wrong metrics_fn is the caller's argument error"


async def test_weights_for_a_policy_that_cannot_load_them_is_a_config_error():
    """evaluate(weights) with a policy that is a plain function: the worker cannot load weights
    into it; the caller gets a ConfigError (also a TypeError) naming the fix, and the evaluator
    goes on."""

    def left(td):  # (a callable that is no nn.Module takes and returns the TensorDict)
        td["action"] = torch.zeros(td.batch_size, dtype=torch.int64)
        return td

    async with Evaluator("CartPole-v1", left, num_trajectories=2, seed=0) as ev:
        with pytest.raises(TypeError, match="not a torch.nn.Module that could load them") as raised:
            await ev.evaluate(ArgmaxMLP().state_dict())
        assert isinstance(raised.value, ConfigError)
        assert (await ev.evaluate())["num_trajectories"] == 2


async def test_exploration_type_is_the_interaction_type_the_policy_runs_under():
    """A categorical TensorDict policy acts by the mode of its distribution (deterministic, the
    default): the plain argmax loop's metrics."""
    mlp = ArgmaxMLP(seed=2)
    policy = ProbabilisticTensorDictSequential(
        TensorDictModule(mlp.net, ["observation"], ["logits"]),
        ProbabilisticTensorDictModule(in_keys=["logits"], out_keys=["action"], distribution_class=torch.distributions.Categorical),
    )
    expected = plain_loop(mlp, 4, seed=0)
    async with Evaluator("CartPole-v1", policy, num_trajectories=4, seed=0, metrics_fn=episodes) as ev:
        assert_metrics(await ev.evaluate(), *expected)
    async with Evaluator("CartPole-v1", policy, num_trajectories=4, seed=0, metrics_fn=episodes, exploration_type="random") as ev:
        sampled = await ev.evaluate()
    assert sampled["returns"] != expected[0]


# ---- weights ----------------------------------------------------------------------------------------


async def test_weights_given_to_evaluate_are_the_ones_evaluated_and_none_restores_the_built_ones():
    """A module, its state dict and TensorDict.from_module(module) are loaded into the worker's
    replica; None evaluates the weights the policy was built with again."""
    good, bad = SignPolicy(GOOD), SignPolicy(BAD)
    expect_good = plain_loop(good, 3, seed=0, max_steps=60)
    expect_bad = plain_loop(bad, 3, seed=0, max_steps=60)
    assert expect_good != expect_bad
    async with Evaluator("CartPole-v1", SignPolicy(BAD), num_trajectories=3, seed=0, max_steps=60, metrics_fn=episodes) as ev:
        assert_metrics(await ev.evaluate(), *expect_bad)
        assert_metrics(await ev.evaluate(good), *expect_good)
        assert_metrics(await ev.evaluate(), *expect_bad)
        assert_metrics(await ev.evaluate(good.state_dict()), *expect_good)
        assert_metrics(await ev.evaluate(bad), *expect_bad)
        assert_metrics(await ev.evaluate(TensorDict.from_module(good)), *expect_good)


async def test_weights_are_copied_when_an_evaluation_is_triggered():
    """Training may change the parameters in place right after trigger(): the evaluation uses
    the weights of the moment it was triggered."""
    trained = SignPolicy(GOOD)
    async with Evaluator("CartPole-v1", SignPolicy(BAD), num_trajectories=2, seed=0, max_steps=40, metrics_fn=episodes) as ev:
        assert ev.trigger(trained, step=1)
        with torch.no_grad():
            trained.lin.weight.mul_(-1)  # now BAD
        result = await ev.wait()
    assert_metrics(result, *plain_loop(SignPolicy(GOOD), 2, seed=0, max_steps=40))


async def test_tensordict_module_policy_takes_its_own_or_its_inner_modules_weights():
    good = SignPolicy(GOOD)
    policy = TensorDictModule(SignPolicy(BAD), ["observation"], ["action"])
    expected = plain_loop(good, 2, seed=0, max_steps=30)
    async with Evaluator("CartPole-v1", policy, num_trajectories=2, seed=0, max_steps=30, metrics_fn=episodes) as ev:
        assert_metrics(await ev.evaluate(good), *expected)
        assert_metrics(await ev.evaluate(TensorDictModule(good, ["observation"], ["action"])), *expected)
        with pytest.raises(SpecError, match=r"do not fit.*missing.*unexpected"):
            await ev.evaluate({"nonsense": torch.zeros(3)})
        assert_metrics(await ev.evaluate(good), *expected), "a bad weight set does not break the evaluator"


async def test_weights_for_a_random_policy_or_of_a_wrong_type_are_refused_at_the_call():
    async with Evaluator("CartPole-v1", num_trajectories=1) as ev:
        with pytest.raises(ValueError, match="no policy"):
            await ev.evaluate(SignPolicy())
        with pytest.raises(ValueError, match="no policy"):
            ev.trigger(SignPolicy())
    async with Evaluator("CartPole-v1", SignPolicy(), num_trajectories=1) as ev:
        with pytest.raises(ConfigError, match=r"weights=\[1, 2\] is a list.*state_dict"):
            await ev.evaluate([1, 2])
        with pytest.raises(ConfigError, match=r"step='x'"):
            ev.trigger(step="x")
        assert ev.pending == 0


# ---- background evaluations -------------------------------------------------------------------------


async def test_trigger_poll_wait_and_pending():
    """trigger() schedules and returns at once; pending counts it until it completes; wait()
    returns its metrics; poll() gives each background result once."""
    async with Evaluator(slow(episode_length=5), AlwaysOne(), num_trajectories=2) as ev:
        assert ev.poll() is None and ev.pending == 0
        assert await ev.wait() is None
        assert ev.trigger(step=1) is True
        assert ev.pending == 1 and ev.poll() is None
        result = await ev.wait()
        assert result["step"] == 1 and result["episode_length_mean"] == 5
        assert ev.pending == 0 and ev.poll() is None, "wait() consumed it"
        assert ev.trigger(step=2)
        await ev.wait_for(EvaluationCompleted)
        assert ev.pending == 0
        assert ev.poll()["step"] == 2
        assert ev.poll() is None
        assert ev.completed == 2


async def test_busy_policy_skip_drops_and_error_raises_while_one_is_pending():
    """A handler of the evaluation that just completed may trigger the next one: it no longer
    counts as pending."""
    async with Evaluator(slow(episode_length=5), AlwaysOne(), num_trajectories=2) as ev:
        chained = []
        ev.on(EvaluationCompleted, lambda e: chained.append(ev.trigger(step=3)) if e.step == 1 else None)
        assert ev.trigger(step=1)
        assert ev.trigger(step=2) is False
        assert ev.pending == 1 and ev.skipped == 1
        assert (await ev.wait())["step"] == 3
        assert chained == [True] and ev.completed == 2
    async with Evaluator(slow(episode_length=5), AlwaysOne(), num_trajectories=2, busy_policy="error") as ev:
        assert ev.trigger(step=1)
        with pytest.raises(EvaluatorBusyError, match=r"busy_policy='error'.*wait\(\)") as info:
            ev.trigger(step=2)
        assert isinstance(info.value, AiocollectError)
        assert (await ev.wait())["step"] == 1
        assert ev.trigger(step=3), "accepted again once nothing is pending"
        await ev.wait()


async def test_busy_policy_queue_runs_every_trigger_in_order_up_to_max_queued_and_evaluate_waits_its_turn():
    async with Evaluator(slow(episode_length=3), AlwaysOne(), num_trajectories=1, busy_policy="queue", max_queued=2) as ev:
        with ev.subscribe(EvaluationCompleted) as sub:
            assert ev.trigger(step=1) and ev.trigger(step=2) and ev.trigger(step=3)
            assert ev.pending == 3
            with pytest.raises(EvaluatorBusyError, match=r"max_queued=2"):
                ev.trigger(step=4)
            assert (await ev.evaluate(step=5))["step"] == 5, "evaluate() is not bound by max_queued"
            assert [sub.receive_nowait().step for _ in range(4)] == [1, 2, 3, 5]
            assert (await ev.wait())["step"] == 5
        assert ev.completed == 4


async def test_start_trigger_wait_and_close_from_different_tasks_like_notebook_cells():
    """The evaluator's work belongs to its own task: each call may come from a task that ends."""
    ev = Evaluator("CartPole-v1", ArgmaxMLP(), num_trajectories=2, seed=0)
    results = {}

    async def cell(fn):
        async with anyio.create_task_group() as tg:
            tg.start_soon(fn)

    async def trigger():
        assert ev.trigger(step=1)

    await cell(ev.start)
    await cell(trigger)

    async def wait():
        results["wait"] = await ev.wait()

    await cell(wait)
    await cell(ev.aclose)
    assert results["wait"]["step"] == 1
    assert ev.state is EvaluatorState.CLOSED


# ---- events -----------------------------------------------------------------------------------------


async def test_results_arrive_as_events_subscriptions_and_on_result():
    """Each completed evaluation is an EvaluationCompleted event (handlers, subscriptions,
    wait_for) and an on_result call (sync or async), with the same metrics."""
    from_on_result = []

    async def on_result(metrics):
        await anyio.sleep(0)
        from_on_result.append(metrics)

    ev = Evaluator("CartPole-v1", ArgmaxMLP(), num_trajectories=2, seed=0, on_result=on_result)
    handled: list[EvaluationCompleted] = []
    handle = ev.on(EvaluationCompleted, handled.append)
    everything: list[Event] = []
    ev.on(Event, everything.append)
    async with ev:
        with ev.subscribe(EvaluationCompleted) as sub:
            ev.trigger(step=1)
            event = await ev.wait_for(EvaluationCompleted, lambda e: e.step == 1)
            direct = await ev.evaluate(step=2)
            handle.remove()
            await ev.evaluate(step=3)
            streamed = [sub.receive_nowait() for _ in range(3)]
    assert [e.step for e in handled] == [1, 2]
    assert [e.step for e in everything] == [1, 2, 3]
    assert [e.step for e in streamed] == [1, 2, 3]
    assert [m["step"] for m in from_on_result] == [1, 2, 3]
    assert event.metrics == from_on_result[0]
    assert streamed[1].metrics == direct == from_on_result[1]
    assert all(isinstance(e, EvaluationCompleted) for e in everything)


# ---- errors -----------------------------------------------------------------------------------------


async def test_env_or_policy_error_raises_from_evaluate_as_worker_error_and_emits_evaluation_failed():
    """An env's (or the policy's) exception reaches evaluate() as WorkerError (original as
    __cause__, worker traceback); EvaluationFailed carries it; the worker stays usable."""
    env = lambda: CountingEnv(fail_at_step=3)  # noqa: E731 - once: later steps carry on
    failed: list[EvaluationFailed] = []
    async with Evaluator(env, AlwaysOne(), num_trajectories=2) as ev:
        ev.on(EvaluationFailed, failed.append)
        pid = ev.worker_pid
        with pytest.raises(WorkerError) as info:
            await ev.evaluate(step=4)
        assert (await ev.evaluate())["num_trajectories"] == 2
        assert ev.worker_pid == pid and ev.failed == 1 and ev.completed == 1
    err = info.value
    assert isinstance(err.__cause__, InjectedFailure)
    assert "InjectedFailure" in err.worker_traceback and "InjectedFailure" in str(err)
    assert f"the evaluator's worker (pid {pid})" in str(err)
    assert [(e.step, e.error) for e in failed] == [(4, err)]

    async with Evaluator("CartPole-v1", FailingPolicy(fail_at=3), num_trajectories=2) as ev:
        with pytest.raises(WorkerError, match="policy failed at call 3") as info:
            await ev.evaluate()
    assert isinstance(info.value.__cause__, InjectedFailure)


async def test_policy_that_fails_at_start_raises_from_start_and_closes_the_evaluator():
    ev = Evaluator("CartPole-v1", FailingPolicy(fail_at=1), num_trajectories=2)
    with pytest.raises(WorkerError, match="policy failed at call 1"):
        async with ev:
            pass
    assert ev.state is EvaluatorState.CLOSED
    with pytest.raises(EvaluatorClosedError):
        await ev.evaluate()
    await ev.aclose()  # the error was raised once, by start()


async def test_env_factory_error_of_a_triggered_start_surfaces_from_wait():
    def env():
        raise InjectedFailure("no env today")

    ev = Evaluator(env, num_trajectories=1)
    assert ev.trigger()
    with anyio.fail_after(10), pytest.raises(WorkerError, match="no env today"):
        await ev.wait()
    with pytest.raises(EvaluatorClosedError):
        ev.trigger()
    await ev.aclose()


@pytest.mark.parametrize("surface", ["trigger", "poll", "wait", "aclose"])
async def test_background_failure_surfaces_from_the_next_call_once(surface):
    """A triggered evaluation that fails is raised by the next trigger(), poll(), wait() or
    aclose(), once; then nothing is raised again."""
    ev = Evaluator("CartPole-v1", FailingPolicy(fail_at=2), num_trajectories=1)
    await ev.start()
    try:
        assert ev.trigger(step=1)
        event = await ev.wait_for(EvaluationFailed)
        assert ev.pending == 0
        with pytest.raises(WorkerError, match="policy failed") as info:
            if surface == "trigger":
                ev.trigger(step=2)
            elif surface == "poll":
                ev.poll()
            elif surface == "wait":
                await ev.wait()
            else:
                await ev.aclose()
        assert info.value is event.error and event.step == 1
        assert ev.pending == 0, "a trigger that raised scheduled nothing"
        assert ev.poll() is None
    finally:
        await ev.aclose()


async def test_several_background_failures_raise_the_first_with_a_note_counting_the_others():
    async with Evaluator("CartPole-v1", FailingPolicy(fail_at=2), num_trajectories=1, busy_policy="queue") as ev:
        ev.trigger(step=1)
        ev.trigger(step=2)
        with pytest.raises(WorkerError) as info:
            await ev.wait()
        assert "1 more background evaluation(s) failed" in "".join(getattr(info.value, "__notes__", []))
        assert ev.failed == 2
        assert ev.poll() is None


async def test_metrics_fn_error_fails_the_evaluation():
    def broken(returns, lengths):
        raise ZeroDivisionError("metrics")

    failed = []
    async with Evaluator("CartPole-v1", num_trajectories=1, metrics_fn=broken) as ev:
        ev.on(EvaluationFailed, failed.append)
        with pytest.raises(ZeroDivisionError):
            await ev.evaluate()
        ev.trigger()
        with pytest.raises(ZeroDivisionError):
            await ev.wait()
    assert len(failed) == 2


async def test_handler_and_on_result_errors_surface():
    """An exception in an event handler or in on_result is raised by evaluate() for its own
    evaluation, and like a background failure for a triggered one."""
    ev = Evaluator("CartPole-v1", num_trajectories=1, on_result=lambda m: 1 / 0 if m["step"] == 2 else None)

    @ev.on(EvaluationCompleted)
    def handler(event):
        if event.step == 1:
            raise KeyError("handler")

    async with ev:
        with pytest.raises(KeyError, match="handler"):
            await ev.evaluate(step=1)
        ev.trigger(step=2)
        await ev.wait_for(EvaluationCompleted, lambda e: e.step == 2)
        with anyio.fail_after(5):
            while ev.pending:
                await anyio.sleep(0.01)
        with pytest.raises(ZeroDivisionError):
            ev.poll()
        assert (await ev.evaluate(step=3))["step"] == 3


async def test_worker_killed_during_an_evaluation_raises_broken_worker_error_at_once_and_next_one_restarts():
    async with Evaluator(slow(episode_length=20), AlwaysOne(), num_trajectories=2) as ev:
        pid = ev.worker_pid

        async def kill_soon():
            await anyio.sleep(0.1)
            os.kill(pid, signal.SIGKILL)

        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_soon)
            with anyio.fail_after(3), pytest.raises(BrokenWorkerError, match=f"pid {pid}") as info:
                await ev.evaluate(step=1)
        assert time.monotonic() - t0 < 2.0, "noticed by end-of-file, not a timeout"
        assert isinstance(info.value, WorkerError)
        assert (await ev.evaluate(step=2))["episode_length_mean"] == 20
        assert ev.worker_pid not in (None, pid)
    assert not _alive(pid)


async def test_worker_killed_between_evaluations_is_reported_at_once_and_a_new_worker_takes_over():
    failed = []
    async with Evaluator("CartPole-v1", ArgmaxMLP(), num_trajectories=2, seed=0, metrics_fn=episodes) as ev:
        ev.on(EvaluationFailed, failed.append)
        before = await ev.evaluate()
        pid = ev.worker_pid
        os.kill(pid, signal.SIGKILL)
        with anyio.fail_after(3):
            while True:
                try:
                    assert ev.poll() is None
                except BrokenWorkerError as exc:
                    assert f"pid {pid}" in str(exc)
                    break
                await anyio.sleep(0.005)
        assert ev.worker_pid is None
        after = await ev.evaluate()
        assert ev.worker_pid not in (None, pid)
    assert after["returns"] == before["returns"]
    assert failed == [], "no evaluation failed"


# ---- lifecycle --------------------------------------------------------------------------------------


async def test_aclose_with_an_evaluation_in_flight_leaves_no_process_and_fails_the_waiting_call():
    """aclose() while a triggered evaluation runs and an evaluate() call waits behind it: the
    worker stops between two steps, the waiting evaluate() raises EvaluatorClosedError, the
    background one is abandoned quietly (nothing to raise)."""
    ev = Evaluator(slow(), AlwaysOne(), num_trajectories=50, busy_policy="queue")
    await ev.start()
    pid = ev.worker_pid
    outcome = []

    async def evaluate():
        with pytest.raises(EvaluatorClosedError):
            await ev.evaluate()
        outcome.append("closed")

    async with anyio.create_task_group() as tg:
        assert ev.trigger(step=9)
        tg.start_soon(evaluate)
        await anyio.sleep(0.2)
        assert ev.pending == 2
        t0 = time.monotonic()
        await ev.aclose()
        assert time.monotonic() - t0 < 2.5, "the worker stops between steps: no shutdown_timeout (5 s)"
    assert outcome == ["closed"] and ev.pending == 0
    assert not _alive(pid)


async def test_worker_stuck_in_a_step_is_killed_after_shutdown_timeout():
    async with Evaluator(slow(step_sleep=30), AlwaysOne(), num_trajectories=1, shutdown_timeout=0.3) as ev:
        pid = ev.worker_pid
        ev.trigger()
        await anyio.sleep(0.1)
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 3
    assert not _alive(pid)


async def test_cancelling_evaluate_aborts_the_evaluation_and_the_evaluator_stays_usable():
    """A cancelled evaluate() stops its evaluation in the worker within milliseconds (no event
    for it); one cancelled while queued never runs."""
    events = []
    async with Evaluator(slow(), AlwaysOne(), num_trajectories=50) as ev:
        ev.on(Event, events.append)
        pid = ev.worker_pid
        with anyio.move_on_after(0.2):
            await ev.evaluate(step=1)  # 50 episodes x 99 steps x 10 ms: far from done
        with anyio.fail_after(2):  # the worker looks for an abort every 20 ms
            while ev.pending:
                await anyio.sleep(0.005)
        assert await ev.wait() is None and events == []
        assert ev.worker_pid == pid
    async with Evaluator(slow(episode_length=10), AlwaysOne(), num_trajectories=1, busy_policy="queue") as ev:
        assert ev.trigger(step=1)
        with anyio.move_on_after(0.03):
            await ev.evaluate(step=2)  # queued behind step 1
        assert ev.pending == 1
        assert (await ev.wait())["step"] == 1
        assert ev.completed == 1


def _niceness(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


async def test_lifecycle_states_idempotent_close_and_no_reopening():
    ev = Evaluator("CartPole-v1", num_trajectories=1, nice=3)
    assert ev.state is EvaluatorState.CREATED and ev.worker_pid is None
    async with ev:
        assert ev.state is EvaluatorState.RUNNING
        pid = ev.worker_pid
        assert _alive(pid) and pid in _workers.started_pids
        assert _niceness(pid) == min(_niceness(os.getpid()) + 3, 19), "nice= lowers the worker's priority"
        await ev.start()  # idempotent
        assert ev.worker_pid == pid
    assert ev.state is EvaluatorState.CLOSED and not _alive(pid)
    await ev.aclose()
    for call in (ev.start, ev.evaluate, ev.__aenter__):
        with pytest.raises(EvaluatorClosedError, match="closed"):
            await call()
    with pytest.raises(EvaluatorClosedError):
        ev.trigger()

    never = Evaluator("CartPole-v1", num_trajectories=1)
    await never.aclose()
    with pytest.raises(EvaluatorClosedError):
        await never.start()


async def test_subscriptions_end_and_wait_for_raises_when_the_evaluator_closes():
    ev = Evaluator("CartPole-v1", num_trajectories=1)
    await ev.start()
    sub = ev.subscribe(EvaluationCompleted)
    got = []

    async def waiter():
        with pytest.raises(EvaluatorClosedError, match="EvaluationCompleted"):
            await ev.wait_for(EvaluationCompleted)
        got.append("wait_for")

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.sleep(0.01)
        await ev.aclose()
    assert [e async for e in sub] == [] and got == ["wait_for"]


def test_trigger_outside_an_event_loop_says_it_needs_one():
    ev = Evaluator("CartPole-v1", num_trajectories=1)
    with pytest.raises(RuntimeError, match="running event loop"):
        ev.trigger()
    assert ev.state is EvaluatorState.CREATED


# ---- with a collector -------------------------------------------------------------------------------


async def test_evaluator_and_collector_run_in_the_same_event_loop():
    """Batches keep coming while evaluations run in the background, and each result is the one
    a plain loop gives for the weights evaluated."""
    policy = ArgmaxMLP(seed=3)
    expected = plain_loop(policy, 3, seed=0)
    results = []
    collector = Collector("CartPole-v1", policy, frames_per_batch=128, total_frames=128 * 8, num_workers=2, envs_per_worker=2, seed=0)
    evaluator = Evaluator("CartPole-v1", policy, num_trajectories=3, seed=0, metrics_fn=episodes, on_result=results.append)
    async with collector, evaluator:
        batches = 0
        async for batch in collector:
            assert batch.batch_size == (4, 32)
            batches += 1
            evaluator.trigger(policy, step=batches)
        last = await evaluator.wait()
    assert batches == 8 and results and last == results[-1]
    assert [r["step"] for r in results] == sorted(r["step"] for r in results)
    for r in results:
        assert_metrics(r, *expected)


# ---- the example ------------------------------------------------------------------------------------


def test_example_runs_and_prints_evaluation_results():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "evaluator.py"), "--batches", "6", "--eval-every", "2",
         "--trajectories", "3", "--frames-per-batch", "256", "--workers", "1", "--envs-per-worker", "2",
         "--busy-policy", "queue"],  # every trigger evaluated, however slow the machine
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("eval")]
    assert [line.split(":")[0] for line in lines] == [f"eval  batch    {b}" for b in (2, 4, 6)], proc.stdout
    assert "return_mean" in proc.stdout and "final evaluation (batch 6)" in proc.stdout


# ---- the layout of the code -------------------------------------------------------------------------


def test_wire_messages_are_frozen_and_survive_the_socket():
    """The evaluator's messages are frozen dataclasses that round-trip through the wire's pickle;
    the hello and the fatal error are the rollout wire's (every child process sends them)."""
    import dataclasses
    import pickle

    from aiocollect._core import eval_wire as w
    from aiocollect._core import wire as _wire

    messages = [
        w.Configure(b"cfg"), w.Ready(), w.Evaluate(1, ("state_dict", {"w": 1.0}), 3), w.Abort(1),
        w.Result(1, [1.0, 2.0], [1, 2]), w.Aborted(1), w.Failed(1, b"exc", "tb"), w.Hello(7),
    ]
    for msg in messages:
        assert list(_wire.FrameReader().feed(_wire.encode(msg))) == [msg]
        assert pickle.loads(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)) == msg
        for field in dataclasses.fields(msg):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(msg, field.name, None)
        assert not w.is_fatal(msg)
    assert w.is_fatal(w.Error(b"exc", "tb")) and w.Error is _wire.Error and w.Hello is _wire.Hello


def test_the_evaluator_imports_no_rollout_code():
    """Importing the evaluator (parent side) or its worker's module loads none of the collector's code
    (its worker loads the stepping loop once configured: the evaluator imports fast)."""
    code = (
        "import sys, aiocollect._evaluator.evaluator, aiocollect._worker.eval_main\n"
        "print(sorted(m for m in ('aiocollect._worker.rollout', 'aiocollect._backends.workers', 'aiocollect._worker.main', "
        "'aiocollect._worker.vector', 'aiocollect._collector.run') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
