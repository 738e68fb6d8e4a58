"""Activation memory of the Llama 3 model: what autograd saves per token, per block, per AC mode.

Notation (all per rank): T = local_batch_size x seq_len tokens; D = dim; Hq, Hkv = query / key-value
heads on this rank (n_heads / tp, n_kv_heads / tp); hd = head_dim; F = ffn_hidden_dim / tp; V = vocab
(/ tp with loss parallel); sp = tp with sequence parallel, else 1; a = bytes of the compute dtype
(param_dtype); r = bytes of the residual stream (a with FSDP, which casts parameters; 4 under autocast,
where the embedding and the residual additions stay float32).

Saved for backward by one block without checkpointing (eager; verified tensor by tensor with
`torch.autograd.graph.saved_tensors_hooks` in tests/unit/test_memory/estimate.py):

- each RMSNorm (2 per block), T/sp tokens: CUDA's fused kernel `aten._fused_rms_norm` saves its input
  (D x r) and the float32 rstd (4), what its backward `_fused_rms_norm_backward(grad, input,
  normalized_shape, rstd, weight)` takes (torch/_decomp/decompositions.py; derived, not measured: no
  GPU here); the CPU composite saves a float32 copy of the input, the float32 normalized input (for the
  weight gradient) and rstd: 8 D + 4 (measured);
- each norm output, read by the Linears after it (wq/wk/wv, w1/w3): one shared tensor of D x a; under
  autocast each Linear saves its own cast copy (autocast caches casts of leaf weights only); with
  float8 TP styles the gathered input is float8: D x 1;
- SDPA's inputs: q after rotary, and on CUDA k, v repeated to Hq heads (`repeat_kv` copies; without
  GQA the projections themselves): 3 x Hq x hd x a (rotary saves only the complex table, a buffer); on
  a CPU, SDPA reads the shared heads itself (`enable_gqa`), so k, v keep Hkv heads, and reduced-precision
  activations are attended in float32 (models/common/attention/grouped_query.py): (Hq + 2 Hkv) x hd x e, where e, the
  attention's element size, is 4 on a CPU and a elsewhere;
- SDPA (flash / memory-efficient on CUDA, flash on CPU): output Hq x hd x e and float32 logsumexp Hq x 4;
  wo reads the output as a view, or when e != a its copy rounded to a, Hq x hd x a (float8 TP: a float8
  copy, Hq x hd x 1, instead);
- SwiGLU: w1 output (read by SiLU), SiLU output and w3 output (read by the product), the product
  (read by w2; float8 TP: its float8 copy): 4 x F x a.

Per AC mode (torchtitan_lite/distributed/activation_checkpoint.py):

- full: the block input only, D x r per T/sp tokens; the block's saved set is rebuilt in backward;
- selective 'op': the block input plus the outputs the policy keeps: matmuls 1, 3, 5, 7 of the block
  in forward order (wq: Hq x hd, wv: Hkv x hd, w1: F, w2: D x a; a row-parallel w2's matmul output is
  the full-sequence partial sum), SDPA output (Hq x hd x e) + logsumexp, and with TP + SP the two reduce-scatter
  outputs (D / sp each); float8 amax scalars are negligible;
- selective N: every Nth block (N-1, 2N-1, ...) full, the others none.

Head and loss: the final norm as above and the output projection's input (D x a); the loss upcasts
logits to float32 (components/loss.py) and log-softmax saves float32 log-probs, so its backward holds
the saved log-probs plus the float32 gradient in and out of log-softmax: 12 x V bytes per token at once
(16 x V with loss parallel, whose fused backward holds one more float32 temporary).
A compiled loss (Inductor) keeps the logits instead and writes their gradient directly: 2 x V x a.

MoE blocks (the family's MoE facts name them) replace the SwiGLU and the feed_forward input by the
router, dispatch, routed experts, combine and shared experts of memory/routed.py; under the op policy
they keep the router's gate logits (T x E x 4, a matmul at an odd position of the block) instead of w1's
and w2's outputs (the grouped expert GEMMs are not in the policy's matmul list).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan_lite.memory.routed import RoutedSetup, moe_backward_working_bytes, moe_saved_bytes


@dataclass(frozen=True)
class ActivationSetup:
    tokens: int
    """Tokens of one micro-batch on this rank: local_batch_size x seq_len."""
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    n_layers: int
    tp: int
    sequence_parallel: bool
    loss_parallel: bool
    compute_bytes: int
    residual_bytes: int
    autocast: bool
    device_type: str
    """'cuda': F.rms_norm runs the fused kernel; 'cpu': the composite, and attention in float32 over the
    shared key / value heads."""
    compiled_loss: bool
    float8_tp_regions: frozenset[str] = frozenset()
    """TP communication regions that move float8 (names from the family's plan: 'attention input',
    'feed_forward input', 'attention.wo output', 'feed_forward.w2 output'); their activations are saved
    as float8 by torchao's float8 TP styles."""
    moe: RoutedSetup | None = None
    """The model's MoE layers (None: every block has the dense SwiGLU of width ffn_dim)."""

    def is_moe(self, layer: int | None) -> bool:
        return self.moe is not None and layer in self.moe.layers

    @property
    def fused_rms_norm(self) -> bool:
        return self.device_type == "cuda"

    @property
    def attention_bytes(self) -> int:
        """Element size of SDPA's inputs and output: CPUs attend reduced-precision activations in float32."""
        return 4 if self.device_type == "cpu" else self.compute_bytes

    @property
    def sdpa_kv_heads(self) -> int:
        """Key / value heads SDPA receives: CPUs read the shared heads (enable_gqa), CUDA gets them repeated."""
        return self.hkv if self.device_type == "cpu" else self.hq

    @property
    def sp(self) -> int:
        return self.tp if self.sequence_parallel and self.tp > 1 else 1

    @property
    def hq(self) -> int:
        return self.n_heads // self.tp

    @property
    def hkv(self) -> int:
        return self.n_kv_heads // self.tp

    @property
    def ffn(self) -> int:
        return math.ceil(self.ffn_dim / self.tp)

    @property
    def vocab(self) -> int:
        return math.ceil(self.vocab_size / self.tp) if self.loss_parallel and self.tp > 1 else self.vocab_size


