"""Context parallelism's share of a rank's memory (parallelism.cp), and the attention mask's at any cp.

Under CP a rank holds s = seq_len / cp tokens of each sequence: ResolvedRun.tokens_per_forward is already per
chunk, so the block activations, norms, head, logits and loss of memory/activations.py are the chunk's. What
CP adds is attention over the keys of all S = seq_len tokens, all-gathered along the sequence from the CP group
(the gather's backward reduce-scatters their gradient to each chunk's owner). Per block, for B sequences:

- gathered K/V saved: attention saves its inputs, so a block that keeps its activations (no AC, selective AC:
  the per-op policy keeps the gather's output) holds K and V of S tokens, B x S x W x e: W the rank's K and V
  channels (AttentionShape.kv_width / tp: GQA 2 x Hkv/tp x head_dim, before any repeat; latent attention the
  K and V every head expands, H/tp x (qk_head_dim + v_head_dim)), e the attention's element size (float32 on
  a CPU); latent attention also keeps the gathered latent + rotary key, ``wkv_b``'s saved input: B x S x L x a.
  The block's own row still counts the chunk's k, v as attention takes them without CP (an over-count, at most
  one such block's worth under full AC);
- under full AC (a block recomputed in backward) the same exists only while that block's backward runs: one
  block's, gathered again, plus their gradient before the reduce-scatter (the same size), which every mode's
  backward has;
- the attention mask, built once per forward and saved by every block's attention until the first block's
  backward: on a CPU a dense additive float32 [B, 1, s, S] (4 bytes a pair; every block saves the one tensor)
  whenever kwargs reach the model (cp > 1, or a document mask at
  any cp); on CUDA a FlexAttention BlockMask, int32 block indices: kv_indices and full_kv_indices and their
  transposes, B x (s/128) x (S/128) x 4 bytes each.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from torchtitan_lite.memory.activations import wrapped_blocks
from torchtitan_lite.memory.terms import MemoryTerm
from torchtitan_lite.protocols.attention_shape import attention_shape
from torchtitan_lite.resolved_run import ResolvedRun

FLEX_BLOCK = 128
"""FlexAttention's default block size (query and key)."""


@dataclass(frozen=True)
class ContextParallelSetup:
    cp: int
    seq_len: int
    """S: the keys every rank's attention reads (the whole sequence)."""
    sequences: int
    """B: sequences per micro-batch."""
    kv_width: int
    """K + V channels of the rank's heads per token (after TP)."""
    latent_width: int
    """Channels K and V are expanded from (gathered instead of K and V when > 0), on every TP rank."""
    attention_bytes: int
    compute_bytes: int
    device_type: str

    @property
    def local_tokens(self) -> int:
        """s: tokens of each sequence the rank holds."""
        return self.seq_len // self.cp

    @property
    def gathered_width(self) -> int:
        """Channels per token the all-gather moves: the latent, or K and V themselves."""
        return self.latent_width or self.kv_width

    def gather_bytes(self) -> int:
        """The all-gather's output in one layer: B x S x the gathered width, in the compute dtype."""
        return self.sequences * self.seq_len * self.gathered_width * self.compute_bytes if self.cp > 1 else 0

    def saved_per_block(self) -> int:
        """What attention keeps of the gathered sequence in one block (0 without CP): K and V of S tokens, and
        the gathered latent they were expanded from."""
        if self.cp == 1:
            return 0
        return self.sequences * self.seq_len * (self.kv_width * self.attention_bytes
                                                + self.latent_width * self.compute_bytes)

    def gradient_bytes(self) -> int:
        """The gradients of the gathered K and V (and latent) in one block's backward, before the reduce-scatter."""
        return self.saved_per_block()

    def mask_bytes(self) -> int:
        """One forward's attention mask: dense float32 on a CPU (models/common/attention/mask.py), a FlexAttention
        BlockMask on CUDA."""
        if self.device_type == "cuda":
            blocks = math.ceil(self.local_tokens / FLEX_BLOCK) * math.ceil(self.seq_len / FLEX_BLOCK)
            return 4 * self.sequences * blocks * 4
        return 4 * self.sequences * self.local_tokens * self.seq_len


