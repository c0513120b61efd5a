"""Server inference (``inference="server"``), what both sides share and the worker's side.

With server inference a worker steps its envs only: the policy is the user's own object, run by
:class:`~aiocollect._collector.inference_server.InferenceServer` in the collector's process on the observations of
many workers at once. The two sides meet in one shared-memory segment (:class:`ServerLayout`)
and two eventfds per worker:

1. the worker writes its envs' observations of step ``t`` into its rows of the request arrays
   and writes 1 to its *request* eventfd;
2. the server wakes (it waits on every worker's request eventfd at once), runs one forward pass
   over the rows of every worker that asked, writes the actions, the policy's extra outputs and
   the policy version into those workers' rows of the response arrays, and writes 1 to each
   one's *response* eventfd (2 when the server stopped: the worker stops too);
3. the worker, which waited on its response eventfd *and* its socket (a stop request or the
   collector's end is heard while waiting), copies the actions into its batch, as it does with
   a policy of its own, and steps its envs.

So per step a worker costs the server two eventfd calls and the copies of its observations and
actions: no message through the collector's event loop, which never sees a step.
:class:`RemoteRunner` is the worker's side, behind the same interface as the runners of worker
inference (``act(obs) -> (env actions, action arrays, extras)``, ``probe``): the rollout code is
the same for both.

Imported by worker processes: numpy and the standard library only (never torch).
"""

from __future__ import annotations

import dataclasses
import os
import select
from typing import Any, Callable, Sequence

import numpy as np

from .._core.layout import _ALIGN, Leaf
from .recurrent import IS_INIT
from .peer import _Stop

