"""An async training server: a Starlette app served by uvicorn, whose lifespan starts an
aiocollect ``Collector`` and a training task in the server's own event loop.

    .venv/bin/python examples/training_server.py --port 8000        # needs aiocollect[server]
    curl http://127.0.0.1:8000/health
    curl http://127.0.0.1:8000/stats
    curl -X POST http://127.0.0.1:8000/weights
    curl -N http://127.0.0.1:8000/events                             # server-sent events
    curl -N 'http://127.0.0.1:8000/events?types=episode_ended'

The collector steps CartPole-v1 in worker processes; the trainer (an actor-critic step on each
batch: real optimizer steps on real batches) runs in the same loop and publishes the actor's
weights every ``--publish-every`` batches, or when a client asks (``POST /weights``). Requests
are answered while it all runs: the collector never blocks the loop, and the optimizer step runs
in a worker thread (torch releases the GIL in its kernels). ``/stats`` reports the loop's own lag
(a task sleeping 1 ms and measuring how late it wakes; ``?lag_since=T`` for the samples since
``time.monotonic()`` was T), so the claim can be checked from outside.

Shutdown (Ctrl-C, SIGTERM): the open ``/events`` streams end first (uvicorn waits for open
responses before it runs the lifespan's shutdown, and a stream never ends by itself), then the
training task is cancelled and the collector closed (its workers gone, its shared memory freed).

The recipe page: docs/recipes/training-server.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import socket
import sys
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import anyio
import torch
from torch import nn

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError as exc:  # pragma: no cover - the message is the point
    sys.exit(f"examples/training_server.py needs Starlette and uvicorn ({exc.name} is missing): "
             "pip install 'aiocollect[server]'")

from aiocollect import Collector
from aiocollect.events import (
    BatchReady,
    CollectorStopped,
    EpisodeEnded,
    Event,
    WeightsApplied,
    WeightsUpdated,
    WorkerFailed,
    WorkerRestarted,
)

#: what ``GET /events`` streams; the SSE event name is the class name in snake case
STREAMED = (EpisodeEnded, BatchReady, WeightsUpdated, WeightsApplied, WorkerFailed, WorkerRestarted,
            CollectorStopped)


def event_name(cls: type) -> str:
    """``EpisodeEnded`` -> ``episode_ended``."""
    return "".join("_" + c.lower() if c.isupper() else c for c in cls.__name__).lstrip("_")


NAMES = {event_name(cls): cls for cls in STREAMED}


def option(default: Any, doc: str) -> Any:
    """A setting with its one-line documentation (the command line's help shows it)."""
    return dataclasses.field(default=default, metadata={"help": doc})


@dataclasses.dataclass
class Settings:
    """The server's options (each is a command-line flag, its documentation the flag's help)."""

    env_id: str = option(
        "CartPole-v1", "gymnasium env id the workers step: 4 observations, 2 actions, as CartPole")
    num_workers: int = option(2, "worker processes stepping envs")
    envs_per_worker: int = option(4, "envs stepped by each worker process")
    frames_per_batch: int = option(1024, "frames in each batch the trainer receives")
    publish_every: int = option(
        4, "publish the actor's weights every this many batches; POST /weights publishes at once")
    learning_rate: float = option(1e-3, "the actor-critic's Adam learning rate")
    gamma: float = option(0.99, "discount factor of the returns the critic learns")
    seed: int = option(0, "seed of torch (the initial weights) and of the collector's envs")
    collect: bool = option(
        True, "start the collector and the trainer in the lifespan (--no-collect: the same app idle, "
        "for comparisons)")


# -- the model and the trainer ----------------------------------------------------------------------
class Actor(nn.Module):
    """Observation -> a sampled action (what the workers run); ``net`` gives the logits (what
    training uses)."""

    def __init__(self, obs_dim: int = 4, actions: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, actions))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return torch.distributions.Categorical(logits=self.net(observation)).sample()


