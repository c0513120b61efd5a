"""A training script run from a terminal and stopped with Ctrl-C (the terminal sends SIGINT to its
foreground process group: this script's). Prints its workers' pids with their session, process
group, niceness and autogroup niceness, then "collecting"; on Ctrl-C, what it collected and
"interrupted"."""

import asyncio
import faulthandler
import os
import signal
import sys

import torch

from aiocollect import Collector, Evaluator


class Greedy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    def forward(self, observation):
        return self.net(observation).argmax(-1)


policy = Greedy()
faulthandler.register(signal.SIGUSR1, all_threads=True)  # (the test asks for the stacks if it hangs)
# A job of a terminal starts with Ctrl-C's default action; one started in the background by a
# non-interactive shell (as CI may run the tests) inherits SIGINT ignored, and asyncio.run() then
# leaves it so. Start as a terminal's job would.
signal.signal(signal.SIGINT, signal.default_int_handler)
batches = 0
continuity = True


async def main() -> None:
    global batches, continuity
    async with (Collector("CartPole-v1", policy, frames_per_batch=256, num_workers=2, seed=0) as c,
                Evaluator("CartPole-v1", policy, num_trajectories=2, nice=5) as ev):
        async for batch in c:
            obs, nxt, done = batch["observation"], batch["next", "observation"], batch["next", "done"][..., 0]
            continuity &= bool(((nxt[:, :-1] == obs[:, 1:]).all(-1) | done[:, :-1]).all())
            with torch.no_grad():
                policy.net[0].weight.add_(0.01)
            await c.update_weights(policy)
            batches += 1
            if batches == 1:
                await ev.evaluate(policy)  # its worker is up
                for pid in [*c.worker_pids, ev.worker_pid]:
                    try:
                        with open(f"/proc/{pid}/autogroup") as f:  # "/autogroup-N nice K"
                            group = f.read().split()[-1]
                    except OSError:  # a kernel without autogroups
                        group = "-"
                    print("worker", pid, os.getsid(pid), os.getpgid(pid), os.getpriority(os.PRIO_PROCESS, pid), group,
                          flush=True)
                print("me", os.getpid(), os.getsid(0), os.getpgid(0), flush=True)
                print("collecting", flush=True)


try:
    asyncio.run(main())
except KeyboardInterrupt:
    print("batches", batches, "continuity", continuity, flush=True)
    print("interrupted", flush=True)
    sys.exit(130)
