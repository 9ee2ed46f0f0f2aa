"""fastmt benchmarks: kernel harness (`python -m bench.kernels`), the speedup ladder
(`python -m bench.ladder`), profiling (`python -m bench.profile`), and the GPU runbook."""
