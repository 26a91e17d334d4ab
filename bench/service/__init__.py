"""Benchmarks of the whole service over HTTP: lmq beside llama.cpp's server, the queue's own cost, Redis saturation, priorities."""
