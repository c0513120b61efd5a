"""The blocking wrapper of :class:`~aiocollect.Collector` for synchronous code (``with
Collector(...) as c: for batch in c``): the same async code, run in an event loop in a helper
thread (an anyio blocking portal), never a second implementation. Portals still open when the
interpreter exits are closed before it joins its threads, so that a script that leaves ``for
batch in collector`` early still exits.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Iterator, TypeVar

from .._core.errors import AiocollectError, EndOfCollection
from .._service.portal import Portal
from .._service.resource import loop_token
from .run import Run

if TYPE_CHECKING:  # pragma: no cover
    from tensordict import TensorDict

C = TypeVar("C", bound="BlockingMixin")


class BlockingMixin:
    """``with``, ``for`` and :meth:`close` for a collector (which provides ``_run``, ``_portal``
    (a :class:`Portal`), ``_in_with``, ``start``, ``collect`` and ``aclose``)."""

    _run: Run
    _portal: "Portal"
    _in_with: bool
    if TYPE_CHECKING:  # (provided by the collector)
        async def start(self) -> None: ...
        async def collect(self) -> Any: ...
        async def aclose(self) -> None: ...
        def _closing(self, closer: str) -> None: ...
        update_weights: Any

    def _blocking(self, what: str) -> Any:
        """The portal, refusing to block a running event loop."""
        if loop_token() is not None:
            raise AiocollectError(
                f"{what} blocks, and it was called inside a running event loop (which it would freeze): "
                f"in async code use `async with Collector(...)` and `async for batch in collector` "
                f"(or `await collector.collect()`)"
            )
        return self._portal.get()

    def _awaitable_or_blocking(self, what: str, make: Any) -> Any:
        """``make()`` (a coroutine) to await in async code; where no event loop runs (the
        blocking wrapper), run through the portal, and its result."""
        if loop_token() is not None:
            return make()
        return self._blocking(what).call(make)

    def __enter__(self: C) -> C:
        portal = self._blocking("`with Collector(...)`")
        self._in_with = True
        try:
            portal.call(self.start)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._in_with = False
        self._closing("the end of its `with` block" + ("" if exc is None else f", which raised {type(exc).__name__}"))
        try:
            self.close()
        except Exception:
            if exc is None:
                raise

    def __iter__(self) -> Iterator["TensorDict"]:
        """Plain ``for batch in collector`` (blocking). Runs the collector in an event loop in a
        helper thread (an anyio blocking portal); :meth:`close` ends both. Without ``with``, the
        collector closes itself at the end of the collection, and at interpreter exit if the
        loop was left early."""
        portal = self._blocking("`for batch in collector`")
        while True:
            try:
                batch = portal.call(self.collect)
            except EndOfCollection:
                if not self._in_with:
                    self._closing("its plain `for batch in collector` (without `with`), which closes it when "
                                  "total_frames are delivered")
                    self.close()
                return
            yield batch

    def iterator(self) -> Iterator["TensorDict"]:
        """TorchRL's name for a plain ``for batch in collector`` (blocking, as :meth:`__iter__`)."""
        return iter(self)

    def shutdown(self, timeout: float | None = None, close_env: bool = True, raise_on_error: bool = True) -> Any:
        """TorchRL's name for :meth:`aclose`: ``await collector.shutdown()`` in async code; in
        synchronous code it blocks as :meth:`close`. Closing twice is fine. ``timeout``,
        ``close_env`` and ``raise_on_error`` are taken for TorchRL's signature: the workers get
        the constructor's ``shutdown_timeout``, their envs are always closed, errors always raised."""
        if loop_token() is not None:
            return self.aclose()
        self.close()
        return None

    def update_policy_weights_(
        self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None, worker_ids: Any = None,
        model_id: str | None = None, weights_dict: Any = None, wait: bool = True, **kwargs: Any,
    ) -> int:
        """Blocking :meth:`update_weights` (TorchRL's name), for code that uses the blocking
        wrapper (``with``, ``for batch in collector``, a ``DataLoader``): same result (the new
        version); it returns once the workers applied it (``wait=True``). Inside a running event
        loop use ``await collector.update_weights(...)``.

        Takes TorchRL 0.14.1's keywords: the weights as ``policy_or_weights``, ``weights=``,
        ``policy=`` or ``policy_weights=`` (one of them; none: the constructor's ``policy`` as
        it is now, which is what a script that trains that module in place wants after each
        training step), ``worker_ids`` (indices, not devices), ``model_id`` (``"policy"`` or
        ``"policy.<submodule path>"``; ``None``: ``"policy"``) and ``weights_dict``. Raises
        :class:`ConfigError` for two ways of passing the weights, devices as ``worker_ids`` or
        ``{worker index: weights}`` (call it once per worker with ``worker_ids=[index]``), and
        for a keyword it does not take (that one also a ``TypeError``)."""
        from .weightsync import torchrl_arguments

        arguments = torchrl_arguments(
            policy_or_weights, weights=weights, policy=policy, worker_ids=worker_ids, model_id=model_id,
            weights_dict=weights_dict, wait=wait, **kwargs,
        )
        portal = self._blocking("update_policy_weights_()")
        return portal.call(functools.partial(self.update_weights, **arguments))

    def close(self) -> None:
        """Blocking :meth:`aclose`, for code that used the blocking wrapper."""
        self._closing("close()")
        portal = self._portal.portal
        if portal is None:
            if self._run.close_unstarted():
                return
            raise AiocollectError("this collector runs in an event loop: use `await collector.aclose()`")
        try:
            portal.call(self.aclose)
        finally:
            self._portal.close()


__all__ = ["BlockingMixin"]
