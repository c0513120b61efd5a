"""The evaluator: its options, its run and the public :class:`~aiocollect.Evaluator`."""
