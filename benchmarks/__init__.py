"""asyncckpt's benchmarks: training stall per checkpointing method, compression, and the cost model.

Run from a source checkout: ``python -m benchmarks.stall_time``, ``python -m benchmarks.compression``,
``python -m benchmarks.cost_model`` (or ``asyncckpt bench stall|compression|cost``). Committed
results live in ``benchmarks/results/``; ``benchmarks/run_h200.sh`` runs everything on one GPU.
"""
