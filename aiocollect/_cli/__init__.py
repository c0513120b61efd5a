"""``python -m aiocollect``: ``info`` and ``bench``."""
