"""Llama 3's parallel plan, as data.

The plan (``LLAMA3_PARALLEL_PLAN``) is the one place that says which Linear TP splits how and what the FSDP
units are; the trainer's parallelize step (torchtitan_lite/distributed/parallelize.py, which also says in
what order the parallelisms are applied), the memory estimate and the dry run all read it.
"""
from __future__ import annotations

from models.common.decoder_names import BLOCKS, EMBEDDING, FINAL_NORM, OUTPUT
from torchtitan_lite.protocols.model_spec import BlockTPPlan, ParallelPlan, TPInput, build_tp_plan

LLAMA3_PARALLEL_PLAN: ParallelPlan = build_tp_plan(
    BlockTPPlan(
        inputs=(
            # attention(x, rope_cache): the rotary table passes through whole.
            TPInput("attention", ("attention.wq", "attention.wk", "attention.wv"), "attention input", n_inputs=2),
            TPInput("feed_forward", ("feed_forward.w1", "feed_forward.w3"), "feed_forward input"),
        ),
        rowwise=("attention.wo", "feed_forward.w2"),
        norms=("attention_norm", "ffn_norm"),
    ),
    blocks=BLOCKS,
    embedding=EMBEDDING,
    output=OUTPUT,
    final_norm=FINAL_NORM,
)

