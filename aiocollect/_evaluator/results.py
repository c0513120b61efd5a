"""The results of evaluations: a :class:`Request` (an evaluation queued, running or done), its
metrics (:func:`compute_metrics`, or under TorchRL's names :func:`torchrl_metrics`) and how a
result or a failure is reported: its event, ``on_result``, and the caller waiting for it.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import TYPE_CHECKING, Any, Callable, Mapping

import anyio
import numpy as np

from .._core.errors import ConfigTypeError
from ..events import EvaluationCompleted, EvaluationFailed

if TYPE_CHECKING:
    from .._core.eval_wire import Result
    from .._service.bus import EventBus
    from .config import EvaluatorConfig


@dataclasses.dataclass(eq=False)
class Request:
    id: int
    step: int | None
    weights: Any
    background: bool
    done: anyio.Event
    result: dict | None = None
    error: BaseException | None = None
    abandoned: bool = False  # the evaluate() call waiting for it was cancelled
    sent: bool = False  # the whole request reached the worker's socket


async def compute_metrics(
    returns: list[float], lengths: list[int], metrics_fn: Callable | None, step: int | None, seconds: float,
    log_prefix: str | None = None,
) -> dict:
    """The metrics of one evaluation (see :class:`~aiocollect.Evaluator`), or with ``log_prefix``
    under TorchRL's Evaluator's names (:func:`torchrl_metrics`); raises what ``metrics_fn``
    raises, and :class:`TypeError` if it returns no mapping."""
    r = np.asarray(returns, dtype=np.float64)
    n = np.asarray(lengths, dtype=np.int64)
    metrics: dict[str, Any] = {
        "return_mean": float(r.mean()),
        "return_std": float(r.std()),
        "return_min": float(r.min()),
        "return_max": float(r.max()),
        "episode_length_mean": float(n.mean()),
    }
    if metrics_fn is not None:
        extra = metrics_fn(r.copy(), n.copy())
        if inspect.isawaitable(extra):
            extra = await extra
        if not isinstance(extra, Mapping):
            raise ConfigTypeError(
                f"metrics_fn returned {type(extra).__name__}; it must return a mapping of metric names to values"
            )
        metrics.update(extra)
    metrics.update(step=step, num_trajectories=len(r), seconds=seconds)
    if log_prefix is not None:
        return torchrl_metrics(metrics, r, n, extra if metrics_fn is not None else {}, log_prefix)
    return metrics


def torchrl_metrics(ours: dict, returns: np.ndarray, lengths: np.ndarray, extra: Mapping, prefix: str) -> dict:
    """The metrics under TorchRL 0.14's ``Evaluator`` names: ``<prefix>/reward`` (the mean
    return), ``<prefix>/reward_std`` (sample standard deviation, ``ddof=1``; 0.0 for one episode,
    as TorchRL's), ``<prefix>/num_episodes``, ``<prefix>/episode_length`` (mean),
    ``<prefix>/fps`` (frames per second of the evaluation), ``<prefix>/step``, and each of
    ``metrics_fn``'s items as ``<prefix>/<name>``."""
    seconds = ours["seconds"]
    out: dict[str, Any] = {
        f"{prefix}/reward": ours["return_mean"],
        f"{prefix}/reward_std": float(returns.std(ddof=1)) if len(returns) > 1 else 0.0,
        f"{prefix}/num_episodes": len(returns),
        f"{prefix}/episode_length": ours["episode_length_mean"],
    }
    if seconds > 0:
        out[f"{prefix}/fps"] = float(lengths.sum()) / seconds
    out[f"{prefix}/step"] = ours["step"]
    for name, value in extra.items():
        out[f"{prefix}/{name}"] = value
    return out


async def result_metrics(msg: "Result", config: "EvaluatorConfig", step: int | None, seconds: float) -> dict:
    """The metrics of the worker's ``msg`` (:func:`compute_metrics`), with its video if any."""
    metrics = await compute_metrics(msg.returns, msg.lengths, config.metrics_fn, step, seconds, config.log_prefix)
    if msg.video is not None:  # record_video: a file's path, or the frames
        metrics["video" if config.log_prefix is None else f"{config.log_prefix}/video"] = msg.video
    return metrics


async def report_success(
    req: Request, metrics: dict, bus: "EventBus", on_result: Callable | None, add_error: Callable[[BaseException], None],
) -> None:
    """``req`` has ``metrics``: emit :class:`~aiocollect.events.EvaluationCompleted`, call
    ``on_result`` and wake its caller. A handler's error goes to the caller waiting for it, or,
    for a background evaluation or one whose caller is gone, to ``add_error``: never dropped."""
    req.result = metrics
    try:
        await bus.emit(EvaluationCompleted(step=req.step, metrics=dict(metrics)))
        if on_result is not None:
            result = on_result(dict(metrics))
            if inspect.isawaitable(result):
                await result
    except Exception as exc:  # noqa: BLE001 - a handler's error: surfaced, never dropped
        if req.background or req.abandoned:
            add_error(exc)
        else:
            req.error = exc
    req.done.set()


async def report_failure(
    req: Request, exc: BaseException, bus: "EventBus", add_error: Callable[[BaseException], None],
) -> None:
    """``req`` failed with ``exc``: emit :class:`~aiocollect.events.EvaluationFailed` and wake
    its caller with the error (a handler's, with ``exc`` as its context, if one raised); a
    background evaluation's goes to ``add_error``, as does a handler's whose caller is gone."""
    handler_error = None
    try:
        await bus.emit(EvaluationFailed(step=req.step, error=exc))
    except Exception as handler_exc:  # noqa: BLE001 - surfaced, with the evaluation's error as context
        handler_exc.__context__ = exc
        handler_error = handler_exc
    error = handler_error or exc
    if req.background:
        add_error(error)
    elif not req.abandoned:
        req.error = error
    elif handler_error is not None:  # its caller gave up on the evaluation, not on the handler
        add_error(handler_error)
    req.done.set()


__all__ = ["Request", "compute_metrics", "report_failure", "report_success", "result_metrics", "torchrl_metrics"]
