"""Benchmark harnesses (run as modules: ``python -m benchmarks.<name>``)."""