REQUEST = 1  # on a request eventfd: the observations are in the worker's rows
IDLE = 2  # on a request eventfd (with env_batch_size): the worker ended its batch and may wait
ACTIONS_READY = 1  # a response: the actions are in the worker's rows
SERVER_STOPPED = 2  # a response: the server stopped (the collector closes, or the policy failed)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclasses.dataclass(frozen=True)
class ServerLayout:
    """The server's shared memory: per leaf one array ``[seats, rows, *shape]`` (requests:
    the observation leaves; responses: the action leaves and the policy's extra outputs), then
    one int64 per seat, the policy version of its last response. A seat is a worker's envs, or
    one of its ``worker_groups`` groups of envs."""

    obs: tuple[Leaf, ...]
    act: tuple[Leaf, ...]
    extras: tuple[Leaf, ...]
    seats: int
    rows: int  # env rows per seat
    signal_idle: bool = False  # env_batch_size: workers say when they end a batch (IDLE)
    recurrent: bool = False  # a recurrent policy: requests say which rows start an episode (last request leaf)

    @property
    def requests(self) -> tuple[Leaf, ...]:
        """The request leaves: the observation's, and with a recurrent policy each row's ``is_init``."""
        return self.obs + ((Leaf(IS_INIT, (), "bool"),) if self.recurrent else ())

    def _sizes(self) -> list[int]:
        leaves = self.requests + self.act + self.extras
        return [self.seats * self.rows * leaf.np_dtype.itemsize * int(np.prod(leaf.shape, dtype=np.int64))
                for leaf in leaves]

    @property
    def nbytes(self) -> int:
        return sum(_aligned(n) for n in self._sizes()) + 8 * self.seats

    def arrays(self, buf: Any) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray], np.ndarray]:
        """Views on ``buf`` (a mapping of the segment): the request leaves, the action leaves,
        the extra leaves (each ``[seats, rows, ...]``) and the versions (``[seats]``)."""
        out: list[np.ndarray] = []
        pos = 0
        for leaf, n in zip(self.requests + self.act + self.extras, self._sizes()):
            out.append(np.frombuffer(buf, leaf.np_dtype, n // leaf.np_dtype.itemsize, pos)
                       .reshape((self.seats, self.rows) + leaf.shape))
            pos += _aligned(n)
        versions = np.frombuffer(buf, np.int64, self.seats, pos)
        k, a = len(self.requests), len(self.act)
        return out[:k], out[k : k + a], out[k + a :], versions


class RemoteRunner:
    """A worker's policy under server inference: :meth:`act` asks the server and waits for its
    answer. Made before the server exists (the worker's envs tell the collector the spaces the
    server needs); :meth:`connect` attaches it once the collector sends the segment."""

    uses_torch = False
    model = None  # no weights here: the inference server runs the policy
    remote = True
    is_init: np.ndarray | None = None  # a recurrent policy: the rows that start an episode (sent with a request)

    def __init__(self, env_actions: Any, num_envs: int) -> None:
        self.env_actions = env_actions  # the arrays as each env's step takes them
        self.num_envs = num_envs
        self.version = 0  # of the policy that computed the last actions
        self.extra_leaves: list[Leaf] = []
        self.on_socket: Callable[[], None] = lambda: None  # the worker's messages (a stop raises)
        self._connected = False

    def probe(self, obs: list[np.ndarray]) -> list[Leaf]:
        return []  # the server's policy tells the collector its extra outputs

    def connect(self, layout: ServerLayout, mapping: Any, seat: int, req_fd: int, resp_fd: int, sock: Any) -> None:
        obs, act, extras, versions = layout.arrays(mapping)
        self.req = [a[seat] for a in obs]
        if layout.recurrent:  # (a replacement's envs start afresh: every row starts an episode)
            self.init_req, self.is_init = self.req.pop(), np.ones(self.num_envs, bool)
        self.actions = [a[seat] for a in act]
        self.extras = [a[seat] for a in extras]
        self.extra_leaves = list(layout.extras)
        self.versions, self.seat = versions, seat
        self.in_flight = False  # a request sent ahead (ahead()) whose answer act() takes
        self.signal_idle = layout.signal_idle
        self.req_fd, self.resp_fd = req_fd, resp_fd
        self.poller = select.poll()
        self.poller.register(resp_fd, select.POLLIN)
        self.poller.register(sock, select.POLLIN)
        self._connected = True
        try:  # (an answer to the request of a worker this one replaces is not for it)
            os.eventfd_read(resp_fd)
        except BlockingIOError:
            pass

    def ahead(self, obs: list[np.ndarray]) -> None:
        """Ask for the actions of the next step's observations ``obs`` now (they are final): the
        server computes them while this process does something else (``worker_groups``: steps
        its other group of envs); the next :meth:`act` takes the answer."""
        self._request(obs)
        self.in_flight = True

    def _request(self, obs: list[np.ndarray]) -> None:
        for dst, src in zip(self.req, obs):
            np.copyto(dst, src)
        if self.is_init is not None:
            np.copyto(self.init_req, self.is_init)
            self.is_init[:] = False
        os.eventfd_write(self.req_fd, REQUEST)

    def act(self, obs: list[np.ndarray]) -> tuple[Sequence[Any], list[np.ndarray], list[np.ndarray]]:
        if self.in_flight:  # asked ahead, for these same observations
            self.in_flight = False
        else:
            self._request(obs)
        resp_fd = self.resp_fd
        while True:
            for fd, _ in self.poller.poll():
                if fd != resp_fd:
                    self.on_socket()  # a message, or the collector's end: a stop raises here
            try:
                answer = os.eventfd_read(resp_fd)
                break
            except BlockingIOError:
                continue  # (only the socket was readable)
        if answer != ACTIONS_READY:
            raise _Stop  # the server stopped: so does this worker (the collector knows why)
        self.version = int(self.versions[self.seat])
        return self.env_actions.per_env(self.actions, self.num_envs), self.actions, self.extras

    def idle(self) -> None:
        """The batch is complete: with ``env_batch_size``, tell the server not to wait for this
        worker's envs before its next request (it may wait for credit or a slot first)."""
        if self.signal_idle:
            os.eventfd_write(self.req_fd, IDLE)

    def close(self) -> None:
        if self._connected:
            self._connected = False
            for fd in (self.req_fd, self.resp_fd):
                os.close(fd)


__all__ = ["ACTIONS_READY", "IDLE", "REQUEST", "SERVER_STOPPED", "RemoteRunner", "ServerLayout"]
