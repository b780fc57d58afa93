"""The GPU check's parts (benchmarks/gpu_check.py runs them): random-weight models, the parts, the summary."""
