"""The ground floor: what both sides of the process boundary share (errors, the wire, the batch
layout and its data checks, shared memory, limits, heartbeats, pickling, the env registry,
profiling settings). It imports nothing else of the package but :mod:`aiocollect.events`."""
