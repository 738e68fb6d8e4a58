"""Qwen3-MoE's parallel plan, as data (applied by torchtitan_lite/distributed/parallelize.py), and its run rules.

Tensor parallelism: the attention as Llama 3's (q / k / v column-parallel, wo row-parallel, so each rank
holds n_heads / tp query and n_kv_heads / tp key/value heads) with the QK-norm applied to each rank's own
heads (it normalises over head_dim, so it needs no communication; its weights' gradients are summed over
the ranks); sequence-parallel norms, vocabulary-parallel embedding, output and loss as Llama 3. The MoE
feed-forward runs expert tensor parallel (torchtitan_lite/distributed/expert_tensor_parallel.py): its input
is gathered over the sequence, the router runs replicated on the same tokens in float32 (so every rank
makes the same choices and counts the same tokens per expert), every expert's hidden dim is split over the
ranks and the partial outputs are reduce-scattered back to the sequence-parallel layout.

FSDP2 / HSDP shards every parameter over the data ranks (the 3-D expert weights on their expert dim).
Under expert parallelism (parallelism.ep) the experts are split over the EP ranks with all-to-all token
dispatch, and FSDP shards them over the ranks left (expert_fsdp_mesh); every other parameter is sharded
over dp_shard as without EP. EP composes with TP: the TP ranks of one data rank route the same gathered
tokens, so each exchanges them within its own EP group (the ranks of its tp coordinate), computes its
hidden-dim slice of its local experts and gets partial outputs back, which the MoE region's reduce-scatter
sums as under TP alone; the expert weights are then DTensors on the (ep, tp) mesh (experts over ep, hidden
dim over tp).
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

QWEN3_MOE_PARALLEL_PLAN: ParallelPlan = build_tp_plan(
    BlockTPPlan(
        inputs=(TPInput("attention", ("attention.wq", "attention.wk", "attention.wv"), "attention input", n_inputs=2),),
        rowwise=("attention.wo",),
        norms=("attention_norm", "ffn_norm"),
        head_norms=("attention.q_norm", "attention.k_norm"),
        moe=MoETPPlan(
            module="moe", router="moe.router", experts="moe.experts",
            # Flavors with shared experts (MoEArgs.num_shared_experts) split them as a dense SwiGLU.
            shared_colwise=("moe.shared_experts.w1", "moe.shared_experts.w3"),
            shared_rowwise=("moe.shared_experts.w2",),
        ),
    ),
    blocks=BLOCKS,
    embedding=EMBEDDING,
    output=OUTPUT,
    final_norm=FINAL_NORM,
    experts="moe.experts",
    # Under EP: everything of a block but the MoE layer's dispatch and combine.
    ep_compile_regions=("attention_norm", "attention", "ffn_norm", "moe.router", "moe.experts"),
)

def check_qwen3_moe_run(facts: RunFacts) -> None:
    """The family's rules on a resolved run (ModelSpec.check_run): refused before launch by --check-config.
    (The attention heads' split over tp is ParallelDims.validate_for_model's, expert parallelism's
    resolve_run's check_expert_parallel.)"""
    moe = facts.model_args.moe
    check_grouped_mm_compile_dtype(moe.use_grouped_mm, facts.compile_model, facts.param_dtype)
    if facts.tp > 1:
        check_expert_tp(moe.hidden_dim, facts.tp, moe.use_grouped_mm)
