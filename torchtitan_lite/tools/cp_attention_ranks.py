"""The measured side of scripts/cp_attention_bench.py: ``cp`` gloo ranks each run one attention layer (the
models' own GroupedQueryAttention or MultiHeadLatentAttention, given the CP group by ``use_context_parallel``)
forward + backward over their head-tail chunks of one sequence, and report time, bytes saved for backward,
mask bytes and the bytes the K/V gather and its reduce-scatter move."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import torchtitan_lite.mesh.sequence_collectives as sequence_collectives
from torchtitan_lite.components.data.batch import Batch
from torchtitan_lite.components.data.sequence_layout import model_batch
from torchtitan_lite.protocols.model_spec import get_model_spec
from torchtitan_lite.tools.rank_processes import run_on_ranks

BuildMask = Callable[..., torch.Tensor]
"""models/common/attention/mask.py's build_mask, handed in by the script (the core imports no model family)."""

ATTENTIONS = ("gqa", "mla")
MASKS = ("causal", "document")


@dataclass(frozen=True)
class Shapes:
    """One attention layer's sizes per rank (tensor parallelism already applied: the heads one rank holds)."""

    dim: int = 512
    """GQA's width; llama3 derives head_dim = dim / heads."""
    mla_dim: int = 1024
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    kv_lora_rank: int = 128
    rope_dim: int = 32
    nope_dim: int = 64
    v_dim: int = 64

    def gathered_width(self, attention: str) -> int:
        """W: values gathered per token (GQA: k and v of every kv head; MLA: the latent and the rotary key)."""
        return 2 * self.kv_heads * self.head_dim if attention == "gqa" else self.kv_lora_rank + self.rope_dim

    def describe(self, attention: str) -> str:
        if attention == "gqa":
            return (f"GQA (llama3's attention): dim {self.dim}, {self.heads} q heads / {self.kv_heads} kv heads x "
                    f"head_dim {self.head_dim} (W = {self.gathered_width(attention)})")
        return (f"MLA (deepseek_v3's attention): dim {self.mla_dim}, {self.heads} heads, kv_lora_rank "
                f"{self.kv_lora_rank}, rope {self.rope_dim}, nope {self.nope_dim}, v {self.v_dim}, full-rank query "
                f"(W = {self.gathered_width(attention)})")


@dataclass(frozen=True)
class Case:
    attention: str
    mask: str


@dataclass(frozen=True)
class Settings:
    seq_len: int = 8192
    dtype: str = "bfloat16"
    warmup: int = 1
    repeats: int = 3
    shapes: Shapes = field(default_factory=Shapes)


@dataclass
class RankResult:
    cp: int
    case: Case
    rank: int
    step_ms: list[float]
    """Wall time of each timed forward + backward."""
    cpu_ms: list[float]
    """Thread CPU time of each (below the wall time when the rank waited for a core or for its peers)."""
    saved_bytes: int
    """Unique storages saved for backward by one forward, parameters excluded."""
    saved_mask_bytes: int
    """Of saved_bytes, storages of the mask's shape [B, 1, s, S]: the mask or a copy the kernel made of it."""
    mask_bytes: int
    gather_received: int
    """Bytes one forward's all-gathers brought from the other ranks."""
    scatter_sent: int
    """Bytes one backward's reduce-scatters sent to the other ranks (each its chunks of the summed gradient)."""
    attention_share: float


def received_bytes(local: torch.Tensor, gathered: torch.Tensor) -> int:
    """All-gather: what arrived from the other ranks, the gathered tensor less this rank's own chunk."""
    return gathered.nbytes - local.nbytes


def sent_bytes(full: torch.Tensor, kept: torch.Tensor) -> int:
    """Reduce-scatter: what left for the other ranks, the whole gradient less the chunk this rank keeps."""
    return full.nbytes - kept.nbytes