def norm_saved_bytes(s: ActivationSetup) -> int:
    """What one RMSNorm saves, over the tokens it sees (T / sp)."""
    per_token = s.dim * s.residual_bytes + 4 if s.fused_rms_norm else 8 * s.dim + 4
    return per_token * s.tokens // s.sp


def norm_output_bytes(s: ActivationSetup, consumers: int, region: str | None = None) -> int:
    """The norm output as saved by the `consumers` Linears that read it (full sequence); a float8 TP
    `region` all-gathers and saves it once, in float8."""
    if region in s.float8_tp_regions:
        return s.tokens * s.dim
    copies = consumers if s.autocast else 1
    return copies * s.tokens * s.dim * s.compute_bytes


def block_saved_bytes(s: ActivationSetup, layer: int | None = None) -> dict[str, int]:
    """Saved tensors of block ``layer`` without checkpointing, by part (None: a dense block)."""
    t, a, e = s.tokens, s.compute_bytes, s.attention_bytes
    attention = s.hq * s.head_dim
    parts = {
        "norms": 2 * norm_saved_bytes(s),
        "norm outputs": norm_output_bytes(s, 3, "attention input"),
        "q, k, v": t * (s.hq + 2 * s.sdpa_kv_heads) * s.head_dim * e,
        "sdpa": t * attention * e + t * s.hq * 4 + wo_input_bytes(s),
    }
    if s.moe is not None and s.is_moe(layer):
        return parts | moe_saved_bytes(s.moe, tokens=t, dim=s.dim, compute_bytes=a, autocast=s.autocast)
    parts["norm outputs"] += norm_output_bytes(s, 2, "feed_forward input")
    parts["swiglu"] = 3 * t * s.ffn * a + t * s.ffn * (1 if "feed_forward.w2 output" in s.float8_tp_regions else a)
    return parts


def wo_input_bytes(s: ActivationSetup) -> int:
    """What wo saves beyond SDPA's own output: a float8 copy under float8 TP, the output rounded to the
    compute dtype when attention ran wider, else nothing (a view)."""
    attention = s.tokens * s.hq * s.head_dim
    if "attention.wo output" in s.float8_tp_regions:
        return attention
    return attention * s.compute_bytes if s.attention_bytes != s.compute_bytes else 0


def block_input_bytes(s: ActivationSetup) -> int:
    return s.tokens // s.sp * s.dim * s.residual_bytes


def selective_op_bytes(s: ActivationSetup, layer: int | None = None) -> int:
    """Block input plus the outputs the per-op policy saves."""
    t, a = s.tokens, s.compute_bytes
    matmuls = t * (s.hq * s.head_dim + s.hkv * s.head_dim + s.ffn + s.dim) * a
    if s.moe is not None and s.is_moe(layer):
        # wq, wv, the gate (float32 logits) and, with shared experts, w3 of theirs (the 7th matmul).
        matmuls = t * (s.hq * s.head_dim + s.hkv * s.head_dim + s.moe.shared_hidden) * a + t * s.moe.num_experts * 4
    sdpa = t * s.hq * s.head_dim * s.attention_bytes + t * s.hq * 4
    reduce_scatters = 2 * t // s.sp * s.dim * a if s.sp > 1 else 0
    return block_input_bytes(s) + matmuls + sdpa + reduce_scatters


