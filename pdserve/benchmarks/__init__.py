"""Studies: scripts that measure one question and publish its figures (`python -m
pdserve.benchmarks.<name>` writes docs/results/<name>.json and its section of docs/benchmarks.md).
`report.py` and `timing.py` are what they share; `pdserve bench` itself is pdserve/bench_serving.py."""
