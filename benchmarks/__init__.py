"""asyncckpt's benchmarks: training stall per checkpointing method, compression, and the GPU path's limits.

Run from a source checkout: ``python -m benchmarks.stall_time``, ``python -m benchmarks.compression``
(or ``asyncckpt bench stall|compression``). Committed results live in ``benchmarks/results/``;
``benchmarks/run_h200.sh`` runs everything on one GPU. The cost model and the tool that writes the
results into ``docs/benchmarks.md`` are scripts in ``docs/tools/``.
"""
