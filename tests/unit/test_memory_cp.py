"""The memory estimate under context parallelism: a rank's activations are its chunk's (seq_len / cp tokens),
attention's gathered K/V are sized from the family's attention shape (GQA: the rank's K and V heads; MLA: the
expanded K and V plus the gathered latent), full AC turns them from saved into a transient, and the attention
mask is counted where it is dense."""
from __future__ import annotations

import copy

import config_registry
from torchtitan_lite.memory.estimate import estimate_memory, estimate_run_memory
from torchtitan_lite.protocols.model_size import expert_layout_text
from torchtitan_lite.resolved_run import resolve_run


def _estimate(name: str, *, world_size: int, device_type: str = "cpu", **overrides):
    config = config_registry.get(name)
    for key, value in overrides.items():
        section, field = key.split("__")
        setattr(getattr(config, section), field, value)
    return estimate_memory(config, world_size=world_size, device_type=device_type)


def test_activations_norms_head_and_loss_are_the_chunk_s():
    """FSDP over 2 ranks either way (dp_shard 2, or cp 2 folded into FSDP): the model's bytes are equal, every
    per-token term halves."""
    whole = _estimate("llama3_debug", world_size=2, parallelism__dp_shard=2)
    chunk = _estimate("llama3_debug", world_size=2, parallelism__dp_shard=1, parallelism__cp=2)
    for name in ("parameters", "gradients", "optimizer states"):
        assert chunk[name] == whole[name], name
    for name in ("activations", "head activations", "loss transient"):
        assert 2 * chunk[name] == whole[name], name
    assert "CP 2" in chunk.layout


def test_a_causal_run_without_cp_gets_no_context_parallel_rows():
    names = [t.name for t in _estimate("llama3_debug", world_size=2).terms]
    assert not any(n.startswith("CP ") or n == "attention mask" for n in names)


def test_gathered_kv_of_grouped_query_attention_are_the_rank_s_kv_heads_of_the_whole_sequence():
    """llama3 (n_kv_heads 4) under TP 2 x CP 2 on CUDA, no AC: every block keeps K and V of its 2 key / value
    heads for all seq_len tokens, in bfloat16, and its backward holds their gradient."""
    config = config_registry.get("llama3_debug_bf16")
    config.parallelism.tp, config.parallelism.cp = 2, 2
    run = resolve_run(config, world_size=4, device_type="cuda", cuda_available=False)
    args, est = run.model_args, estimate_run_memory(run)
    batch, seq = config.training.local_batch_size, config.training.seq_len
    per_block = batch * seq * 2 * (args.n_kv_heads // 2) * args.head_dim * 2
    assert est["CP gathered K/V (saved)"] == args.n_layers * per_block
    assert est["CP gathered K/V transient"] == per_block
    # They are in the step's moments: at the last block's backward every block's are held, with the mask, and
    # the block's backward holds their gradient; the same run without CP at the same tokens per rank has neither.
    plain = copy.deepcopy(config)
    plain.parallelism.cp, plain.training.seq_len = 1, seq // 2
    last = f"block {args.n_layers - 1} backward"
    with_cp, without = est.moment(last).parts, estimate_memory(plain, world_size=4, device_type="cuda").moment(last).parts
    assert with_cp["activations"] - without["activations"] == args.n_layers * per_block + est["attention mask"]
    assert with_cp["block working set"] - without["block working set"] == per_block


def test_gathered_kv_of_latent_attention_are_the_expanded_heads_and_the_gathered_latent():
    """deepseek_v3 (MLA) under CP 2 on a CPU, float32: attention keeps every head's expanded K (nope + rope) and V
    for all seq_len tokens, and wkv_b keeps the gathered latent + rotary key it expanded."""
    config = config_registry.get("deepseek_v3_debug")
    config.parallelism.cp = 2
    run = resolve_run(config, world_size=2, device_type="cpu")
    args, est = run.model_args, estimate_run_memory(run)
    batch, seq = config.training.local_batch_size, config.training.seq_len
    expanded = args.n_heads * (args.qk_nope_head_dim + args.qk_rope_head_dim + args.v_head_dim)
    latent = args.kv_lora_rank + args.qk_rope_head_dim
    per_block = batch * seq * (expanded + latent) * 4
    assert est["CP gathered K/V (saved)"] == args.n_layers * per_block
    assert "latent 160" in next(t.how for t in est.terms if t.name == "CP gathered K/V (saved)")


def test_full_ac_turns_the_saved_kv_into_one_block_s_transient():
    config = config_registry.get("llama3_debug")
    config.parallelism.cp = 2
    run = resolve_run(config, world_size=2, device_type="cpu")
    saved, n_layers = estimate_run_memory(run), run.model_args.n_layers
    per_block = saved["CP gathered K/V transient"]  # without AC: their gradient alone, one block's size
    assert saved["CP gathered K/V (saved)"] == n_layers * per_block > 0
    config.activation_checkpoint.mode = "full"
    full = estimate_run_memory(resolve_run(config, world_size=2, device_type="cpu"))
    assert full["CP gathered K/V (saved)"] == 0
    assert full["CP gathered K/V transient"] == 2 * per_block  # gathered again in backward + their gradient
    recompute = [m.parts["recompute"] for m in full.moments if m.name.endswith(" backward") and "recompute" in m.parts]
    config.parallelism.cp, config.training.seq_len = 1, config.training.seq_len // 2
    plain = estimate_memory(config, world_size=2, device_type="cpu")
    assert recompute[0] - next(m.parts["recompute"] for m in plain.moments if "recompute" in m.parts) == per_block


def test_the_attention_mask_is_a_dense_bool_matrix_on_a_cpu_even_at_cp_1():
    """A document mask reaches the model as kwargs at any cp: on a CPU SDPA gets a bool [B, 1, s, S] per forward;
    on CUDA a FlexAttention BlockMask of 128 x 128 blocks."""
    config = config_registry.get("llama3_debug")
    config.model.attention_mask = "document"
    batch, seq = config.training.local_batch_size, config.training.seq_len
    cpu = estimate_memory(config, world_size=1, device_type="cpu")
    assert cpu["attention mask"] == 4 * batch * seq * seq  # additive float32, one per forward
    assert not any(t.name.startswith("CP ") for t in cpu.terms)
    config.parallelism.cp = 2
    assert estimate_memory(config, world_size=2, device_type="cpu")["attention mask"] == 4 * batch * seq // 2 * seq
    cuda = estimate_memory(config, world_size=2, device_type="cuda")
    assert cuda["attention mask"] == 4 * batch * 1 * 1 * 4  # s = 64 and S = 128 tokens: one block each way


def test_experts_are_sharded_over_cp_as_every_weight_is():
    """Context-parallel ranks hold the same experts: FSDP shards them over dp_shard x cp / ep (EP borrows from
    dp_shard x cp), in the estimate and in the layout line --dry-run and --check-config print."""
    config = config_registry.get("deepseek_v3_debug")
    config.parallelism.cp, config.parallelism.ep = 2, 2
    run = resolve_run(config, world_size=4, device_type="cpu")
    est = estimate_run_memory(run)
    assert "sharded FSDP 4 (dp_shard 2 x cp 2); routed experts EP 2 x FSDP 2" in est.terms[0].how
    dims = run.parallel_dims
    text = expert_layout_text(run.moe_facts, n_layers=4, ep=dims.ep, dp_shard=dims.dp_shard, fsdp=True, cp=dims.cp)
    assert "4 experts per rank, their weights sharded by FSDP 2 (dp_shard 2 x cp 2 / ep 2)" in text
