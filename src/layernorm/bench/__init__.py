"""Benchmarks: programs that time the backends and save what they measured (never tests).

    harness    timing: batches, interleaved rounds, threads, first-call latency in a fresh process
    providers  the CPU implementations timed, keyed by (norm, backend)
    results    JSON files, tables and plots of the CPU rows
    machine    the machine and library versions every result carries
    yardstick  the copy whose bandwidth every pass is compared with
    gpu        the GPU benchmark (CUDA events, L2 flushes, its own providers and result files)

Optional libraries (torch, triton, matplotlib) are imported only where used.
"""
