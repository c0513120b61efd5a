"""Weight-sync benchmark: how long until every worker runs the new weights, aiocollect against a
naive pickle-through-a-pipe implementation.

Two policies (CartPole-v1, float32 observations [B, 4] -> int64 actions, argmax of the logits):

* **MLP 4-64-2**: the ``ArgmaxMLP`` of benchmarks/throughput.py (450 parameters).
* **MLP ~10M**: 4 -> w -> w -> w -> 2 with tanh between the layers, the width w (a multiple of 32)
  chosen so that the parameter count is closest to ``--big-params`` (default 10,000,000); the exact
  count is printed. Sizes are float32 parameters in MB (10^6 bytes).

For each of them, with ``--workers`` x ``--envs-per-worker`` envs (default 2 x 8) and
``--frames-per-batch`` (default 2048):

1. **aiocollect, workers idle**: a ``Collector(..., prefetch=0)`` that no consumer asks for a batch,
   so its workers have no credit and wait between batches; each ``update_weights`` is applied at once
   on arrival. This isolates the cost of the transfer itself: the collector copies the state dict once
   into a double-buffered shared-memory store (seqlocks) and nudges the workers; each copies the newest
   version into its replica and acknowledges. Latency = wall time of ``await
   collector.update_weights(policy)`` (``wait=True``: returns once every worker acknowledged), ``--n``
   times (default 30) for the MLP, ``--n-big`` (default 10) for the big model, after 2 discarded
   updates (first touches of the shared pages). The per-worker latencies of the
   ``WeightsApplied`` events (publication -> acknowledgement seen by the collector) are also
   reported. Then the **sender-side cost of the publish alone**: the time ``update_weights(...,
   wait=False)`` takes to return (state dict -> shared memory, nudges), same counts; after each, the
   benchmark waits (untimed) for the workers to apply it.

   For the big model only, the same idle collector then measures a **partial update**: the output
   layer alone (the last ``nn.Linear``, 4,482 parameters at the default size), published with
   ``update_weights(layer, model_id="policy.net.6")``. The workers run the policy module itself (a plain
   ``nn.Module``, not wrapped), so the id is "policy." + the layer's ``get_submodule`` path. The store
   records per tensor the version that last changed it: the publisher copies only that layer (plus the
   tensors the other buffer changed since it was last written) and each worker only the tensors changed
   since its version. So that the ratio is fair on a noisy machine, whole-model and partial updates are
   interleaved: ``--n-big`` rounds (after 2 discarded) of [whole model, output layer, output layer] with
   ``wait=True`` (latency to all workers applied), then as many rounds with ``wait=False`` (publish
   alone; after each update the benchmark waits, untimed, for the workers). The first output-layer
   update of a round follows a whole-model one, so its publisher also carries every tensor over into
   the other buffer (about a whole-model copy): it is reported apart ("after a whole update"); the
   second is the steady state ("output layer only"). Each update changes a value of what it publishes.
   Then, untimed, a check that the workers really run the new layer: the output layer is negated
   (every action flips) and published alone; every worker must have acknowledged that version
   (``collector.worker_versions``), and one batch is collected (the only one this collector delivers):
   it must carry that version, and its actions (256 of its frames) must be the local policy's.
2. **aiocollect while collecting**: a second collector (default ``prefetch=2``) with a consumer task
   pulling batches back to back, so the workers are always inside a batch; they apply new weights only
   at their next batch boundary, so the latency includes waiting for the batch in progress to finish.
   Before each update the benchmark sleeps a random time (seeded) uniform in [0, one batch period],
   the period being the mean interval between the batches the consumer received so far (from a
   warm-up of 2 batches on), so that updates land at random points of a batch rather than always
   right after a boundary. Expect roughly U(0, batch period) plus the idle cost; the batch period is
   printed beside it. One update is discarded (not 2: each costs about a batch period).
3. **pickle + pipe** ("what a naive implementation does"): ``--workers`` processes (multiprocessing
   "spawn") each hold the same model, idle, blocked on a ``multiprocessing.Pipe``. The parent
   serializes ``model.state_dict()`` once (``torch.save`` into a ``BytesIO``), sends the bytes to each
   worker in turn (``send_bytes``); each worker ``torch.load``\\ s them and calls ``load_state_dict``,
   then replies. Latency = serialization to the last reply, same counts and warm-up. The
   serialization time alone is reported as its sender-side cost.
4. **Server inference** (``inference="server"``, workers idle, ``prefetch=0``): the server runs
   weights of its own; ``update_weights(policy)`` copies the trainer's module into them between two
   forward passes (under the server's lock; on CUDA on the server's stream, after the caller's
   work). Latency of that call, same counts and warm-up, on the CPU and, where CUDA is available,
   on ``cuda`` (the trainer's module there too); and the memory the copy costs: the state dict's
   bytes, and on CUDA the growth of ``torch.cuda.memory_allocated`` with the collector.
   ``--server-only`` runs this section alone.
5. **The in-place change check** (no collector: this process only), for the two MLPs and DQN's
   Nature CNN (4x84x84 -> 6 actions, 1.69M parameters): what ``collector.collect()`` does per batch
   handed out to find a policy trained in place but never published (each parameter's and
   persistent buffer's version counter and each parameter's gradient read; the gradients exist,
   as in a training loop), and what taking its reference again costs at each publish; 200 timings
   of 50 calls each (10 for the reference), per call. Printed beside "publish alone" where that was
   measured. ``--check-only`` runs this section alone (seconds).

Every weight update changes one parameter value first (outside the timed region), so each version
really differs from the last. This process runs ``torch.set_num_threads(1)``, as aiocollect's workers
and the naive workers do. Percentiles are numpy's (linear interpolation): with 10 samples p90 lies
between the two slowest. On a noisy machine compare the columns of one run (they are measured
minutes apart at most), not absolute figures across runs.

Run (about 75 s with the defaults on an idle machine, 85 s on a loaded one)::

    .venv/bin/python benchmarks/weight_sync.py [--n 30] [--n-big 10] [--json benchmarks/results/weight_sync.json]

The big model's "collecting" section dominates: about (n-big + 3) batch periods of that model
(1.8 s per batch on an idle 2-core machine, 3 s on a loaded one).

Every process the benchmark starts is stopped before it exits (also on Ctrl-C, SIGTERM or an error); a
section that leaves processes behind is reported with a warning and they are terminated.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _util.py beside this file, also for python -m
from _util import (
    ArgmaxMLP,
    MP_HELPERS,
    WideArgmaxMLP,
    become_subreaper,
    child_signals,
    log,
    machine,
    machine_line,
    percentiles_ms,
    reap,
    sigterm_as_interrupt,
)

ENV_ID = "CartPole-v1"
OBS_DIM = 4
SEED = 0
WARMUP_UPDATES = 2  # discarded before each series of updates (idle, pickle + pipe)
WARMUP_UPDATES_COLLECTING = 1  # the same while collecting (each costs about one batch period)
WARMUP_BATCHES = 2  # batches received before the "collecting" updates start
SETTLE_TIMEOUT_S = 60.0  # longest wait for one update to be applied / acknowledged


# --------------------------------------------------------------------------------------------------
# the models (ArgmaxMLP and WideArgmaxMLP from _util.py, which spawned workers import by reference)


def wide_params(width: int, hidden: int = 3) -> int:
    return (OBS_DIM + 1) * width + (hidden - 1) * (width + 1) * width + (width + 1) * 2


def width_for(params: int, hidden: int = 3, multiple: int = 32) -> int:
    """The width (a multiple of ``multiple``) whose parameter count is closest to ``params``."""
    w = math.sqrt(params / (hidden - 1))
    candidates = {max(multiple, int(w // multiple) * multiple + d * multiple) for d in (-1, 0, 1, 2)}
    return min(candidates, key=lambda c: abs(wide_params(c, hidden) - params))


@dataclass(frozen=True)
class ModelSpec:
    """What to build: a picklable description, so that spawned workers build the same model."""

    key: str  # in the JSON results
    name: str  # in the table
    width: int | None = None  # None: the 4-64-2 ArgmaxMLP


def build_model(spec: ModelSpec) -> nn.Module:
    """Same spec, same seed: same weights in every process."""
    torch.manual_seed(SEED)
    return ArgmaxMLP() if spec.width is None else WideArgmaxMLP(spec.width)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def state_nbytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def perturb(model: nn.Module, version: int) -> None:
    """Make the next version differ from the last: change one value (cheap, outside the timing).
    ``model`` may be a submodule (the output layer, for a partial update): its first parameter."""
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] = 1e-3 * version


def output_layer(model: nn.Module) -> tuple[str, nn.Linear]:
    """``(model_id, layer)`` of the last ``nn.Linear``: the id names it as ``get_submodule`` does, under
    "policy" (the workers run the module itself, not wrapped: ``WideArgmaxMLP`` -> ``"policy.net.6"``)."""
    path, layer = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    assert model.get_submodule(path) is layer
    return f"policy.{path}", layer


# --------------------------------------------------------------------------------------------------
# the in-place change check: what the collector does per batch handed out


def _check_model(spec: ModelSpec | None) -> tuple[nn.Module, torch.Tensor]:
    """The model and an input (``None``: the Nature CNN)."""
    if spec is None:
        from inference import NatureCNN  # (the Pong benchmark's network)

        torch.manual_seed(SEED)
        return NatureCNN(), torch.zeros(2, 4, 84, 84)
    return build_model(spec), torch.zeros(2, OBS_DIM)


def measure_check(spec: ModelSpec | None, samples: int = 200, per_sample: int = 50) -> dict[str, Any]:
    """The per-batch cost of the check (``InPlaceWatch.changed()`` on an unchanged policy: every
    tensor's version counter and every parameter's gradient read, as in a training loop where the
    gradients exist), and the per-publish cost of taking the reference (``mark``: the state dict
    walked once). ``samples`` timings of ``per_sample`` calls each; figures per call, in ms."""
    from aiocollect._collector.weightsync import InPlaceWatch

    model, x = _check_model(spec)
    model.net(x).sum().backward()  # gradients exist, as after a training step
    watch = InPlaceWatch(model)
    watch.mark(0)
    assert not watch.changed()
    checks, marks = [], []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(per_sample):
            watch.changed()
        checks.append((time.perf_counter() - t0) / per_sample)
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(per_sample // 5 or 1):
            watch.mark(0)
        marks.append((time.perf_counter() - t0) / (per_sample // 5 or 1))
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1.0
    assert watch.changed(), "an in-place change must be seen"
    return {
        "tensors": len(watch.tensors), "params": count_params(model), "bytes": state_nbytes(model),
        "check_ms": stats_ms(checks), "mark_ms": stats_ms(marks),
    }


# --------------------------------------------------------------------------------------------------
# results


def stats_ms(samples: list[float]) -> dict[str, float]:
    """p50/p90/max/mean (and the count) of durations given in seconds, in ms."""
    return percentiles_ms(samples, (50, 90), mean=True)


@dataclass
class Series:
    """One measured series of weight updates."""

    latency: dict[str, float] = field(default_factory=dict)  # stats_ms of the headline latency
    note: str = ""  # why there is no figure (failed)
    extra: dict[str, Any] = field(default_factory=dict)


def _fmt(s: dict[str, float], keys: tuple[str, ...] = ("p50", "p90", "max")) -> str:
    if not s.get("n"):
        return "no samples"
    return ", ".join(f"{k} {_ms(s[k])}" for k in keys) + f" ms (n={s['n']})"


def _ms(x: float) -> str:
    """Milliseconds with about 3 significant digits."""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _describe(exc: BaseException) -> str:
    """``Type: message`` of an error, unwrapping exception groups (anyio's task groups raise those)."""
    inner: tuple[BaseException, ...] = getattr(exc, "exceptions", ())
    while len(inner) == 1:
        exc = inner[0]
        inner = getattr(exc, "exceptions", ())
    return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------------------------------
# 1-2. aiocollect


def _collector(collector_cls: Any, policy: nn.Module, args: argparse.Namespace, prefetch: int) -> Any:
    return collector_cls(
        ENV_ID,
        policy,
        frames_per_batch=args.frames_per_batch,
        total_frames=-1,
        num_workers=args.workers,
        envs_per_worker=args.envs_per_worker,
        prefetch=prefetch,
        seed=SEED,
    )


def _drain(sub: Any, into: dict[int, list[float]]) -> None:
    """Move the WeightsApplied events received so far into ``into`` (worker -> latencies)."""
    import anyio

    while True:
        try:
            e = sub.receive_nowait()
        except (anyio.WouldBlock, anyio.EndOfStream):
            return
        into.setdefault(e.worker, []).append(e.latency)


async def _settle(collector: Any, version: int) -> None:
    """Wait (untimed) until every worker acknowledged ``version``."""
    import anyio

    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while min(collector.worker_versions) < version:
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers did not apply version {version} within {SETTLE_TIMEOUT_S:g} s")
        if collector.state.value != "running":
            raise RuntimeError(f"the collector is {collector.state.value} while waiting for version {version}")
        await anyio.sleep(0.001)


async def _aiocollect_idle(collector_cls: Any, spec: ModelSpec, args: argparse.Namespace, n: int) -> Series:
    import anyio
    from aiocollect import events as ev

    policy = build_model(spec)
    t_start = time.perf_counter()
    async with _collector(collector_cls, policy, args, prefetch=0) as collector:
        startup = time.perf_counter() - t_start
        sub = collector.subscribe(ev.WeightsApplied, max_buffer=100_000)
        per_worker: dict[int, list[float]] = {}
        latencies: list[float] = []
        for i in range(WARMUP_UPDATES + n):
            perturb(policy, collector.policy_version + 1)
            t0 = time.perf_counter()
            version = await collector.update_weights(policy)
            dt = time.perf_counter() - t0
            if i >= WARMUP_UPDATES:
                latencies.append(dt)
            else:
                _drain(sub, {})
        _drain(sub, per_worker)
        publish: list[float] = []
        for i in range(WARMUP_UPDATES + n):
            perturb(policy, collector.policy_version + 1)
            t0 = time.perf_counter()
            version = await collector.update_weights(policy, wait=False)
            dt = time.perf_counter() - t0
            if i >= WARMUP_UPDATES:
                publish.append(dt)
            await _settle(collector, version)
            await anyio.sleep(0.002)  # let the acknowledgements' events go before the next publish
        sub.close()
        frames = collector.frames
        if frames:
            raise RuntimeError(f"the idle collector delivered {frames} frames: its workers were not idle")
        partial = None
        if spec.width is not None:  # the big model: + the partial update of its output layer
            partial = await _partial_idle(collector, policy, n)
    extra: dict[str, Any] = {
        "samples_ms": [x * 1e3 for x in latencies],
        "publish_ms": stats_ms(publish),
        "publish_samples_ms": [x * 1e3 for x in publish],
        "per_worker_applied_ms": {str(w): stats_ms(v) for w, v in sorted(per_worker.items())},
        "collector_startup_s": startup,
    }
    if partial is not None:
        extra["partial"] = partial
    return Series(stats_ms(latencies), extra=extra)


# The three kinds of update of the partial-update comparison, measured in rounds of one each.
PARTIAL_KINDS = ("whole", "after_whole", "partial")


async def _partial_round(collector: Any, policy: nn.Module, layer: nn.Module, model_id: str, wait: bool) -> list[float]:
    """One round: the whole model, then the output layer twice. Each changes the values it publishes
    first (untimed); returns the 3 durations of ``update_weights``. With ``wait=False`` each is
    followed (untimed) by waiting until every worker applied it."""
    import anyio

    out = []
    for kind in PARTIAL_KINDS:
        perturb(policy if kind == "whole" else layer, collector.policy_version + 1)
        t0 = time.perf_counter()
        if kind == "whole":
            version = await collector.update_weights(policy, wait=wait)
        else:
            version = await collector.update_weights(layer, model_id=model_id, wait=wait)
        out.append(time.perf_counter() - t0)
        if not wait:
            await _settle(collector, version)
            await anyio.sleep(0.002)  # let the acknowledgements' events go before the next publish
    return out


async def _partial_idle(collector: Any, policy: nn.Module, n: int) -> dict[str, Any]:
    """Partial update (the output layer only) against the whole model, on the idle collector of
    ``_aiocollect_idle``: ``n`` rounds (after ``WARMUP_UPDATES`` discarded) with ``wait=True``, then as
    many with ``wait=False``; then one untimed check that the workers really run the new layer."""
    model_id, layer = output_layer(policy)
    applied: dict[str, list[float]] = {k: [] for k in PARTIAL_KINDS}
    publish: dict[str, list[float]] = {k: [] for k in PARTIAL_KINDS}
    for wait, into in ((True, applied), (False, publish)):
        for i in range(WARMUP_UPDATES + n):
            durations = await _partial_round(collector, policy, layer, model_id, wait)
            if i >= WARMUP_UPDATES:
                for kind, dt in zip(PARTIAL_KINDS, durations, strict=True):
                    into[kind].append(dt)
    result: dict[str, Any] = {
        "model_id": model_id,
        "params": count_params(layer),
        "bytes": state_nbytes(layer),
        "rounds": n,
    }
    for kind in PARTIAL_KINDS:
        result[kind] = {
            "applied_ms": stats_ms(applied[kind]),
            "applied_samples_ms": [x * 1e3 for x in applied[kind]],
            "publish_ms": stats_ms(publish[kind]),
            "publish_samples_ms": [x * 1e3 for x in publish[kind]],
        }
    result["verified"] = await _verify_partial(collector, policy, layer, model_id)
    return result


async def _verify_partial(collector: Any, policy: nn.Module, layer: nn.Module, model_id: str) -> str:
    """Untimed: negate the output layer (every action flips) and publish it alone; check that every
    worker acknowledged that version, then collect one batch and check that it carries that version
    and that its actions are the local policy's (on 256 of its frames). The workers' other layers
    must equal the local ones too (they came from the whole-model updates). Returns ``"ok: ..."`` or
    what went wrong (``"FAILED: ..."``)."""
    with torch.no_grad():
        layer.weight.neg_()
        layer.bias.neg_()
    version = await collector.update_weights(layer, model_id=model_id)
    if min(collector.worker_versions) != version:
        return f"FAILED: worker versions {collector.worker_versions} after update_weights(wait=True) of version {version}"
    batch = (await collector.collect()).reshape(-1)
    versions = batch["collector", "policy_version"]
    if not bool((versions == version).all()):
        return f"FAILED: the batch carries versions {sorted(set(versions.tolist()))}, not {version}"
    idx = torch.linspace(0, batch.numel() - 1, min(256, batch.numel())).long()
    with torch.no_grad():
        expected = policy(batch["observation"][idx])
    same = int((batch["action"][idx] == expected).sum())
    if same != idx.numel():
        return f"FAILED: {same}/{idx.numel()} actions of the batch are the local policy's (version {version})"
    return (
        f"ok: version {version} (the output layer negated) applied by every worker; a batch collected after it "
        f"carries that version and {same}/{idx.numel()} of its actions checked are the local policy's (with the "
        f"output layer before the update, none would be)"
    )


async def _consume(collector: Any, arrivals: list[float]) -> None:
    async for _ in collector:
        arrivals.append(time.perf_counter())


async def _aiocollect_collecting(collector_cls: Any, spec: ModelSpec, args: argparse.Namespace, n: int) -> Series:
    import anyio
    from aiocollect import events as ev

    policy = build_model(spec)
    rng = random.Random(SEED)
    t_start = time.perf_counter()
    arrivals: list[float] = []
    async with _collector(collector_cls, policy, args, prefetch=2) as collector:
        startup = time.perf_counter() - t_start
        sub = collector.subscribe(ev.WeightsApplied, max_buffer=100_000)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_consume, collector, arrivals)
            deadline = time.monotonic() + SETTLE_TIMEOUT_S
            while len(arrivals) < WARMUP_BATCHES:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fewer than {WARMUP_BATCHES} batches after {SETTLE_TIMEOUT_S:g} s")
                await anyio.sleep(0.005)
            period0 = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
            latencies: list[float] = []
            per_worker: dict[int, list[float]] = {}
            batches0, t_measure = len(arrivals), time.perf_counter()
            for i in range(WARMUP_UPDATES_COLLECTING + n):
                period = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)  # mean so far
                await anyio.sleep(rng.uniform(0.0, period))
                perturb(policy, collector.policy_version + 1)
                t0 = time.perf_counter()
                await collector.update_weights(policy)
                dt = time.perf_counter() - t0
                if i >= WARMUP_UPDATES_COLLECTING:
                    latencies.append(dt)
                    _drain(sub, per_worker)
                else:
                    _drain(sub, {})
            batches = len(arrivals) - batches0
            measure_s = time.perf_counter() - t_measure
            tg.cancel_scope.cancel()
        sub.close()
    return Series(
        stats_ms(latencies),
        extra={
            "samples_ms": [x * 1e3 for x in latencies],
            "per_worker_applied_ms": {str(w): stats_ms(v) for w, v in sorted(per_worker.items())},
            "batch_period_ms_warmup": period0 * 1e3,
            "batch_period_ms": (measure_s / batches * 1e3) if batches else None,
            "batches_during_updates": batches,
            "collector_startup_s": startup,
        },
    )


