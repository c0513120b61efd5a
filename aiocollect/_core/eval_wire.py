"""The evaluator's wire: the messages between the evaluator (:mod:`aiocollect._evaluator.run`,
through :class:`aiocollect._backends.eval_process.EvalProcess`) and its worker process
(:mod:`aiocollect._worker.eval_main`), as frozen dataclasses.

They travel over one Unix socket as small pickled frames (:mod:`aiocollect._core.wire`); weights ride
in the :class:`Evaluate` message as a CPU state dict. Protocol (``P`` parent, ``W`` worker)::

    W: Hello(pid)                        the handshake every child process starts with
    P: Configure(cloudpickle(EvalWorkerConfig))  + fd, with a step_timeout: the heartbeat's memfd
    W: Ready()                           or Error(exception, traceback): it then exits
    P: Evaluate(id, weights, episodes, step)  weights: None or (kind, {name: tensor})
    W: Result(id, returns, lengths, video)  or Failed(id, exception, traceback)
    P: Abort(id)                         the caller gave up: W answers Aborted(id)
    P: EnvCall(id, kind, name, payload, rows, epoch)   between evaluations (Evaluator.call,
                                         set_attr ...): W answers EnvCallDone(id, result, error)
    W: Error(exception, traceback)       at any time: a fatal error, the worker exits
    P: end-of-file (shutdown(SHUT_WR))   close the envs and exit

:class:`~aiocollect._core.wire.Hello` and :class:`~aiocollect._core.wire.Error` are the rollout wire's
(every child process, and the launcher for a failed fork, sends them; re-exported here):
:class:`aiocollect._backends.child.ChildProcess` reads them. An :class:`Abort` that arrives after its
evaluation finished is ignored. A :class:`Failed` evaluation leaves the worker usable; an
:class:`~aiocollect._core.wire.Error` ends it. ``EnvCall`` and ``EnvCallDone`` are the rollout
wire's too (:mod:`aiocollect._core.wire`).

Imported by worker processes: standard library only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Union

from .wire import Error, Hello

if TYPE_CHECKING:  # pragma: no cover
    from .datachecks import ActionBounds


@dataclasses.dataclass(frozen=True)
class EvalWorkerConfig:
    """What the worker needs (sent once, with cloudpickle, in :class:`Configure`)."""

    env_fn: Any  # a gymnasium id or a callable returning a gymnasium.Env
    env_kwargs: dict
    policy_mode: str  # "random", "object" (payload is the policy) or "factory" (payload builds it)
    policy_payload: Any
    exploration_type: str
    num_envs: int
    max_steps: int | None
    seed: int | None
    nice: int = 0
    cpus: tuple[int, ...] | None = None  # the CPUs the worker runs on (None: the kernel's choice)
    registry: tuple = ()  # _registry.snapshot() of the evaluator's process, installed before the envs are made
    check_finite: bool = False
    action_bounds: ActionBounds = "pass"
    one_hot_actions: bool = False  # categorical_action_encoding=False: the policy writes a Discrete action one-hot
    recurrent_state: tuple = ()  # recurrent_state's leaves: the state a recurrent TensorDict policy carries
    record_video: bool = False  # the frames of each evaluation's first episode (render())
    video_dir: str | None = None  # written there as <video_prefix>_<step or id>.mp4; None: the frames are sent
    video_fps: int = 30
    video_max_frames: int | None = None
    video_prefix: str = "eval"


# -- parent to worker ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Configure:
    """The worker's settings, once, after its hello."""

    config: bytes  # cloudpickle(EvalWorkerConfig): env factories and policies may be lambdas


@dataclasses.dataclass(frozen=True, slots=True)
class Evaluate:
    """Run ``episodes`` episodes with ``weights`` (``None``: the weights the policy was built with)."""

    id: int
    weights: tuple[str, dict] | None  # (kind, {name: tensor}): kind "state_dict" or "params"
    episodes: int
    step: int | None = None  # the caller's step (names the video file)


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """Stop evaluation ``id`` between two steps (its caller gave up)."""

    id: int


# -- worker to parent ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Ready:
    """The envs are made and the policy fits them: evaluations may come."""


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    """Evaluation ``id`` completed: one return and one length per episode, in episode order."""

    id: int
    returns: list[float]
    lengths: list[int]
    video: Any = None  # record_video: the first episode's file path, or its frames (uint8 [T, H, W, 3])


@dataclasses.dataclass(frozen=True, slots=True)
class Aborted:
    """Evaluation ``id`` was stopped by an :class:`Abort`."""

    id: int


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    """Evaluation ``id`` raised (the env, the policy, the weights): the worker stays usable."""

    id: int
    exception: bytes  # aiocollect._worker.peer.pack_exception(exc), as in Error
    traceback: str


#: An answer to an :class:`Evaluate` (or the fatal error).
Answer = Union[Result, Aborted, Failed, Error]


def is_fatal(msg: Any) -> bool:
    """``msg`` is the fatal :class:`~aiocollect._core.wire.Error` of a worker that exits."""
    return isinstance(msg, Error)


__all__ = [
    "Abort",
    "Aborted",
    "Answer",
    "Configure",
    "Error",
    "EvalWorkerConfig",
    "Evaluate",
    "Failed",
    "Hello",
    "Ready",
    "Result",
    "is_fatal",
]
