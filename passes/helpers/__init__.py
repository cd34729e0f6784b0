"""What the passes share and are not passes themselves.

Graph queries, per-op bytes, the recorded segments and dedupe of repeated blocks, attention
cores, the summary the planner reads, the invariants checked between passes, and
``estimate``'s measurement (a layer run on fake tensors, and its ``LayerCost``).
"""