async def _aiocollect_server(collector_cls: Any, spec: ModelSpec, args: argparse.Namespace, n: int,
                             device: str) -> Series:
    """Server inference (``inference="server"``, ``policy_device=device``), workers idle: the
    latency of ``update_weights(policy)`` (the trainer's module, on ``device`` too: a trainer
    there), which copies the weights into the server's own copy between two forward passes, and
    what that copy costs in memory (nominal: the state dict's bytes; on CUDA also the growth of
    ``torch.cuda.memory_allocated`` from before the collector to after its start)."""
    policy = build_model(spec).to(device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize(device)
        allocated0 = torch.cuda.memory_allocated(device)
    collector = collector_cls(
        ENV_ID, policy, frames_per_batch=args.frames_per_batch, total_frames=-1, num_workers=args.workers,
        envs_per_worker=args.envs_per_worker, prefetch=0, seed=SEED, inference="server", policy_device=device,
    )
    async with collector:
        await collector.update_weights(policy)  # (started, and the copy made)
        growth = torch.cuda.memory_allocated(device) - allocated0 if cuda else None
        latencies: list[float] = []
        for i in range(WARMUP_UPDATES + n):
            perturb(policy, collector.policy_version + 1)
            t0 = time.perf_counter()
            await collector.update_weights(policy)
            dt = time.perf_counter() - t0
            if i >= WARMUP_UPDATES:
                latencies.append(dt)
    return Series(stats_ms(latencies), extra={
        "device": device, "copy_bytes": state_nbytes(policy), "cuda_allocated_growth": growth,
        "samples_ms": [x * 1e3 for x in latencies],
    })


def run_aiocollect(kind: str, collector_cls: Any, spec: ModelSpec, args: argparse.Namespace, n: int) -> Series:
    import anyio

    if kind.startswith("server-"):
        return anyio.run(_aiocollect_server, collector_cls, spec, args, n, kind[len("server-"):],
                         backend_options={"use_uvloop": True})
    fn = _aiocollect_idle if kind == "idle" else _aiocollect_collecting
    return anyio.run(fn, collector_cls, spec, args, n, backend_options={"use_uvloop": True})


# --------------------------------------------------------------------------------------------------
# 3. the naive baseline: torch.save -> bytes -> multiprocessing Pipe -> torch.load -> load_state_dict


def _naive_worker(conn: Any, spec: ModelSpec) -> None:
    torch.set_num_threads(1)
    model = build_model(spec)
    conn.send_bytes(b"ready")
    try:
        while True:
            try:
                data = conn.recv_bytes()
            except EOFError:
                return
            if not data:  # b"": stop
                return
            state = torch.load(io.BytesIO(data), weights_only=True)
            model.load_state_dict(state)
            conn.send_bytes(b"ok")
    finally:
        conn.close()


def _recv_reply(conn: Any, proc: Any, what: str) -> bytes:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not conn.poll(0.1):
        if not proc.is_alive():
            raise RuntimeError(f"{proc.name} exited with code {proc.exitcode} (waiting for {what})")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name}: no {what} after {SETTLE_TIMEOUT_S:g} s")
    return conn.recv_bytes()


