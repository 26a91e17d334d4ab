"""Benchmarks of the whole service: load generator, peer server, queue overhead, report."""
