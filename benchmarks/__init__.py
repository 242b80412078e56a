"""lorasync's benchmark suite: bytes per sync, publish latency against floors, real-vLLM
time to first completion, fan-out, and merged-fold memory.

Run ``lorasync bench [NAME ...] [--quick]`` or ``python -m benchmarks [NAME ...]``; each
benchmark module also runs alone (``python -m benchmarks.publish --shape qwen3-8b``). Results
go to ``./bench-out`` as JSON, markdown and PNG; ``docs/benchmarks.md`` records a run.
"""
