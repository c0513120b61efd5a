"""What the collector and the evaluator share in the parent: the event bus, the public fronts'
base, owned tasks, the supervisor of worker failures, the progress bar."""
