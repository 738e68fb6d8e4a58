"""DeepSeek-V3's parallel plan, as data (applied by torchtitan_lite/distributed/parallelize.py), and its run rules.

Tensor parallelism of multi-head latent attention: the attention input is gathered over the sequence and
read by the low-rank down-projections (wq_a, wkv_a) and their norms (q_norm, kv_norm), which every TP rank
runs whole with replicated weights (their gradients are summed over the ranks, each rank's being the share
of its own heads); the up-projections (wq_b, or wq in a flavor with full-rank queries, and wkv_b) are
column-parallel by heads, so each rank holds n_heads / tp query, key and value heads and the shared rotary
key part; the attention core runs on the local heads and wo is row-parallel. The first dense blocks' SwiGLU
is split as Llama 3's; the MoE blocks run expert tensor parallel as Qwen3-MoE's (the input gathered, the
router replicated, every routed and shared expert's hidden dim split, the partial output reduce-scattered).
Sequence-parallel norms, vocabulary-parallel embedding, output and loss as Llama 3.

Data parallelism: FSDP2 / HSDP over every parameter, the 3-D expert weights sharded on their expert dim.
Expert parallelism (parallelism.ep) splits the routed experts of every MoE block over the EP ranks with
all-to-all token dispatch (MoE.shard_experts, models/common/moe/layer.py) and FSDP shards them over the ranks left
(expert_fsdp_mesh); the dense first blocks, the shared experts, the routers and their expert biases are
data-parallel as without EP. EP composes with TP as in Qwen3-MoE (the expert weights on the (ep, tp) mesh).
"""
from __future__ import annotations

from models.common.decoder_names import BLOCKS, EMBEDDING, FINAL_NORM, OUTPUT
from models.common.moe.checks import check_expert_tp, check_grouped_mm_compile_dtype
from torchtitan_lite.protocols.model_spec import (
    BlockTPPlan,
    MoETPPlan,
    ParallelPlan,
    RunFacts,
    TPInput,
    build_tp_plan,
)

DEEPSEEK_V3_PARALLEL_PLAN: ParallelPlan = build_tp_plan(
    BlockTPPlan(
        inputs=(
            # wq exists only with full-rank queries (q_lora_rank=0), wq_a / q_norm / wq_b only with low-rank ones.
            TPInput("attention", ("attention.wq", "attention.wq_a", "attention.wkv_a"), "attention input", n_inputs=2),
            # The first n_dense_layers blocks.
            TPInput("feed_forward", ("feed_forward.w1", "feed_forward.w3"), "feed_forward input"),
        ),
        rowwise=("attention.wo", "feed_forward.w2"),
        norms=("attention_norm", "ffn_norm"),
        replicated=("attention.wq_a", "attention.q_norm", "attention.wkv_a", "attention.kv_norm"),
        colwise_from_replicated=("attention.wq_b", "attention.wkv_b"),
        moe=MoETPPlan(
            module="moe", router="moe.router", experts="moe.experts",
            shared_colwise=("moe.shared_experts.w1", "moe.shared_experts.w3"),
            shared_rowwise=("moe.shared_experts.w2",),
        ),
    ),
    blocks=BLOCKS,
    embedding=EMBEDDING,
    output=OUTPUT,
    final_norm=FINAL_NORM,
    experts="moe.experts",
    # Under EP: everything of an MoE block but the MoE layer's dispatch and combine; a dense block compiles whole.
    ep_compile_regions=("attention_norm", "attention", "ffn_norm", "moe.router", "moe.experts", "moe.shared_experts"),
)

def check_deepseek_v3_run(facts: RunFacts) -> None:
    """The family's rules on a resolved run (ModelSpec.check_run): refused before launch by --check-config.
    (The attention heads' split over tp is ParallelDims.validate_for_model's, expert parallelism's
    resolve_run's check_expert_parallel.)"""
    args = facts.model_args
    moe = args.moe
    check_grouped_mm_compile_dtype(moe.use_grouped_mm, facts.compile_model, facts.param_dtype)
    if facts.tp > 1:
        check_expert_tp(moe.hidden_dim, facts.tp, moe.use_grouped_mm)
        if args.n_dense_layers and args.dense_hidden_dim % facts.tp:
            raise ValueError(
                f"parallelism.tp={facts.tp} must divide the dense blocks' dense_hidden_dim={args.dense_hidden_dim} "
                f"(their SwiGLU is split by hidden channels); use a tp among the divisors of {args.dense_hidden_dim}")
