"""The parent's side of each kind of worker: the launcher and its forked processes, Ray actors,
the evaluator's worker process. It imports the worker side and the ground floor."""
