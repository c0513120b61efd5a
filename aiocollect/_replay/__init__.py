"""The replay buffer and its samplers."""
