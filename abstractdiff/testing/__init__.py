"""Reusable conformance harness (scenarios, check_backend, compare_backends)."""