class Trainer:
    """An actor-critic step per batch: discounted returns within the batch (cut at episode ends,
    bootstrapped by the critic where the batch or a truncation cuts an episode), advantage =
    return - value, policy-gradient and value losses, one Adam step."""

    def __init__(self, actor: Actor, obs_dim: int, lr: float, gamma: float) -> None:
        self.actor = actor
        self.critic = nn.Sequential(nn.Linear(obs_dim, 64), nn.Tanh(), nn.Linear(64, 1))
        self.opt = torch.optim.Adam([*actor.parameters(), *self.critic.parameters()], lr=lr)
        self.gamma = gamma
        self.steps = 0
        self.last_loss: float | None = None

    def step(self, batch: Any) -> float:
        obs = batch["observation"].float()  # [envs, time, obs]
        reward = batch["next", "reward"][..., 0]
        terminated = batch["next", "terminated"][..., 0]
        done = batch["next", "done"][..., 0]
        with torch.no_grad():
            value_next = self.critic(batch["next", "observation"].float())[..., 0]
        returns = torch.empty_like(reward)
        future = value_next[:, -1]
        for t in reversed(range(reward.shape[1])):
            # an episode cut here (the batch's end, a truncation) is bootstrapped by the critic
            bootstrap = torch.where(done[:, t], value_next[:, t], future)
            future = reward[:, t] + self.gamma * bootstrap * (~terminated[:, t]).float()
            returns[:, t] = future
        value = self.critic(obs)[..., 0]
        logp = torch.distributions.Categorical(logits=self.actor.net(obs)).log_prob(batch["action"])
        advantage = (returns - value).detach()
        loss = -(logp * advantage).mean() + 0.5 * (returns - value).pow(2).mean()
        self.opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_([*self.actor.parameters(), *self.critic.parameters()], 0.5)
        self.opt.step()
        self.steps += 1
        self.last_loss = float(loss.detach())
        return self.last_loss