def recompute_bytes(s: ActivationSetup, *, selective_op: bool, layer: int | None = None) -> int:
    """What backward adds when it re-runs a checkpointed block: the block's saved set, minus the
    tensors the checkpoint already holds (its input, which the first norm saves as is when it is
    float32 or the norm is fused; under the op policy also the SDPA outputs, w1's output, and v when
    SDPA reads wv's output itself: not repeated, not widened)."""
    none = sum(block_saved_bytes(s, layer).values())
    kept_input = block_input_bytes(s) if s.fused_rms_norm or s.residual_bytes == 4 else 0
    if not selective_op:
        return none - kept_input
    t, a = s.tokens, s.compute_bytes
    # w1's output is reused by a dense block; an MoE block's saved gate logits are not in its saved set.
    reused = t * s.hq * s.head_dim * s.attention_bytes + t * s.hq * 4 + (0 if s.is_moe(layer) else t * s.ffn * a)
    if s.sdpa_kv_heads == s.hkv and s.attention_bytes == a:
        reused += t * s.hkv * s.head_dim * a
    return none - kept_input - reused


def wrapped_blocks(mode: str, selective_option: str, n_layers: int) -> list[bool]:
    """Which blocks the AC mode wraps in a checkpoint (the same rule as apply_ac)."""
    if mode == "full" or (mode == "selective" and selective_option == "op"):
        return [True] * n_layers
    if mode == "selective":
        every = int(selective_option) if selective_option.isdigit() else 0
        if every < 1:
            raise ValueError(f"activation_checkpoint.selective_option={selective_option!r} must be 'op' or a "
                             "positive integer N (checkpoint every Nth block)")
        return [(i + 1) % every == 0 for i in range(n_layers)]
    return [False] * n_layers


def block_plan(s: ActivationSetup, mode: str, selective_option: str,
               layers: list[int] | None = None) -> list[tuple[int, int]]:
    """Per block of ``layers`` (default: every block of the model), in order: (bytes it keeps from forward to
    backward, bytes its backward recomputes). A pipeline stage passes its own blocks: AC counts every Nth
    block of the module it wraps, so a stage counts from its own first block."""
    selective_op = mode == "selective" and selective_option == "op"
    layers = list(range(s.n_layers)) if layers is None else layers
    plan = []
    for layer, wrapped in zip(layers, wrapped_blocks(mode, selective_option, len(layers)), strict=True):
        if not wrapped:
            plan.append((sum(block_saved_bytes(s, layer).values()), 0))
            continue
        kept = selective_op_bytes(s, layer) if selective_op else block_input_bytes(s)
        plan.append((kept, recompute_bytes(s, selective_op=selective_op, layer=layer)))
    return plan


def head_saved_bytes(s: ActivationSetup) -> int:
    """Final norm and the output projection's input."""
    return norm_saved_bytes(s) + norm_output_bytes(s, 1)


def loss_transient_bytes(s: ActivationSetup) -> int:
    """Peak of the cross-entropy forward/backward on top of everything saved."""
    if s.compiled_loss:
        return 2 * s.tokens * s.vocab * s.compute_bytes
    if s.loss_parallel and s.tp > 1:
        # torch/distributed/tensor/parallel/loss.py fuses both backwards into
        # (zeros_like(x) scattered + exp(x)) * grad: log-probs, that buffer, exp(x) and their sum coexist.
        return 16 * s.tokens * s.vocab
    return 12 * s.tokens * s.vocab


def logits_grad_bytes(s: ActivationSetup) -> int:
    """Gradient of the logits, in the compute dtype, alive through the output projection's backward."""
    return s.tokens * s.vocab * s.compute_bytes


def block_backward_working_bytes(s: ActivationSetup) -> int:
    """Activation gradients alive at once inside one block's backward: at the SwiGLU product the
    gradients of the product, of w1's and of w3's output coexist (3 x F x a per token), next to the
    residual-stream gradient (D x r); in an MoE block, the expert GEMMs' gradients and the all-to-all
    buffers instead (memory/routed.py). The largest over the model's kinds of block."""
    residual = s.tokens * s.dim * s.residual_bytes
    dense = s.tokens * 3 * s.ffn * s.compute_bytes + residual
    if s.moe is None:
        return dense
    moe = moe_backward_working_bytes(s.moe, tokens=s.tokens, dim=s.dim, compute_bytes=s.compute_bytes) + residual
    return max(moe, dense) if len(s.moe.layers) < s.n_layers else moe
