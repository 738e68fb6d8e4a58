"""Activation memory of an MoE feed-forward: the router, the routed rows, the expert GEMMs, the combine, and
the all-to-all buffers of expert parallelism.

Notation (per rank, per MoE layer): T tokens of the micro-batch; k = top_k; E experts (E / ep on this
rank); D = dim; H = one expert's hidden width; S = the shared experts' width; a = compute-dtype bytes;
Ts = T x k rows this rank routes (sends); Tr the rows it receives for its own experts.

Saved for backward in eager mode (models/common/{router,dispatch,experts,moe}.py; checked tensor by
tensor against autograd's saved tensors in tests/unit/test_memory_moe.py):

- router: the float32 gate input (T x D x 4; the gate runs in float32 in every recipe) and, when FSDP
  cast the parameters to a low-precision dtype, the float32 copy of the gate weight (E x D x 4), the scores
  (softmax / sigmoid output, T x E x 4), the top-k indices (T x k x 8), the chosen scores and their
  normalised form (2 x T x k x 4) with the normaliser (T x 4);
- dispatch: the row index of the gather and the sort order that the combine scatters with (2 x Ts x 8),
  and the routed rows the first two expert GEMMs read (Tr x D x a; under autocast each GEMM saves its own
  cast copy, and the expert weights' casts: 3 x E x H x D x a, as autocast does not cache them);
- routed experts: w1's output, SiLU's output, w3's output and their product (4 x Tr x H x a), the int32
  group offsets (E x 4);
- combine: the expert outputs, which the unsorting index_copy saves (Tr x D x a), and their float32 form
  that the weighting multiplies (Ts x D x 4);
- shared experts: a SwiGLU of width S on the gate's input (4 x T x S x a, plus the input in the compute
  dtype when it is not the float32 one the gate saved).

Low-precision experts (a converter whose config sets ``low_precision_experts``): torchao 0.18's FP8 rowwise
and MXFP8 grouped GEMMs save their high-precision, token-group-padded input and weight and re-cast in
backward (``ctx.save_for_backward(padded_A, B_t, ...)`` in torchao/prototype/moe_training/fp8_grouped_mm.py,
``padded_input_act, weight_t`` in mxfp8_grouped_mm.py), so they save no float8 copy; but w1 and w3 each
save their own copy of the routed rows (one more Tr x D x a), and one GEMM at a time holds its float8
operands (Tr x max(D, H) + E x H x D bytes, scales under 4%). The padding (< 16 rows per expert) is not
modelled.

Blockwise experts (DeepSeek-V3's recipe, emulated: grouped_gemm.py) save the same padded inputs, padded to 128
rows per expert: the buffers hold Tr + E x 127 rows, which the estimate adds to the two padded inputs of w1 / w3
and the padded input of w2. Their GEMMs run on dequantized operands, in the compute dtype with power-of-2 scales and in
float32 with float32 scales (a bytes per element, or 4, instead of FP8's 1): one GEMM at a time holds its token
operands ((Tr + E x 127) x (D + H) x a or 4 at most) and two expert-weight-sized tensors (2 x E x H x D x a or
4: the dequantized weight and the temporary it is divided from, or the weight gradient and its cast).

Not modelled: the sequence-level aux loss keeps the scores' row sums (T x 4, under 1/E of the scores) and
two [batch, E] tensors.

Expert parallelism (ep > 1) sends each rank's Ts rows to the ranks that hold their experts and brings the
results back. Routing is dropless, so the rows a rank receives follow its experts' load: the estimate
assumes the busiest rank receives EP_RECEIVE_HEADROOM times the balanced Ts (an assumption, not a
measurement; the router metrics' max / mean load per layer show the real imbalance of a run). The
all-to-all buffers of one exchange are its send and receive tensors, Ts x D x a and Tr x D x a, alive
together in the dispatch and again (reversed) in the combine, in forward and in backward.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

BLOCKWISE_GROUP_ALIGNMENT = 128
"""Rows a blockwise expert GEMM pads each token group to (grouped_gemm.GROUP_ALIGNMENT['blockwise'])."""
EP_RECEIVE_HEADROOM = 1.25
"""Rows the busiest EP rank receives, relative to a perfectly balanced router (assumed)."""


@dataclass(frozen=True)
class RoutedSetup:
    num_experts: int
    top_k: int
    hidden: int
    """One routed expert's SwiGLU width."""
    shared_hidden: int
    """The shared experts' SwiGLU width (0: none)."""
    layers: frozenset[int]
    """Blocks whose feed-forward is this MoE layer."""
    ep: int = 1
    float8_experts: bool = False
    """The expert GEMMs run in FP8 / MX: set from the run's converters (``low_precision_experts``)."""
    blockwise_experts: bool = False
    """... in emulated blockwise FP8 (the moe_experts converter's recipe blockwise): 128-row padding."""
    float32_expert_gemms: bool = False
    """Blockwise with float32 scales: the dequantized operands are float32 (power-of-2 scales keep the compute
    dtype)."""

    @property
    def padding_rows(self) -> int:
        """Rows the blockwise padding adds to each padded GEMM input (E x 127, the buffer's size)."""
        return self.local_experts * (BLOCKWISE_GROUP_ALIGNMENT - 1) if self.blockwise_experts else 0

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep

    def sent_rows(self, tokens: int) -> int:
        return tokens * self.top_k

    def received_rows(self, tokens: int) -> int:
        if self.ep == 1:
            return self.sent_rows(tokens)
        return math.ceil(self.sent_rows(tokens) * EP_RECEIVE_HEADROOM)


