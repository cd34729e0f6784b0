"""Tensor parallelism on the graph.

Per-op strategy rules, the CP-SAT chooser of one strategy per node, and the rewrite that
applies a choice.
"""
