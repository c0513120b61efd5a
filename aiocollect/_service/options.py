"""Validators that the collector's and the evaluator's options share: each raises
:class:`~aiocollect.ConfigError` naming the argument, the value and the fix."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import inspect
import math
import numbers
from typing import Any, Callable, Concatenate, Mapping, ParamSpec, Sequence, TypeVar, cast

from .._core.datachecks import ACTION_BOUNDS
from .._core.errors import ConfigError, ConfigTypeError
from .._core.limits import max_worker_processes
from .._worker.policy import EXPLORATION_TYPES


RAY_PLACES_ACTORS = (
    "with backend='ray' Ray places the actors: use ray_actor_options (num_cpus, a placement group's "
    "scheduling_strategy) instead"
)
"""The fix for an option that places processes on this machine's CPUs, given with Ray."""


def format_size(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def exploration_name(value: Any) -> str:
    name = getattr(value, "value", value)  # tensordict's InteractionType / TorchRL's ExplorationType
    if not isinstance(name, str) or name.lower() not in EXPLORATION_TYPES:
        raise ConfigError(
            f"exploration_type={value!r} is not one of {list(EXPLORATION_TYPES)}; pass a string or "
            f"tensordict.nn.InteractionType (e.g. InteractionType.DETERMINISTIC)"
        )
    return name.lower()


def check_env_id(env_id: str, argument: str = "create_env_fn") -> None:
    """Raise :class:`ConfigError` (with close matches) if ``env_id`` is not a registered id."""
    import gymnasium as gym

    if ":" in env_id:
        check_module_env_id(env_id, argument)
        return
    if env_id in gym.registry:
        return
    close = difflib.get_close_matches(env_id, list(gym.registry), n=3)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else (
        "; register it with gymnasium.register, or use 'module:EnvId' so that the module is imported first"
    )
    raise ConfigError(f"{argument}={env_id!r} is not a registered gymnasium env id{hint}")


def env_factory_fix(value: Any) -> str:
    """The way out for an env argument that is neither an id nor a callable: an env made already
    (``gymnasium.make(...)``) is refused because each worker makes its own, so this names its id."""
    if hasattr(value, "step") and hasattr(value, "reset"):
        env_id = getattr(getattr(value, "spec", None), "id", None)
        example = f"{env_id!r} or lambda: gymnasium.make({env_id!r})" if env_id else f"lambda: {type(value).__name__}(...)"
        return f"that is an env made already, and each worker makes its own: pass its id or a factory, e.g. {example}"
    return "pass e.g. 'CartPole-v1' or lambda: gymnasium.make('CartPole-v1')"


def check_data_options(check_finite: Any, action_bounds: Any) -> None:
    """Validate the two data-check options (shared by the collector's and the evaluator's config)."""
    check_bool("check_finite", check_finite)
    check_choice(
        "action_bounds", action_bounds, ACTION_BOUNDS,
        "'pass' (the env gets the policy's action as it is), 'clip' (the env gets it clipped to the Box's "
        "bounds) or 'error' (SpecError)",
    )


def _refuse(name: str, value: Any, must: str, fix: str = "", who: str = "") -> ConfigError:
    """The error for ``value`` of the argument ``name``: ``name=value must be ...; fix``, or, for a
    class's argument (``who``), ``who: name must be ..., got value; fix``."""
    said = f"{who}: {name} must be {must}, got {value!r}" if who else f"{name}={value!r} must be {must}"
    return ConfigError(said + (f"; {fix}" if fix else ""))


def check_bool(name: str, value: Any, *, fix: str = "", who: str = "") -> bool:
    """``value``, a bool, or :class:`ConfigError` naming ``name`` (a truthy 1 or ``"yes"`` is
    refused: it is most often a value meant for another option)."""
    if not isinstance(value, bool):
        raise _refuse(name, value, "True or False", fix or f"pass {name}=True or {name}=False", who)
    return value


def check_int(name: str, value: Any, low: int, high: int | None = None, *, fix: str = "", who: str = "") -> int:
    """``value``, an int from ``low`` (to ``high`` where given; never a bool), or :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        whole = as_whole_number(value)
        if not fix and whole is not None and whole >= low and (high is None or whole <= high):
            fix = f"pass {name}={whole} (a Python int, not {type(value).__name__})"
        raise _refuse(name, value, f"an int >= {low}" if high is None else f"an int from {low} to {high}", fix, who)
    return value


def as_whole_number(value: Any) -> int | None:
    """The int that ``value`` spells, where it is a float with no fraction (``1e6``, ``64.0``: a
    config file's or a computation's number) or a str of digits (``"64"``: read from the command
    line), else ``None``: for a message's fix, never to accept it silently."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):  # numpy's int64 ...
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("+-").isdecimal() and value.isascii():
        return int(value)
    return None


def positive_int(name: str, value: Any, *, allow_zero: bool = False, fix: str = "", who: str = "") -> int:
    """``value``, an int >= 1 (>= 0 with ``allow_zero``; never a bool), or :class:`ConfigError`
    naming ``name`` (and ``fix``, the way out, when given). The collector's and the evaluator's
    config both use it."""
    return check_int(name, value, 0 if allow_zero else 1, fix=fix, who=who)


def positive_seconds(name: str, value: Any, alternative: str = "", *, allow_zero: bool = False) -> float:
    """``value``, a finite number of seconds > 0 (>= 0 with ``allow_zero``), or :class:`ConfigError`;
    ``alternative`` follows the rule (e.g. ``"or None to wait for ever"``)."""
    number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    if not number or value < 0 or (value == 0 and not allow_zero):
        must = "a finite number of seconds >= 0" if allow_zero else "a positive, finite number of seconds"
        raise ConfigError(f"{name}={value!r} must be {must}" + (f", {alternative}" if alternative else ""))
    return value


def check_choice(name: str, value: Any, choices: Sequence[Any], described: str = "") -> Any:
    """``value``, one of ``choices`` (compared only when it is a str, or None where None is a
    choice: a numpy array compared with ``in`` would raise numpy's ambiguous-truth ValueError), or
    :class:`ConfigError` listing them (``described``: the list in words) with the closest one."""
    if (isinstance(value, str) or value is None) and value in choices:
        return value
    words = [repr(c) for c in choices]
    must = described or (words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}")
    words_only = [c for c in choices if isinstance(c, str)]
    close = [c for c in words_only if isinstance(value, str) and c.lower() == value.strip().lower()]  # 'SYNC', ' sync'
    close = close or (difflib.get_close_matches(value, words_only, n=1) if isinstance(value, str) else [])
    raise ConfigError(f"{name}={value!r} must be {must}" + (f"; did you mean {close[0]!r}?" if close else ""))


def multiples_around(value: int, step: int) -> tuple[int, int]:
    """The multiples of ``step`` next to ``value``: ``(lower, upper)``, both ``value`` when it is one."""
    lower = value // step * step
    return lower, (lower if lower == value else lower + step)


def _same(value: Any, allowed: Any) -> bool:
    """``value`` is ``allowed``: the same object, or a str or number equal to it (a bool only to a bool)."""
    if value is allowed:
        return True
    if isinstance(value, bool) or isinstance(allowed, bool):
        return False
    plain = (int, float, str)
    return isinstance(value, plain) and isinstance(allowed, plain) and value == allowed


@dataclasses.dataclass(frozen=True)
class Needs:
    """One row of a config's table of options that mean something only under another setting:
    ``option``, set to anything but ``default``, needs ``setting`` (an attribute of the config,
    shown to the user as ``label``) to be one of ``allowed`` (``None``: given, anything but
    None). ``does``: what the option does (why it needs that setting); ``fix``: the way out, or a
    dict of it by the setting's value (its ``None`` entry for any value it does not name: a
    backend object's name, say)."""

    option: str
    default: Any
    setting: str
    allowed: tuple[Any, ...] | None
    does: str
    fix: str | Mapping[Any, str]
    label: str = ""

    def is_set(self, value: Any) -> bool:
        """``value`` is not the default (a number or str compared by value, anything else by identity)."""
        return not _same(value, self.default)

    def holds(self, config: Any) -> bool:
        """The config has the setting that ``option`` needs (or ``option`` is not set)."""
        actual = getattr(config, self.setting)
        # (by identity or a plain value's equality: a setting not checked yet may be an array)
        ok = actual is not None if self.allowed is None else any(_same(actual, a) for a in self.allowed)
        return ok or not self.is_set(getattr(config, self.option))

    def check(self, config: Any) -> None:
        if self.holds(config):
            return
        value, actual, label = getattr(config, self.option), getattr(config, self.setting), self.label or self.setting
        need = f"{label} (not None)" if self.allowed is None else " or ".join(f"{label}={a!r}" for a in self.allowed)
        fix = self.fix if isinstance(self.fix, str) else self.fix.get(actual, self.fix.get(None, ""))
        raise ConfigError(f"{self.option}={value!r:.200} {self.does}, so it needs {need}, but {label}={actual!r}"
                          + (f"; {fix}" if fix else ""))


_RESTART = "on_worker_failure", ("restart",)
_NO_RESTARTS = "with 'raise' the first failure ends the run: pass on_worker_failure='restart' too, or drop it"

RESTART_OPTIONS = (
    Needs("max_restarts", 3, *_RESTART, "bounds the replacements of failed workers", _NO_RESTARTS),
    Needs("restart_window", 60.0, *_RESTART, "is the time over which max_restarts counts", _NO_RESTARTS),
)
"""The rows of the collector's and the evaluator's tables for the options of restarts."""

POLICY_STATE = Needs(
    "recurrent_state", None, "policy_or_factory", None, "is the state a recurrent policy carries from step to step",
    "pass the recurrent TensorDict policy (policy= or policy_factory=), or drop recurrent_state (random actions "
    "carry no state)", label="policy",
)
"""The row of ``recurrent_state``, which needs a policy (``policy_or_factory``: either one given)."""


def known_keywords(config_class: type, synonyms: Mapping[str, str]) -> Callable[[Callable], Callable]:
    """Wraps a class's ``__init__`` so that a keyword it does not take (a misspelt option, another
    library's name) is a :class:`ConfigTypeError` (still a ``TypeError``, as Python's) that names
    it, its value and the option meant: the closest of the class's own, or ``synonyms``'s entry
    (another name -> how to say it here). ``config_class``: the dataclass that lists every option."""

    def wrap(init: Callable) -> Callable:
        parameters = [p for p in inspect.signature(init).parameters.values() if p.name != "self"]
        names = [p.name for p in parameters]
        positional = [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if len(args) > len(positional):
                raise too_many_positional(type(self).__name__, args, positional, names, config_class)
            for key, value in kwargs.items():
                if key not in names:
                    raise unknown_keyword(type(self).__name__, key, value, names, synonyms, config_class)
            init(self, *args, **kwargs)

        return __init__

    return wrap


OPTIONS_PAGE = "docs/options.md"
"""The options reference (generated from the configs' field docs by ``scripts/options_page.py``)."""



P = ParamSpec("P")
S = TypeVar("S")


def takes_options(
    config: Callable[P, Any], synonyms: Mapping[str, str]
) -> Callable[[Callable[Concatenate[S, ...], None]], Callable[Concatenate[S, P], None]]:
    """Makes a front's ``__init__(self, *args, **options)``, which passes both on to ``config``
    (a dataclass of options), take exactly ``config``'s options, written once, in ``config``,
    with their types, defaults and docs: to mypy and IDEs the wrapped ``__init__`` has
    ``config``'s parameters (a ``ParamSpec``, so a call is checked and completed option by
    option), ``inspect.signature`` and ``help()`` show them (``__signature__``), and an unknown
    keyword or an extra positional argument raises :class:`ConfigTypeError` naming the option
    meant (:func:`~aiocollect._service.options.known_keywords`, with ``synonyms``: another
    library's name -> how to say it here).

    Examples:
        >>> class Evaluator:  # doctest: +SKIP
        ...     @takes_options(EvaluatorConfig, {"num_episodes": "use num_trajectories="})
        ...     def __init__(self, *args: Any, **options: Any) -> None:
        ...         self.config = EvaluatorConfig(*args, **options)
    """
    options = inspect.signature(config)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)

    def wrap(init: Callable[Concatenate[S, ...], None]) -> Callable[Concatenate[S, P], None]:
        init.__signature__ = options.replace(  # type: ignore[attr-defined]
            parameters=[self_parameter, *options.parameters.values()], return_annotation="None"
        )
        checked: Callable[Concatenate[S, P], None] = known_keywords(cast(type, config), synonyms)(init)
        return checked

    return wrap


def options_reference(config_class: type) -> str:
    """Where a user reads every option of ``config_class``: its section of the options page (in
    the repository and on the docs site), and ``help()`` of the config class."""
    section = config_class.__name__.removesuffix("Config").lower()
    return f"{OPTIONS_PAGE}#{section}, or help(aiocollect.{config_class.__name__})"


def unknown_keyword(
    who: str, key: str, value: Any, names: Sequence[str], synonyms: Mapping[str, str], config_class: type
) -> ConfigTypeError:
    """The error for ``who(key=value)``, where ``who`` takes none of that name."""
    if key in synonyms:
        fix = f"{key} is not one of {who}'s options: {synonyms[key]}"
    else:
        close = difflib.get_close_matches(key, names, n=1, cutoff=0.7)
        fix = f"did you mean {close[0]}={value!r:.60}?" if close else f"it is not one of {who}'s options"
    return ConfigTypeError(
        f"{who}() got an unexpected keyword argument {key}={value!r:.60}; {fix} "
        f"(every option: {options_reference(config_class)})"
    )


def too_many_positional(
    who: str, args: Sequence[Any], positional: Sequence[str], names: Sequence[str], config_class: type
) -> ConfigTypeError:
    """The error for ``who(*args)`` with more than its ``positional`` arguments: the others are
    keyword-only (as TorchRL's collectors take them), so it says how to pass the extra ones."""
    extra = args[len(positional):]
    keywords = [n for n in names if n not in positional]
    meant = ", ".join(f"{name}={value!r:.60}" for name, value in zip(keywords, extra))
    return ConfigTypeError(
        f"{who}() takes {' and '.join(positional)} by position and every other option by keyword, but got "
        f"{len(args)} positional arguments; pass the others by name (in the order of the signature: {meant}) "
        f"(every option: {options_reference(config_class)})"
    )


def check_needs(config: Any, table: Sequence[Needs]) -> None:
    """Every option of ``table`` that is set has the setting it needs, or :class:`ConfigError`
    naming both (the first that has not, in the table's order)."""
    for row in table:
        row.check(config)


def check_module_env_id(env_id: str, argument: str) -> None:
    """``"module:EnvId"`` (gymnasium imports the module, whose import registers the id): the module
    must be importable (the id itself is only known once it is imported, in the workers)."""
    module, _, name = env_id.partition(":")
    try:
        found = bool(module) and importlib.util.find_spec(module) is not None
    except Exception:  # noqa: BLE001 - a malformed name, or a parent package that fails to import
        found = False
    if not name or ":" in name or not found:
        why = f"no module {module!r} can be imported" if not found else "the env id after ':' is missing or malformed"
        raise ConfigError(
            f"{argument}={env_id!r} is not 'module:EnvId' ({why}); pass a registered id such as 'CartPole-v1', "
            f"or 'package.module:EnvId' where importing package.module registers EnvId"
        )


def check_worker_count(num_workers: int) -> None:
    limit = max_worker_processes()
    if limit is not None and num_workers > limit[0]:
        raise ConfigError(
            f"num_workers={num_workers} is more worker processes than this machine allows: {limit[0]}, by "
            f"{limit[1]}; use fewer workers (each steps envs_per_worker envs), or raise the limit"
        )


def check_kwargs(name: str, kwargs: Any) -> None:
    """Keyword arguments: a dict (or None) whose keys are strs."""
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(f"{name}={kwargs!r} must be a dict or None")
    bad = [k for k in kwargs or () if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{name}={kwargs!r:.200} has the key {bad[0]!r}; keyword arguments are named by strs")


def check_sendable_to_workers(env_fn: Any, env_kwargs: Any) -> None:
    """The env factory and its keyword arguments must travel to worker processes (cloudpickle):
    found out here, not once the workers are started (costs one pickling of each)."""
    import cloudpickle

    for name, value in (("create_env_fn", env_fn), ("create_env_kwargs", env_kwargs)):
        if value is None or isinstance(value, str):
            continue
        try:
            cloudpickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - any failure to pickle
            raise ConfigError(
                f"{name}={value!r:.100} cannot be sent to the worker processes ({type(exc).__name__}: {exc}); "
                f"pass objects that cloudpickle can pickle (a function, a class, plain data)"
            ) from exc


def check_platform(what: str) -> None:
    """aiocollect needs Linux: fork, memfd, pidfd and /proc."""
    import sys

    if not sys.platform.startswith("linux"):
        raise ConfigError(
            f"{what} needs Linux (it relies on fork, memfd_create, pidfd and /proc), and this is "
            f"{sys.platform!r}; run it on Linux (WSL2 and Docker on macOS are Linux)"
        )


def check_policy_args(policy: Any, policy_factory: Any) -> None:
    """``policy`` and ``policy_factory``: at most one of them, and a callable policy (the
    collector's and the evaluator's)."""
    if policy is not None and policy_factory is not None:
        raise ConfigError(
            f"policy={policy!r:.80} and policy_factory={policy_factory!r:.80}: pass either policy or "
            f"policy_factory, not both"
        )
    if policy is not None and not callable(policy):
        raise ConfigError(f"policy={policy!r} is not callable; pass an nn.Module, a TensorDictModule or None")


def check_recurrent_state(value: Any) -> dict | None:
    """``recurrent_state``: ``None``, or a dict of state key (a str, or a tuple of strs) -> per-env
    shape (a tuple of ints >= 1), or key -> ``(shape, dtype)`` (a torch or numpy dtype, or its
    name). Returned as key -> ``(shape, dtype name)``; anything else is a :class:`ConfigError`."""
    if value is None:
        return None
    from .._worker.recurrent import dtype_name

    example = "recurrent_state={'recurrent_state': (1, 64)} (key -> per-env shape, or key -> (shape, torch.float32))"
    if not isinstance(value, dict) or not value:
        raise _refuse("recurrent_state", value, "a non-empty dict of state key -> per-env shape", f"pass e.g. {example}")
    checked = {}
    for key, spec in value.items():
        if not (isinstance(key, str) or (isinstance(key, tuple) and key and all(isinstance(k, str) for k in key))):
            raise ConfigError(f"recurrent_state has the key {key!r}: a state key is a str or a tuple of strs; pass e.g. {example}")
        has_dtype = isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], (tuple, list))
        shape, dtype = (spec[0], spec[1]) if has_dtype else (spec, "float32")
        if not isinstance(shape, (tuple, list)) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape):
            raise ConfigError(
                f"recurrent_state[{key!r}]={spec!r} is not a per-env shape: give a tuple of ints >= 1 (the state of one "
                f"env, without the env dimension, e.g. (num_layers, hidden_size)), or (shape, dtype); pass e.g. {example}"
            )
        try:
            name = dtype_name(dtype)
        except TypeError:
            raise ConfigError(
                f"recurrent_state[{key!r}] has the dtype {dtype!r}, which is not a numeric dtype; pass e.g. torch.float32"
            ) from None
        checked[key] = (tuple(shape), name)
    return checked