def moe_saved_bytes(r: RoutedSetup, *, tokens: int, dim: int, compute_bytes: int, autocast: bool) -> dict[str, int]:
    """Saved tensors of one MoE feed-forward (its norm excluded), by part."""
    t, a, e = tokens, compute_bytes, r.local_experts
    sent, received = r.sent_rows(t), r.received_rows(t)
    rows = (2 if autocast else 1) * received * dim * a
    weight_casts = 3 * e * r.hidden * dim * a if autocast else 0
    float8 = received * dim * a if r.float8_experts else 0  # w1 and w3 save separate input copies
    float8 += r.padding_rows * (2 * dim + r.hidden) * a  # blockwise: zero rows in the padded inputs of w1, w3, w2
    # The gate saves a float32 copy of its input; the shared experts read the input itself (their own cast
    # copies under autocast), which is the gate's saved tensor when it is already float32.
    shared_input = (2 * t * dim * a if autocast else 0 if a == 4 else t * dim * a) if r.shared_hidden else 0
    gate_weight = r.num_experts * dim * 4 if a != 4 and not autocast else 0
    return {
        "router": t * dim * 4 + gate_weight + t * r.num_experts * 4 + t * r.top_k * (8 + 2 * 4) + t * 4,
        "dispatch": 2 * sent * 8 + rows + weight_casts + float8,
        "routed experts": 4 * received * r.hidden * a + e * 4,
        "combine": received * dim * a + sent * dim * 4,
        "shared experts": 4 * t * r.shared_hidden * a + shared_input,
    }


def all_to_all_bytes(r: RoutedSetup, *, tokens: int, dim: int, compute_bytes: int) -> int:
    """Send + receive buffers of one all-to-all exchange (dispatch or combine); 0 without EP."""
    if r.ep == 1:
        return 0
    return (r.sent_rows(tokens) + r.received_rows(tokens)) * dim * compute_bytes


def moe_backward_working_bytes(r: RoutedSetup, *, tokens: int, dim: int, compute_bytes: int) -> int:
    """Activation gradients inside one MoE layer's backward: at the expert SwiGLU product the gradients of
    the product, of w1's and of w3's output (3 x Tr x H x a) next to the routed rows' gradient (Tr x D x a)
    and one exchange's all-to-all buffers."""
    received = r.received_rows(tokens)
    float8 = received * max(dim, r.hidden) + r.local_experts * r.hidden * dim if r.float8_experts else 0
    if r.blockwise_experts:  # dequantized operands of the weight-gradient GEMM and its result
        operand = 4 if r.float32_expert_gemms else compute_bytes
        float8 = operand * ((received + r.padding_rows) * (dim + r.hidden) + 2 * r.local_experts * r.hidden * dim)
    return (received * (3 * r.hidden + dim) * compute_bytes + float8
            + all_to_all_bytes(r, tokens=tokens, dim=dim, compute_bytes=compute_bytes))
