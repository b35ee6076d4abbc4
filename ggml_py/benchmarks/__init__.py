"""Benchmarks run by `ggml-py bench NAME`. Built-in: reuse, model; backends add theirs through the
`ggml_py.benchmarks` entry-point group (e.g. the simd backend's `ops`)."""
