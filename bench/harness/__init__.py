"""Shared pieces of the benchmarks: clients, timing, prompts, processes, peers, reports."""
