"""Benchmark scripts (GPU figures in bench/RESULTS.md). Run them as `python bench/<script>.py` or
`python -m bench.<script>`; `bench.common` holds the shared timing, CSV, plot and environment
helpers."""
