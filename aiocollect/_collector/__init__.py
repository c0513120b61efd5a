"""The collector: its options, its run (start-up, producing batches, weights, server inference)
and the public :class:`~aiocollect.Collector`."""
