"""Document masking on CUDA runs FlexAttention (a compiled BlockMask per forward); on CPU the same layout is a
dense boolean mask for SDPA, which tests/unit/test_document_mask.py holds to transformers. Here the CUDA logits of
each family, given a packed window's layout, equal the CPU logits of the same weights (float32, TF32 off), for the
whole window and for one context-parallel rank's chunks (queries of 2 of 4 chunks over every key).

Tolerance 1e-4 relative: float32 on two kernels and two devices (measured ~1e-6 for SDPA CPU vs CUDA at the debug
shapes); the negative control, the causal mask on the same window, differs by O(1)."""
from __future__ import annotations

import pytest
import torch

from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS, DeepSeekV3Model
from models.llama3 import LLAMA3_FLAVORS, Transformer
from models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeModel
from torchtitan_lite.components.data.batch import Batch
from torchtitan_lite.components.data.sequence_layout import model_batch

pytestmark = pytest.mark.gpu

FAMILIES = {"llama3": (Transformer, LLAMA3_FLAVORS["debug"]), "qwen3_moe": (Qwen3MoeModel, QWEN3_MOE_FLAVORS["debug"]),
            "deepseek_v3": (DeepSeekV3Model, DEEPSEEK_V3_FLAVORS["debug"])}
SEQ = 256
"""Two FlexAttention blocks of 128 per row: the block mask has partly and wholly masked blocks."""


def _batch(vocab: int) -> Batch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (2, SEQ + 1), generator=g)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
                 [torch.tensor([0, 40, 170, 201]), torch.tensor([0, 129])])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_flex_document_mask_on_cuda_equals_the_dense_mask_on_cpu(family):
    model_cls, args = FAMILIES[family]
    torch.manual_seed(0)
    cpu = model_cls(args).eval()
    cuda = model_cls(args).eval()
    cuda.load_state_dict(cpu.state_dict())
    cuda.cuda()
    batch = _batch(args.vocab_size)
    kwargs = model_batch(batch, document_mask=True).model_kwargs
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            ref = cpu(batch.inputs, **kwargs)
            got = cuda(batch.inputs.cuda(), **{k: v.cuda() for k, v in kwargs.items()}).cpu()
            causal = cuda(batch.inputs.cuda()).cpu()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    assert _rel(got, ref) <= 1e-4, _rel(got, ref)
    assert _rel(causal, ref) > 1e-2  # the mask is in effect


@pytest.mark.parametrize("v_dim", [64, 32], ids=["gqa", "value_dim_unlike_key"])
def test_flex_attention_of_one_cp_rank_equals_the_dense_mask(v_dim):
    """A context-parallel rank's layout: its queries are 2 of 4 head-tail chunks, its keys the whole window in
    the gathered order (q length 128 against 256 keys). FlexAttention on its BlockMask equals SDPA on the dense
    mask, both on CUDA."""
    from models.common.attention.grouped_query import masked_attention
    from models.common.attention.mask import build_mask

    mb = model_batch(_batch(2048), document_mask=True, cp=2, cp_rank=1)
    idx = {k: v.cuda() for k, v in mb.model_kwargs.items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    bsz, s, total = idx["q_index"].shape[0], idx["q_index"].shape[1], idx["kv_index"].shape[1]
    q = torch.randn(bsz, 8, s, 64, device="cuda", generator=g)
    k = torch.randn(bsz, 2, total, 64, device="cuda", generator=g)
    v = torch.randn(bsz, 2, total, v_dim, device="cuda", generator=g)
    masks = {kind: build_mask(idx["q_index"], idx["kv_index"], idx["q_doc"], idx["kv_doc"], kind=kind)
             for kind in ("dense", "flex")}
    flex = masked_attention(q, k, v, masks["flex"], enable_gqa=True)
    dense = masked_attention(q, k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1), masks["dense"],
                             enable_gqa=False)
    assert _rel(flex, dense) <= 1e-4, _rel(flex, dense)
