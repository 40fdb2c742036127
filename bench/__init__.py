"""tpustream's benchmarks, each run from the repository root as python -m bench.<name>."""
