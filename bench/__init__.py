"""Benchmarks (not part of the product): see docs/performance.md."""
