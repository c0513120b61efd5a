"""aiocollect: asyncio-first reinforcement-learning experience collection.

Env workers run in a pool of processes, the policy runs batched, and batches (TensorDicts in
TorchRL's layout) leave through ``async for batch in collector`` and ``await collector.collect()``.

The public names are loaded lazily: worker processes import this package too, and must not pay
for torch or tensordict unless their policy needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Collector": "._collector",
    "CollectorConfig": "._config",
    "CollectorState": "._run",
    "State": "._run",
    "WorkerTimeoutError": "._errors",
    "AiocollectError": "._errors",
    "ConfigError": "._errors",
    "SpecError": "._errors",
    "WorkerError": "._errors",
    "BrokenWorkerError": "._errors",
    "CollectorClosedError": "._errors",
    "EndOfCollection": "._errors",
    "split_trajectories": "._split",
    "shutdown_launcher": "._launcher",
    "CollectorStats": "._stats",
    "SubscriptionOverflowError": "._errors",
    "Subscription": "._bus",
    "ProfileConfig": "._profiling",
    "ReplayBuffer": "._replay",
    "Sampler": "._samplers",
    "UniformSampler": "._samplers",
    "StalenessAwareSampler": "._samplers",
    "SliceSampler": "._samplers",
    "SamplingError": "._errors",
    "Evaluator": "._evaluator",
    "EvaluatorConfig": "._eval_config",
    "EvaluatorState": "._eval_config",
    "EvaluatorBusyError": "._errors",
    "EvaluatorClosedError": "._errors",
}

__all__ = sorted(_EXPORTS) + ["__version__", "events", "testing"]

if TYPE_CHECKING:  # pragma: no cover
    from ._collector import Collector as Collector
    from ._bus import Subscription as Subscription
    from ._run import CollectorState as CollectorState
    from ._run import State as State
    from ._stats import CollectorStats as CollectorStats
    from ._config import CollectorConfig as CollectorConfig
    from ._errors import AiocollectError as AiocollectError
    from ._errors import BrokenWorkerError as BrokenWorkerError
    from ._errors import CollectorClosedError as CollectorClosedError
    from ._errors import ConfigError as ConfigError
    from ._errors import EndOfCollection as EndOfCollection
    from ._errors import SamplingError as SamplingError
    from ._errors import SpecError as SpecError
    from ._errors import SubscriptionOverflowError as SubscriptionOverflowError
    from ._errors import WorkerError as WorkerError
    from ._errors import WorkerTimeoutError as WorkerTimeoutError
    from ._launcher import shutdown_launcher as shutdown_launcher
    from ._evaluator import Evaluator as Evaluator
    from ._errors import EvaluatorBusyError as EvaluatorBusyError
    from ._errors import EvaluatorClosedError as EvaluatorClosedError
    from ._eval_config import EvaluatorConfig as EvaluatorConfig
    from ._eval_config import EvaluatorState as EvaluatorState
    from ._profiling import ProfileConfig as ProfileConfig
    from ._replay import ReplayBuffer as ReplayBuffer
    from ._samplers import Sampler as Sampler
    from ._samplers import SliceSampler as SliceSampler
    from ._samplers import StalenessAwareSampler as StalenessAwareSampler
    from ._samplers import UniformSampler as UniformSampler
    from ._split import split_trajectories as split_trajectories


def __getattr__(name: str) -> Any:
    if name in ("events", "testing"):
        return importlib.import_module(f".{name}", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aiocollect' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
