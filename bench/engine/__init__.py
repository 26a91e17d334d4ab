"""Benchmarks of the engine in one process: speed beside transformers, weight-mode quality, grammar cost."""
