"""The module names of the shared decoder skeleton (models/common/decoder.py), stated once.

The skeleton registers its parts under these names, and every family's ParallelPlan names them from here
(``blocks``, ``embedding``, ``final_norm``, ``output``): the core finds the blocks through the plan only, and the
decoder counts its own parameters with the same names.
"""
from __future__ import annotations

BLOCKS = "layers"
"""The ModuleDict of the transformer blocks, keyed '0', '1', ... (ParallelPlan.blocks)."""
EMBEDDING = "tok_embeddings"
"""The token embedding (ParallelPlan.embedding)."""
FINAL_NORM = "norm"
"""The RMSNorm after the last block (ParallelPlan.final_norm)."""
OUTPUT = "output"
"""The output projection to the vocabulary (ParallelPlan.output)."""