# -- the app's state --------------------------------------------------------------------------------
class LoopLag:
    """How late a task sleeping 1 ms wakes: the event loop's responsiveness, measured inside it."""

    def __init__(self, keep: int = 50_000) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=keep)  # (time.monotonic(), lateness)

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            await anyio.sleep(0.001)
            t1 = time.monotonic()
            self.samples.append((t1, t1 - t0 - 0.001))

    def summary(self, since: float | None = None) -> dict[str, float | int | None]:
        """Percentiles of the samples taken since ``since`` (``time.monotonic()``: the clock is
        the machine's, so a client on it can ask for a window), or of the last 50,000."""
        s = sorted(lag for t, lag in self.samples if since is None or t >= since)
        if not s:
            return {"p50_ms": None, "p99_ms": None, "max_ms": None, "samples": 0}
        return {"p50_ms": s[len(s) // 2] * 1e3, "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3,
                "max_ms": s[-1] * 1e3, "samples": len(s)}


class EventFeed:
    """One ``/events`` client's events of several types, in order: a handler per type puts each
    into the client's own bounded buffer (a slow client loses the oldest, counted in
    ``dropped``; it never slows the collector or another client). ``next()`` returns ``None``
    once the collector stopped or the server is shutting down (``end()``)."""

    def __init__(self, collector: Collector, kinds: tuple[type[Event], ...], max_buffer: int = 1024) -> None:
        self.queue: deque[Event] = deque(maxlen=max_buffer)
        self.dropped = 0
        self.stopped = False
        self.ready = anyio.Event()
        self.kinds = kinds
        # (a handler only appends: handlers run in the collector's task, before its batch is delivered)
        self.handles = [collector.on(kind, self._put) for kind in {*kinds, CollectorStopped}]

    def _put(self, event: Event) -> None:
        if isinstance(event, CollectorStopped):
            self.stopped = True
        if isinstance(event, self.kinds):
            if len(self.queue) == self.queue.maxlen:
                self.dropped += 1
            self.queue.append(event)
        self.ready.set()

    def end(self) -> None:
        self.stopped = True
        self.ready.set()

    async def next(self) -> Event | None:
        while not self.queue:
            if self.stopped:
                return None
            self.ready = anyio.Event()
            await self.ready.wait()
        return self.queue.popleft()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@dataclasses.dataclass
class AppState:
    settings: Settings
    actor: Actor
    trainer: Trainer
    collector: Collector | None = None
    version: int = 0  # the newest version published
    error: str | None = None  # what ended the training task, if anything did
    lag: LoopLag = dataclasses.field(default_factory=LoopLag)
    feeds: set[EventFeed] = dataclasses.field(default_factory=set)  # the open /events streams
    # held by an optimizer step and by taking a snapshot of the weights to publish: a publication
    # never reads weights halfway through a step
    lock: anyio.Lock = dataclasses.field(default_factory=anyio.Lock)

    async def publish(self, wait: bool) -> int:
        """Publish a snapshot of the actor's weights; with ``wait``, return once every worker that
        still collects applied it."""
        assert self.collector is not None
        async with self.lock:
            weights = {k: v.detach().clone() for k, v in self.actor.state_dict().items()}
        self.version = version = await self.collector.update_weights(weights, wait=wait)
        return version


async def train(state: AppState) -> None:
    """The training task: a step on each batch (in a worker thread, so that requests are answered
    meanwhile), and the weights published every ``publish_every`` batches."""
    collector = state.collector
    assert collector is not None
    try:
        async for batch in collector:
            async with state.lock:
                await anyio.to_thread.run_sync(state.trainer.step, batch)
            if state.trainer.steps % state.settings.publish_every == 0:
                await state.publish(wait=False)  # (applied by each worker at its next batch)
    except Exception as exc:  # noqa: BLE001 - reported by /health (503) and /stats, and printed
        state.error = f"{type(exc).__name__}: {exc}"
        print(f"training stopped: {state.error}", flush=True)


def create_app(settings: Settings | None = None) -> Starlette:
    """The ASGI app: run it with uvicorn (``main`` below), or any ASGI server."""
    settings = settings or Settings()
    torch.manual_seed(settings.seed)
    actor = Actor()
    state = AppState(settings, actor, Trainer(actor, 4, settings.learning_rate, settings.gamma))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack, anyio.create_task_group() as tg:
            tg.start_soon(state.lag.run)
            if settings.collect:
                state.collector = await stack.enter_async_context(Collector(
                    settings.env_id, actor, frames_per_batch=settings.frames_per_batch,
                    num_workers=settings.num_workers, envs_per_worker=settings.envs_per_worker,
                    seed=settings.seed,
                ))
                print(f"collector started: workers {list(state.collector.worker_pids)}", flush=True)
                tg.start_soon(train, state)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()  # the trainer and the lag monitor; then the collector closes
        if state.collector is not None:
            print(f"collector {state.collector.state.value}: {state.collector.stats().frames} frames", flush=True)

    async def health(request: Request) -> Response:
        c = state.collector
        body = {"status": "ok" if state.error is None else "error", "collector": c.state.value if c else "off",
                "error": state.error}
        return JSONResponse(body, status_code=200 if state.error is None else 503)

    async def stats(request: Request) -> Response:
        c = state.collector
        body: dict[str, Any] = {"collector": c.state.value if c else "off", "policy_version": state.version,
                                "train_steps": state.trainer.steps, "last_loss": state.trainer.last_loss,
                                "loop_lag": state.lag.summary(_float(request.query_params.get("lag_since"))),
                                "event_streams": len(state.feeds), "error": state.error}
        if c is not None:
            s = c.stats()
            body |= {"frames": s.frames, "batches": s.batches, "fps": s.fps, "episodes": s.episodes,
                     "mean_return": s.mean_return, "restarts": s.restarts, "timing": dict(s.timing),
                     "worker_pids": list(c.worker_pids)}
        return JSONResponse(_finite(body))

    async def publish(request: Request) -> Response:
        """Publish the actor's current weights now; answers once every worker applied them."""
        if state.collector is None:
            return JSONResponse({"error": "not collecting (--no-collect)"}, status_code=409)
        t0 = time.perf_counter()
        with anyio.move_on_after(30) as scope:
            version = await state.publish(wait=True)
        if scope.cancelled_caught:
            return JSONResponse({"error": "the workers did not apply the weights within 30 s"}, status_code=504)
        return JSONResponse({"version": version, "applied": True, "seconds": time.perf_counter() - t0})

    async def events(request: Request) -> Response:
        """Server-sent events: one ``event: <name>`` / ``data: <json>`` message per collector
        event; ``?types=episode_ended,weights_applied`` picks some."""
        c = state.collector
        if c is None:
            return JSONResponse({"error": "not collecting (--no-collect)"}, status_code=409)
        wanted = request.query_params.get("types")
        try:
            kinds = tuple(NAMES[n] for n in wanted.split(",")) if wanted else STREAMED
        except KeyError as exc:
            return JSONResponse({"error": f"unknown event type {exc.args[0]!r}; known: {sorted(NAMES)}"},
                                status_code=400)

        async def stream() -> AsyncIterator[str]:
            feed = EventFeed(c, kinds)
            state.feeds.add(feed)
            try:
                yield ": subscribed\n\n"
                while (event := await feed.next()) is not None:
                    yield f"event: {event_name(type(event))}\ndata: {json.dumps(event_payload(event))}\n\n"
                yield f"event: end\ndata: {json.dumps({'dropped': feed.dropped})}\n\n"
            finally:  # (the client left, the collector stopped, or the server is shutting down)
                state.feeds.discard(feed)
                feed.close()

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    routes = [Route("/health", health), Route("/stats", stats), Route("/weights", publish, methods=["POST"]),
              Route("/events", events)]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.aiocollect = state
    return app


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None


def event_payload(event: Event) -> dict[str, Any]:
    """An event's fields as JSON-ready values (errors as their text)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if isinstance(value, BaseException):
            value = f"{type(value).__name__}: {value}"
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, dict) or hasattr(value, "items"):
            value = dict(value)
        out[f.name] = value
    return _finite(out)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: ``None`` instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


# -- running it ---------------------------------------------------------------------------------------
class TrainingServer(uvicorn.Server):
    """uvicorn's server, ending the app's open event streams as it starts to shut down: uvicorn
    waits for open responses before it runs the lifespan's shutdown, and an event stream never
    ends by itself."""

    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self.app_state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for feed in list(self.app_state.feeds):
            feed.end()
        await super().shutdown(sockets=sockets)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on; 0: a free port (printed)")
    for f in dataclasses.fields(Settings):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            p.add_argument(flag, type=type(f.default), default=f.default,
                           help=f.metadata["help"] + " (default: %(default)s)")
    args = p.parse_args(argv)
    return args, Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)})


def main(argv: list[str] | None = None) -> None:
    args, settings = parse_args(argv)
    torch.set_num_threads(1)  # the workers use the other cores
    app = create_app(settings)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    server = TrainingServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10),
                            app.state.aiocollect)

    async def serve() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve, [sock])
            while not server.started:  # (uvicorn's lifespan ran: the collector is up)
                if server.should_exit:
                    return
                await anyio.sleep(0.01)
            print(f"listening on http://{host}:{port} (pid {os.getpid()})", flush=True)

    try:
        anyio.run(serve, backend_options={"use_uvloop": True})
    except* KeyboardInterrupt:  # (uvicorn hands Ctrl-C back once it has shut down; twice: at once)
        pass
    print("server stopped", flush=True)


if __name__ == "__main__":
    main()
