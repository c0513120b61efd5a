"""examples/training_server.py as a user runs it: a real uvicorn serving the Starlette app on
127.0.0.1, talked to with httpx while it collects and trains; every endpoint checked; Ctrl-C
(SIGINT) shuts it down with the collector closed and no worker left."""

from __future__ import annotations

import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import anyio
import pytest
from procs import alive

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "training_server.py"


class Server:
    """The example in a process of its own; its stdout read by a thread, line by line."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--port", "0", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        self.interrupted = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    async def started(self, timeout: float = 60) -> tuple[str, list[int]]:
        """The URL it listens on and its workers' pids, once it says so."""
        with anyio.fail_after(timeout):
            while True:
                found = re.search(r"listening on (http://[\d.]+:\d+)", self.output)
                if found:
                    workers = re.search(r"collector started: workers \[([\d, ]*)\]", self.output)
                    pids = [int(p) for p in workers.group(1).split(",")] if workers else []
                    return found.group(1), pids
                assert self.proc.poll() is None, f"the server exited:\n{self.output}"
                await anyio.sleep(0.05)

    def interrupt(self) -> None:
        """Ctrl-C, as in a terminal (once: a second one would make uvicorn quit at once)."""
        if self.proc.poll() is None and not self.interrupted:
            self.proc.send_signal(signal.SIGINT)
            self.interrupted = True

    def stop(self, timeout: float = 30) -> int:
        """Ctrl-C, and the exit status."""
        self.interrupt()
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(5)
            if self.proc.stdout is not None:
                self.proc.stdout.close()


async def read_sse(lines: Any, until: set[str], limit: float = 30) -> list[tuple[str, dict]]:
    """Server-sent events from ``lines`` (a response's ``aiter_lines()``: ``event:`` / ``data:``
    lines, a blank line ends a message) until each name in ``until`` was seen."""
    events: list[tuple[str, dict]] = []
    name, data = None, None
    with anyio.fail_after(limit):
        async for line in lines:
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
            elif line == "" and name is not None:
                events.append((name, data))
                name, data = None, None
                if until <= {n for n, _ in events}:
                    break
    return events


@pytest.mark.timeout(120)
async def test_the_training_server_answers_every_endpoint_while_it_collects_and_stops_cleanly():
    server = Server("--num-workers", "2", "--envs-per-worker", "2", "--frames-per-batch", "256",
                    "--publish-every", "2")
    try:
        url, workers = await server.started()
        assert len(workers) == 2 and all(alive(p) for p in workers), server.output
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            health = await client.get("/health")
            assert health.status_code == 200 and health.json() == {"status": "ok", "collector": "running",
                                                                   "error": None}
            # frames come and keep coming (polled: on a loaded machine the first batch may take a while)
            with anyio.fail_after(60):
                while (first := (await client.get("/stats")).json())["frames"] == 0:
                    await anyio.sleep(0.2)
                while True:
                    second = (await client.get("/stats")).json()
                    if second["frames"] > first["frames"] and second["train_steps"] > 0 and second["episodes"] > 0:
                        break
                    await anyio.sleep(0.2)
            assert second["frames"] > first["frames"] > 0, (first, second)
            assert second["train_steps"] > 0 and second["last_loss"] is not None
            assert second["worker_pids"] == workers and second["loop_lag"]["samples"] > 0
            assert second["episodes"] > 0 and second["mean_return"] > 0

            published = (await client.post("/weights")).json()
            assert published["applied"] is True and published["version"] > second["policy_version"]
            assert (await client.get("/stats")).json()["policy_version"] >= published["version"]

            # the event stream: episodes with their returns, batches, weights published and applied
            async with client.stream("GET", "/events") as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                events = await read_sse(response.aiter_lines(), {"episode_ended", "batch_ready", "weights_updated",
                                                   "weights_applied"})
            episodes = [d for n, d in events if n == "episode_ended"]
            assert all(d["ret"] > 0 and d["length"] > 0 and d["worker"] in (0, 1) for d in episodes), episodes
            batches = [d for n, d in events if n == "batch_ready"]
            assert all(d["frames"] == 256 for d in batches), batches
            applied = [d for n, d in events if n == "weights_applied"]
            assert all(d["version"] > published["version"] - 1 and d["latency"] >= 0 for d in applied)

            # a chosen type only; an unknown one is refused with the known ones
            async with client.stream("GET", "/events", params={"types": "weights_applied"}) as response:
                only = await read_sse(response.aiter_lines(), {"weights_applied"})
            assert {n for n, _ in only} == {"weights_applied"}
            bad = await client.get("/events", params={"types": "bogus"})
            assert bad.status_code == 400 and "episode_ended" in bad.json()["error"]

            # clients that leave mid-stream take nothing with them: the server goes on
            for _ in range(3):
                async with client.stream("GET", "/events") as response:
                    await read_sse(response.aiter_lines(), {"episode_ended"})
            later = (await client.get("/stats")).json()
            assert later["frames"] > second["frames"] and later["error"] is None
            with anyio.move_on_after(10):  # (the server hears of a disconnect when it next sends)
                while later["event_streams"]:
                    await anyio.sleep(0.1)
                    later = (await client.get("/stats")).json()
            assert later["event_streams"] == 0, "a stream the client left is still open on the server"

            # Ctrl-C while a client holds a stream open: the stream ends (with an `end` message)
            # before uvicorn's graceful wait, then the lifespan closes the collector
            async with client.stream("GET", "/events", params={"types": "batch_ready"}) as response:
                lines = response.aiter_lines()
                await read_sse(lines, {"batch_ready"})
                server.interrupt()
                rest = await read_sse(lines, {"end"})
            assert rest[-1][0] == "end", rest
    finally:
        status = server.stop()
    assert status == 0, server.output
    assert "collector closed" in server.output and "server stopped" in server.output, server.output
    deadline = time.monotonic() + 5
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        await anyio.sleep(0.05)
    assert not [p for p in workers if alive(p)], f"workers left running after shutdown:\n{server.output}"


@pytest.mark.timeout(60)
async def test_the_server_without_collection_answers_and_says_so():
    """``--no-collect``: the same app idle (what benchmarks/server_load.py compares against)."""
    server = Server("--no-collect")
    try:
        url, workers = await server.started()
        assert workers == []
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get("/health")).json()["collector"] == "off"
            stats = (await client.get("/stats")).json()
            assert stats["collector"] == "off" and "frames" not in stats
            assert (await client.post("/weights")).status_code == 409
            assert (await client.get("/events")).status_code == 409
    finally:
        assert server.stop() == 0, server.output
