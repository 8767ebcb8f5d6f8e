"""Rank groups: a tensor-parallel instance's processes, its group, leases and step channels.

group: the torch.distributed group and its CPU channels; processes: rank 0 starts the others;
prefill: the passes rank 0 describes and every rank runs; decode: the steps and write leases
rank 0 sends and every rank follows. The model's own split (which heads a rank holds) stays in
model/layers/tensor_parallel.py, below this package.
"""