def run_naive(spec: ModelSpec, args: argparse.Namespace, n: int) -> Series:
    ctx = mp.get_context("spawn")
    model = build_model(spec)
    conns: list[Any] = []
    procs: list[Any] = []
    try:
        with child_signals():
            for rank in range(args.workers):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(target=_naive_worker, args=(child, spec), name=f"naive-{rank}", daemon=True)
                p.start()
                child.close()  # the worker's end: ours closed, so that a dead worker reads as EOF
                conns.append(parent)
                procs.append(p)
        t_start = time.perf_counter()
        for conn, p in zip(conns, procs, strict=True):
            _recv_reply(conn, p, "ready message")
        startup = time.perf_counter() - t_start
        latencies: list[float] = []
        serialize: list[float] = []
        nbytes = 0
        for i in range(WARMUP_UPDATES + n):
            perturb(model, i + 1)
            t0 = time.perf_counter()
            buf = io.BytesIO()
            torch.save(model.state_dict(), buf)
            data = buf.getvalue()
            t_ser = time.perf_counter()
            for conn in conns:
                conn.send_bytes(data)
            for conn, p in zip(conns, procs, strict=True):
                _recv_reply(conn, p, "acknowledgement")
            t1 = time.perf_counter()
            nbytes = len(data)
            if i >= WARMUP_UPDATES:
                latencies.append(t1 - t0)
                serialize.append(t_ser - t0)
    finally:
        for conn in conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send_bytes(b"")
        for p in procs:
            p.join(5.0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in conns:
            conn.close()
    return Series(
        stats_ms(latencies),
        extra={
            "samples_ms": [x * 1e3 for x in latencies],
            "serialize_ms": stats_ms(serialize),
            "message_bytes": nbytes,
            "workers_startup_s": startup,
        },
    )


# --------------------------------------------------------------------------------------------------
# driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=30, help="updates per series for the 4-64-2 MLP (default 30)")
    p.add_argument("--n-big", type=int, default=10, help="updates per series for the big MLP (default 10)")
    p.add_argument(
        "--big-params",
        type=int,
        default=10_000_000,
        help="target parameter count of the big MLP (default 10,000,000; 0 skips it)",
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--envs-per-worker", type=int, default=8, help="envs per worker (default 8)")
    p.add_argument("--frames-per-batch", type=int, default=2048, help="frames per batch (default 2048)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument(
        "--server-only",
        action="store_true",
        help="only the inference server's updates (its own copy of the weights), on the CPU and on CUDA if present",
    )
    p.add_argument(
        "--check-only",
        action="store_true",
        help="only the in-place change check (a few seconds: no collector, no worker is started)",
    )
    args = p.parse_args(argv)
    total = args.workers * args.envs_per_worker
    if args.workers < 1 or args.envs_per_worker < 1 or args.frames_per_batch % total:
        p.error(
            f"--frames-per-batch ({args.frames_per_batch}) must be a multiple of workers x envs-per-worker ({total})"
        )
    if args.n < 1 or args.n_big < 1:
        p.error("--n and --n-big must be at least 1")
    return args


def _shutdown_aiocollect_launcher() -> None:
    """Stop aiocollect's launcher (kept alive between collectors on purpose), if aiocollect was used."""
    if "aiocollect" in sys.modules:
        with contextlib.suppress(Exception):
            from aiocollect import shutdown_launcher

            shutdown_launcher()


def _cell(s: Series, keys: tuple[str, ...] = ("p50", "p90")) -> str:
    if not s.latency.get("n"):
        return "failed" if s.note else "-"
    return " / ".join(_ms(s.latency[k]) for k in keys) + " ms"


def _sub(s: Series, key: str, keys: tuple[str, ...] = ("p50", "p90")) -> str:
    d = s.extra.get(key) or {}
    if not d.get("n"):
        return "-"
    return " / ".join(_ms(d[k]) for k in keys) + " ms"


def _partial_table(spec: ModelSpec, part: dict[str, Any]) -> None:
    """The partial-update comparison (rounds of: whole model, output layer, output layer)."""
    log("")
    log(
        f"partial update ({spec.name}, output layer only: model_id={part['model_id']!r}, {part['params']:,} params, "
        f"{part['bytes'] / 1e3:.1f} kB), workers idle, {part['rounds']} interleaved rounds"
    )
    log(f"{'':<34} {'idle p50/p90':>18}  {'publish alone p50/p90':>22}  {'speed-up (p50) idle / publish':>29}")
    rows = (
        ("whole model", "whole"),
        ("output layer only", "partial"),
        ("output layer, after a whole update", "after_whole"),
    )
    whole = part["whole"]
    for label, kind in rows:
        r = part[kind]
        cells = [_pair(r["applied_ms"]), _pair(r["publish_ms"])]
        speedup = ""
        if kind != "whole":
            speedup = f"{_ratio(whole['applied_ms'], r['applied_ms'])} / {_ratio(whole['publish_ms'], r['publish_ms'])}"
        log(f"{label:<34} {cells[0]:>18}  {cells[1]:>22}  {speedup:>29}")
    log(
        "output layer only: steady state (the previous update was one of the layer too); after a whole update: the\n"
        "first one after a whole-model update, whose publisher also carries every tensor the whole update changed\n"
        "over into the other shared buffer (the workers still copy only the layer)"
    )
    if not part["verified"].startswith("ok"):
        log(f"WARNING: partial update check {part['verified']}")


def _pair(d: dict[str, float]) -> str:
    return "-" if not d.get("n") else f"{_ms(d['p50'])} / {_ms(d['p90'])} ms"


def _ratio(num: dict[str, float], den: dict[str, float]) -> str:
    if not num.get("n") or not den.get("n") or den["p50"] <= 0:
        return "-"
    return f"{num['p50'] / den['p50']:.1f}x"


def main(args: argparse.Namespace) -> int:
    become_subreaper()  # so that the leftover checks also see orphans of our children
    torch.set_num_threads(1)
    try:
        from aiocollect import Collector  # imported before machine(): its version in the output
    except Exception as exc:  # noqa: BLE001
        raise SystemExit(f"aiocollect does not import: {type(exc).__name__}: {exc}") from exc

    specs = [ModelSpec("mlp", "MLP 4-64-2")]
    if args.big_params > 0:
        width = width_for(args.big_params)
        specs.append(ModelSpec("big", f"MLP ~{args.big_params / 1e6:g}M", width))
    counts = {spec.key: (args.n if spec.width is None else args.n_big) for spec in specs}

    log(
        f"aiocollect weight-sync benchmark: {ENV_ID}, {args.workers} workers x {args.envs_per_worker} envs, "
        f"{args.frames_per_batch} frames/batch"
    )
    host = machine()
    log(machine_line(host))
    models: dict[str, dict[str, Any]] = {}
    for spec in specs:
        m = build_model(spec)
        info = {"name": spec.name, "params": count_params(m), "bytes": state_nbytes(m), "width": spec.width}
        models[spec.key] = info
        arch = "4-64-2 (ArgmaxMLP)" if spec.width is None else f"4-{spec.width}-{spec.width}-{spec.width}-2"
        log(
            f"model {spec.name}: {arch}, {info['params']:,} parameters, {info['bytes'] / 1e6:.3f} MB (float32), "
            f"{counts[spec.key]} updates per series (+{WARMUP_UPDATES} discarded; "
            f"{WARMUP_UPDATES_COLLECTING} while collecting)"
        )

    servers = ["server-cpu"] + (["server-cuda"] if torch.cuda.is_available() else [])
    kinds = servers if args.server_only else ["idle", "collecting", "naive", *servers]
    sections = [(spec, kind) for spec in specs for kind in kinds]
    if args.check_only:
        sections = []
    titles = {
        "server-cpu": "aiocollect, inference='server' on the CPU, workers idle: update_weights into the server's copy",
        "server-cuda": "aiocollect, inference='server' on CUDA (trainer's module there too), workers idle",
        "idle": "aiocollect, workers idle (prefetch=0, no request pending)",
        "collecting": "aiocollect while collecting (consumer pulls batches back to back, prefetch=2)",
        "naive": f"pickle + pipe: torch.save -> Pipe -> torch.load + load_state_dict in {args.workers} spawned workers",
    }
    results: dict[str, dict[str, Series]] = {spec.key: {} for spec in specs}
    leftovers: dict[str, list[str]] = {}
    for i, (spec, kind) in enumerate(sections, 1):
        title = f"{spec.name}: {titles[kind]}"
        log(f"[{i}/{len(sections)}] {title} ...")
        n = counts[spec.key]
        t0 = time.perf_counter()
        try:
            if kind == "naive":
                s = run_naive(spec, args, n)
            else:
                s = run_aiocollect(kind, Collector, spec, args, n)
        except Exception as exc:  # noqa: BLE001 - one failing section must not hide the others
            s = Series(note=f"FAILED: {_describe(exc)}")
        finally:
            left = reap(title)  # the launcher may stay (not its children, the workers)
            if left:
                leftovers[title] = left
        results[spec.key][kind] = s
        if s.note:
            log(f"  -> {s.note}")
            continue
        took = time.perf_counter() - t0
        log(f"  -> update to all workers applied: {_fmt(s.latency)}  [section {took:.1f} s]")
        if kind == "idle":
            log(f"     publish alone (update_weights(wait=False) returns): {_fmt(s.extra['publish_ms'])}")
        if kind.startswith("server-"):
            growth = s.extra["cuda_allocated_growth"]
            log(
                f"     the server's own copy of the weights: {_size(s.extra['copy_bytes'])} more on "
                f"{s.extra['device']}"
                + ("" if growth is None else f" (torch.cuda.memory_allocated grew {_size(growth)} with the collector)")
            )
        if kind == "naive":
            log(
                f"     serialize alone (torch.save to bytes, {s.extra['message_bytes'] / 1e6:.3f} MB): "
                f"{_fmt(s.extra['serialize_ms'])}"
            )
        if kind in ("idle", "collecting"):
            per = s.extra["per_worker_applied_ms"]
            log("     WeightsApplied latency per worker: "
                + "; ".join(f"worker {w}: {_fmt(d, ('p50', 'max'))}" for w, d in per.items()))  # fmt: skip
        part = s.extra.get("partial")
        if part:
            log(
                f"     partial update, model_id={part['model_id']!r} ({part['params']:,} params), applied: "
                f"{_fmt(part['partial']['applied_ms'])}; publish alone: {_fmt(part['partial']['publish_ms'])}"
            )
            log(f"     partial update check: {part['verified']}")
        if kind == "collecting":
            bp = s.extra["batch_period_ms"]
            log(
                f"     batch period: {_ms(s.extra['batch_period_ms_warmup'])} ms in the warm-up, "
                f"{'-' if bp is None else _ms(bp)} ms during the updates ({s.extra['batches_during_updates']} batches)"
            )
    _shutdown_aiocollect_launcher()
    left = reap("the launcher's shutdown", keep=MP_HELPERS)
    if left:
        leftovers["aiocollect launcher"] = left

    if args.server_only:
        _server_table(specs, models, results)
        return _write_json(args, host, models, results, leftovers, {})
    log("[check] the in-place change check (per batch handed out) and its reference (per publish) ...")
    checks = {spec.key: measure_check(spec) for spec in specs}
    checks["nature_cnn"] = measure_check(None)
    if args.check_only:
        _check_table(specs, checks, results)
        return _write_json(args, host, models, results, leftovers, checks)

    # ---- summary
    log("")
    head = (
        f"{'model':<16} {'params':>11} {'size':>9}  {'aiocollect idle p50/p90':>24}  "
        f"{'aiocollect collecting p50/p90':>29}  {'pickle+pipe p50/p90':>21}  {'speed-up (idle p50)':>19}"
    )
    log(head)
    for spec in specs:
        info, r = models[spec.key], results[spec.key]
        idle, coll, naive = r["idle"], r["collecting"], r["naive"]
        speedup = "-"
        if idle.latency.get("n") and naive.latency.get("n") and idle.latency["p50"] > 0:
            speedup = f"{naive.latency['p50'] / idle.latency['p50']:.1f}x"
        log(
            f"{spec.name:<16} {info['params']:>11,} {info['bytes'] / 1e6:>6.2f} MB  {_cell(idle):>24}  "
            f"{_cell(coll):>29}  {_cell(naive):>21}  {speedup:>19}"
        )
    log("")
    head2 = (
        f"{'model':<16} {'publish alone p50/p90':>22}  {'serialize (naive) p50/p90':>26}  {'max: idle':>10}"
        f"  {'collecting':>10}  {'pickle+pipe':>11}  {'batch period':>12}"
    )
    log(head2)
    for spec in specs:
        r = results[spec.key]
        idle, coll, naive = r["idle"], r["collecting"], r["naive"]
        bp = coll.extra.get("batch_period_ms")
        log(
            f"{spec.name:<16} {_sub(idle, 'publish_ms'):>22}  {_sub(naive, 'serialize_ms'):>26}  "
            f"{_cell(idle, ('max',)):>10}  {_cell(coll, ('max',)):>10}  {_cell(naive, ('max',)):>11}  "
            f"{'-' if bp is None else _ms(bp) + ' ms':>12}"
        )
    log(
        "idle: transfer + apply only; collecting: + waiting for the batch in progress (about U(0, batch period));\n"
        "publish alone: update_weights(wait=False), the trainer's side; serialize: torch.save of the state dict"
    )
    for spec in specs:
        part = results[spec.key]["idle"].extra.get("partial")
        if part:
            _partial_table(spec, part)
    _server_table(specs, models, results)
    _check_table(specs, checks, results)
    if leftovers:
        log(f"WARNING: processes were left running after: {'; '.join(leftovers)} (terminated)")
    return _write_json(args, host, models, results, leftovers, checks)


def _server_table(specs: list[ModelSpec], models: dict[str, dict[str, Any]],
                  results: dict[str, dict[str, Series]]) -> None:
    """Server inference: an update's latency and the memory of the server's own copy, per device."""
    log("")
    log("inference='server': update_weights(policy) copies into the server's own weights (between two forward passes)")
    log(f"{'model':<16} {'device':>7} {'update p50/p90':>20} {'max':>10}  {'extra memory (one copy)':>24}")
    for spec in specs:
        for kind, s in results[spec.key].items():
            if not kind.startswith("server-"):
                continue
            memory = "-"
            if s.latency.get("n"):
                growth = s.extra["cuda_allocated_growth"]
                memory = _size(s.extra["copy_bytes"]) + ("" if growth is None else f" ({_size(growth)})")
            log(f"{spec.name:<16} {kind[len('server-'):]:>7} {_cell(s):>20} {_cell(s, ('max',)):>10}  {memory:>24}")
    log("extra memory: the state dict's bytes (in brackets on CUDA: torch.cuda.memory_allocated's growth with the\n"
        "collector, which also holds the forward passes' own buffers)")


def _size(nbytes: int) -> str:
    """Bytes in kB or MB (10^3, 10^6)."""
    return f"{nbytes / 1e3:.1f} kB" if abs(nbytes) < 1e6 else f"{nbytes / 1e6:.2f} MB"


def _check_table(specs: list[ModelSpec], checks: dict[str, Any], results: dict[str, dict[str, Series]]) -> None:
    """The check's cost per batch beside what a publish costs (where measured)."""
    log("")
    log("in-place change check: collector.collect() reads the policy's version counters and gradients (a policy")
    log("trained in place but never published is reported once); its reference is taken again at each publish")
    log(f"{'model':<16} {'tensors':>7} {'params':>11}  {'check per batch p50/p90':>24}  {'reference per publish':>22}"
        f"  {'publish alone p50':>17}")  # fmt: skip
    rows = [(spec.name, spec.key) for spec in specs] + [("Nature CNN", "nature_cnn")]
    for name, key in rows:
        c = checks[key]
        idle = results.get(key, {}).get("idle")
        publish = _sub(idle, "publish_ms", ("p50",)) if idle is not None else "-"
        log(f"{name:<16} {c['tensors']:>7} {c['params']:>11,}  {_us_pair(c['check_ms']):>24}  "
            f"{_us_pair(c['mark_ms']):>22}  {publish:>17}")


def _us_pair(d: dict[str, float]) -> str:
    return f"{d['p50'] * 1e3:.2f} / {d['p90'] * 1e3:.2f} us"


def _write_json(args: argparse.Namespace, host: dict, models: dict, results: dict, leftovers: dict,
                checks: dict) -> int:
    if args.json:
        payload = {
            "benchmark": "weight_sync",
            "env": ENV_ID,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **host,
            "args": vars(args),
            "warmup_updates": WARMUP_UPDATES,
            "warmup_updates_collecting": WARMUP_UPDATES_COLLECTING,
            "models": models,
            "results": {key: {kind: asdict(s) for kind, s in r.items()} for key, r in results.items()},
            "leftover_processes": leftovers,
            "inplace_check": checks,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        log(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    _args = parse_args()
    with sigterm_as_interrupt():
        try:
            sys.exit(main(_args))
        except KeyboardInterrupt:
            log("interrupted; stopping everything this benchmark started")
            sys.exit(130)
        finally:
            _shutdown_aiocollect_launcher()
            reap("the benchmark", keep=MP_HELPERS, grace_s=1.0)