class CountingCollectives:
    """Stands in for ``funcol`` inside sequence_collectives: the same collectives, their bytes counted from the
    tensors each call really takes and returns."""

    def __init__(self, funcol: Any) -> None:
        self._funcol = funcol
        self.gather_received = 0
        self.scatter_sent = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._funcol, name)

    def all_gather_single(self, x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
        out = self._funcol.wait_tensor(self._funcol.all_gather_single(x, dim, group))
        self.gather_received += received_bytes(x, out)
        return out

    def reduce_scatter_single(self, x: torch.Tensor, op: str, dim: int, group: Any) -> torch.Tensor:
        out = self._funcol.wait_tensor(self._funcol.reduce_scatter_single(x, op, dim, group))
        self.scatter_sent += sent_bytes(x, out)
        return out


@contextmanager
def counted_collectives() -> Iterator[CountingCollectives]:
    counter = CountingCollectives(sequence_collectives.funcol)
    sequence_collectives.funcol = counter  # type: ignore[assignment]
    try:
        yield counter
    finally:
        sequence_collectives.funcol = counter._funcol


class SavedBytes:
    """saved_tensors_hooks that count the distinct storages a forward keeps for backward (a view saved twice,
    or a tensor and its view, count once); parameters are left out, they are held anyway. Storages of the
    mask's shape are also counted apart (SDPA saves the mask it is given, or its own float copy of a boolean one)."""

    def __init__(self, exclude: list[torch.Tensor], mask_shape: tuple[int, ...] | None = None) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.mask_shape = mask_shape
        self.storages: dict[int, int] = {}
        self.mask_storages: set[int] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.exclude:
            self.storages[storage.data_ptr()] = storage.nbytes()
            if self.mask_shape is not None and tuple(t.shape) == self.mask_shape:
                self.mask_storages.add(storage.data_ptr())
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    @property
    def mask_total(self) -> int:
        return sum(self.storages[p] for p in self.mask_storages)


def document_batch(seq_len: int, *, seed: int = 0) -> Batch:
    """One row of ``seq_len`` tokens cut into documents of random lengths (uniform in [seq_len/32, seq_len/4])."""
    g = torch.Generator().manual_seed(seed)
    starts, at = [0], 0
    while True:
        at += int(torch.randint(max(1, seq_len // 32), max(2, seq_len // 4) + 1, (1,), generator=g))
        if at >= seq_len:
            break
        starts.append(at)
    tokens = torch.zeros(1, seq_len, dtype=torch.int64)
    return Batch(tokens, tokens, [torch.tensor(starts)])


def build_layer(attention: str, shapes: Shapes, seq_len: int) -> tuple[Any, torch.Tensor]:
    """The attention of a one-block model of the family (llama3 or deepseek_v3, sized by ``shapes``) and the
    model's own rotary table, as the trainer builds them."""
    s = shapes
    if attention == "gqa":
        spec = get_model_spec("llama3")
        args = dataclasses.replace(spec.flavors["debug"], dim=s.dim, n_heads=s.heads, n_kv_heads=s.kv_heads,
                                   n_layers=1, vocab_size=256, max_seq_len=seq_len)
        if args.head_dim != s.head_dim:
            raise ValueError(f"llama3's head_dim is dim / heads = {args.head_dim}, not {s.head_dim}")
    else:
        spec = get_model_spec("deepseek_v3")
        # One dense block: the attention is what is measured; no rotary scaling at this length.
        args = dataclasses.replace(spec.flavors["debug"], dim=s.mla_dim, n_heads=s.heads, q_lora_rank=0,
                                   kv_lora_rank=s.kv_lora_rank, qk_nope_head_dim=s.nope_dim,
                                   qk_rope_head_dim=s.rope_dim, v_head_dim=s.v_dim, n_layers=1, n_dense_layers=1,
                                   vocab_size=256, rope_scaling=None, max_seq_len=seq_len)
    model: Any = spec.model_cls(args)
    model.init_weights()
    return model.layers["0"].attention, model.rope.cache


def measure_case(rank: int, cp: int, case: Case, settings: Settings, build_mask: BuildMask) -> RankResult:
    """This rank's numbers for one case (every rank of the group calls it together)."""
    torch.manual_seed(0)
    dtype = getattr(torch, settings.dtype)
    layer, table = build_layer(case.attention, settings.shapes, settings.seq_len)
    layer = layer.to(dtype)
    if cp > 1:
        layer.use_context_parallel(dist.group.WORLD)
    full = document_batch(settings.seq_len) if case.mask == "document" else Batch(
        torch.zeros(1, settings.seq_len, dtype=torch.int64), torch.zeros(1, settings.seq_len, dtype=torch.int64), [])
    mb = model_batch(full, document_mask=case.mask == "document", cp=cp, cp_rank=rank)
    kw = mb.model_kwargs
    # As Decoder.forward: per-token rotary rows (rope_at) and the mask from the layout's tensors (none: SDPA's
    # is_causal).
    rope = table if "positions" not in kw else table[kw["positions"]]
    mask = build_mask(kw["q_index"], kw["kv_index"], kw.get("q_doc"), kw.get("kv_doc")) if "q_index" in kw else None
    local = mb.inputs.shape[1]
    g = torch.Generator().manual_seed(1 + rank)
    width = layer.wo.weight.shape[0]  # the residual width: wo's output
    x = torch.randn(1, local, width, generator=g).to(dtype).requires_grad_(True)
    grad = torch.randn(1, local, width, generator=g).to(dtype)
    barrier = dist.barrier if cp > 1 else (lambda: None)
    with counted_collectives() as counter:
        saved = SavedBytes(list(layer.parameters()), None if mask is None else tuple(mask.shape))
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            out = layer(x, rope, mask=mask)
        out.backward(grad)
        first = (counter.gather_received, counter.scatter_sent)
        walls, cpus = [], []
        for i in range(settings.warmup + settings.repeats):
            layer.zero_grad(set_to_none=True)
            x.grad = None
            barrier()
            start, cpu_start = time.perf_counter(), time.thread_time()
            layer(x, rope, mask=mask).backward(grad)
            if i >= settings.warmup:
                walls.append(1e3 * (time.perf_counter() - start))
                cpus.append(1e3 * (time.thread_time() - cpu_start))
    return RankResult(cp, case, rank, walls, cpus, saved.total, saved.mask_total,
                      mask.nbytes if isinstance(mask, torch.Tensor) else 0, first[0], first[1], mb.attention_share)


def run_cp(cp: int, cases: list[Case], settings: Settings, build_mask: BuildMask, *,
           timeout_s: float = 1800) -> list[RankResult]:
    """Every rank's result for every case, on ``cp`` forked processes (they inherit the parent's imports)."""
    results = run_on_ranks(cp, measure_case, cases, settings, build_mask, label=f"cp={cp}", timeout_s=timeout_s)
    return sorted(results, key=lambda r: (cases.index(r.case), r.rank))