def context_parallel_setup(run: ResolvedRun) -> ContextParallelSetup | None:
    """The run's setup; None when attention gets no mask and gathers nothing (cp 1, causal): nothing to add."""
    cp, compute_bytes = run.parallel_dims.cp, run.precision.param_bytes
    if cp == 1 and not run.document_mask:
        return None
    shape = attention_shape(run.model_spec.attention_shape, run.model_args)
    return ContextParallelSetup(
        cp=cp, seq_len=run.seq_len, sequences=run.tokens_per_forward // (run.seq_len // cp),
        kv_width=shape.kv_width // run.parallel_dims.tp, latent_width=shape.latent_width,
        # As ActivationSetup.attention_bytes: CPUs attend reduced-precision activations in float32.
        attention_bytes=4 if run.device_type == "cpu" else compute_bytes, compute_bytes=compute_bytes,
        device_type=run.device_type)


def recomputed_blocks(mode: str, selective_option: str, n: int) -> list[bool]:
    """Which of ``n`` blocks rebuild their whole saved set in backward (full AC; selective N's wrapped
    blocks): their gathered K/V exist only during their backward. The per-op policy keeps the gather's output."""
    if mode == "selective" and selective_option == "op":
        return [False] * n
    return wrapped_blocks(mode, selective_option, n)


def with_context_parallel(plan: list[tuple[int, int]], c: ContextParallelSetup | None, mode: str,
                          selective_option: str) -> list[tuple[int, int]]:
    """``plan`` (memory/activations.py's block_plan of one stage: kept, recomputed per block) with the gathered
    K/V of each block, kept or recomputed, and the stage's mask held with its first block."""
    if c is None:
        return plan
    saved = c.saved_per_block()
    out = [(kept, recomputed + saved) if again else (kept + saved, recomputed)
           for (kept, recomputed), again in zip(plan, recomputed_blocks(mode, selective_option, len(plan)),
                                                strict=True)]
    if out:
        out[0] = (out[0][0] + c.mask_bytes(), out[0][1])
    return out


def context_parallel_terms(c: ContextParallelSetup | None, mode: str, selective_option: str,
                           n_blocks: int) -> list[MemoryTerm]:
    """The rows of the estimate's table (none without CP or a mask)."""
    if c is None:
        return []
    mask = MemoryTerm("attention mask", c.mask_bytes(),
                      f"FlexAttention BlockMask per forward (B x {c.local_tokens}/{FLEX_BLOCK} x {c.seq_len}/{FLEX_BLOCK} "
                      "block indices)" if c.device_type == "cuda" else
                      f"dense float32 [B, 1, {c.local_tokens}, {c.seq_len}] per forward, one tensor every block's attention saves")
    if c.cp == 1:
        return [mask]
    again = recomputed_blocks(mode, selective_option, n_blocks)
    per_block, kept = c.saved_per_block(), n_blocks - sum(again)
    width = f"{c.kv_width} K/V channels x {c.attention_bytes} B" + (
        f" + latent {c.latent_width} x {c.compute_bytes} B" if c.latent_width else "")
    return [
        MemoryTerm("CP gathered K/V (saved)", kept * per_block,
                   f"CP {c.cp}: {kept} blocks x {c.sequences} x {c.seq_len} tokens x ({width}) kept for backward"
                   if kept else f"CP {c.cp}: none kept, AC {mode} gathers them again in backward"),
        MemoryTerm("CP gathered K/V transient", (per_block if any(again) else 0) + c.gradient_bytes(),
                   ("one block's, gathered again, + " if any(again) else "") + "their gradient before the "
                   "reduce-scatter, in the block backward"),
        mask,
    ]
