"""A policy built for other observations than the env's: its first call's shape error becomes a
:class:`SpecError` that names the policy's input key, the observation shape the env gives and,
where a layer says it, what the policy expects, with the fix; torch's own error is its
``__cause__``. Worker inference (in the collector's process and in worker processes) and server
inference; and the cases where nothing can be said about the expected size, or the error is not
about shapes at all."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict.nn import TensorDictModule, TensorDictSequential

from aiocollect import Collector, SpecError, WorkerError
from aiocollect._core.layout import action_leaves, observation_leaves
from aiocollect._worker.policy import build_runner, describe


class Mlp(torch.nn.Module):
    """CartPole's policy shape, for observations of ``n`` features."""

    def __init__(self, n: int = 8) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(n, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


class Fails(torch.nn.Module):
    """Raises an error that is not about shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the policy's own failure")


async def _start_error(**kwargs) -> BaseException:
    c = Collector("CartPole-v1", frames_per_batch=16, total_frames=32, envs_per_worker=2, **kwargs)
    try:
        with anyio.fail_after(60):
            await c.start()
            await c.collect()
    except Exception as exc:  # noqa: BLE001
        return exc
    finally:
        await c.aclose()
    raise AssertionError("the collector started and collected with a policy that does not fit its env")


SETUPS = [
    pytest.param(dict(num_workers=0), id="local"),
    pytest.param(dict(num_workers=2), id="worker-processes"),
    pytest.param(dict(num_workers=2, inference="server"), id="server"),
]


@pytest.mark.parametrize("setup", SETUPS)
async def test_a_policy_for_another_observation_size_gets_a_spec_error_naming_both_sizes(setup):
    """``Linear(8, 16)`` first, CartPole's 4 features: a SpecError (not torch's "mat1 and mat2
    shapes cannot be multiplied") naming the input key, the observation's shape (4,), the layer
    and its 8 input features, and the fix (in_features=4); torch's error is the cause."""
    err = await _start_error(policy=Mlp(8), **setup)
    assert type(err) is SpecError, repr(err)
    msg = str(err)
    assert "'observation'" in msg and "(4,)" in msg, msg
    assert "'net.0'" in msg and "expects 8 input features" in msg, msg
    assert "in_features=4" in msg, msg
    assert isinstance(err.__cause__, RuntimeError) and "mat1 and mat2" in str(err.__cause__), repr(err.__cause__)


@pytest.mark.parametrize("setup", SETUPS[1:])
async def test_an_error_not_about_shapes_is_left_as_it_is(setup):
    """A policy that raises something else on its first call: its own error, as before (wrapped
    in WorkerError from a worker process; itself from the server), never a SpecError."""
    err = await _start_error(policy=Fails(), **setup)
    assert not isinstance(err, SpecError), repr(err)
    cause = err.__cause__ if isinstance(err, WorkerError) else err
    assert type(cause) is RuntimeError and "the policy's own failure" in str(cause), repr(err)


def _probe_error(policy, obs_space: spaces.Space) -> BaseException:
    """The error of the first call of ``policy``'s runner (as a worker makes it) on zeros."""
    act = spaces.Discrete(2)
    leaves = observation_leaves(obs_space)
    runner = build_runner(describe(policy, None, "random"), act, action_leaves(act), leaves, 2, [act, act])
    with pytest.raises(Exception) as info:
        runner.probe([np.zeros((2,) + leaf.shape, leaf.np_dtype) for leaf in leaves])
    return info.value


def _box(*shape: int) -> spaces.Box:
    return spaces.Box(-1, 1, shape, np.float32)


class Hidden(torch.nn.Module):
    """Built for 4 features, but its second layer does not fit its first one."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(8, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation).argmax(-1)


class Raw(torch.nn.Module):
    """A matrix product of its own: no layer says what it expects."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(8, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (observation @ self.weight).argmax(-1)


class Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 8, 3)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (self.conv(observation).flatten(1)[:, 0] > 0).long()


def test_the_layer_that_raised_is_named_even_inside_the_policy():
    """A mismatch between two of the policy's own layers names the layer that raised (with its 8
    input features) and the first layer (which takes the env's 4): nothing blamed on the wrong one."""
    err = _probe_error(Hidden(), _box(4))
    assert type(err) is SpecError, repr(err)
    msg = str(err)
    assert "the layer that raised, 'net.2'" in msg and "expects 8" in msg, msg
    assert "first layer is 'net.0' = Linear(in_features=4" in msg, msg


def test_without_a_layer_no_expected_size_is_guessed():
    """A shape error with no layer to read an expected size from: the key and the observation
    shape, and no "expects"."""
    err = _probe_error(Raw(), _box(4))
    assert type(err) is SpecError, repr(err)
    msg = str(err)
    assert "'observation'" in msg and "(4,)" in msg and "mat1 and mat2" in msg, msg
    assert "expects" not in msg, msg
    assert isinstance(err.__cause__, RuntimeError)


def test_a_conv_policy_on_channels_last_images_is_told_to_permute_them():
    """Conv2d(4 channels) on (84, 84, 4) observations: the channels it expects and the hint that
    the observation looks channels-last."""
    err = _probe_error(Conv(), _box(84, 84, 4))
    assert type(err) is SpecError, repr(err)
    msg = str(err)
    assert "'conv'" in msg and "expects 4 channels" in msg and "(84, 84, 4)" in msg, msg
    assert "channels-last" in msg, msg


def test_a_tensordict_policy_names_its_layer_by_its_path():
    """A TensorDictSequential whose first module is a Linear(8, 2) reading 'observation'."""
    policy = TensorDictSequential(
        TensorDictModule(torch.nn.Linear(8, 2), in_keys=["observation"], out_keys=["logits"]),
        TensorDictModule(lambda logits: logits.argmax(-1), in_keys=["logits"], out_keys=["action"]),
    )
    err = _probe_error(policy, _box(4))
    assert type(err) is SpecError, repr(err)
    msg = str(err)
    assert "'observation'" in msg and "(4,)" in msg and "expects 8 input features" in msg, msg
    assert "in_features=4" in msg, msg
