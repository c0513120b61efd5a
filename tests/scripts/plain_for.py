"""A plain script that never closes its collector (issue 14: it hung at exit). Prints the worker
pids, then ends as `sys.argv[1]` says: end, break, raise, endless_break."""

import sys

from aiocollect import Collector

mode = sys.argv[1]
c = Collector("CartPole-v1", frames_per_batch=512, total_frames=-1 if mode == "endless_break" else 2048, num_workers=2)
n = 0
for batch in c:
    n += 1
    if n == 1:
        print("pids", *c.worker_pids, flush=True)
    if mode in ("break", "endless_break") and n == 2:
        break
    if mode == "raise" and n == 2:
        raise RuntimeError("the training step failed")
