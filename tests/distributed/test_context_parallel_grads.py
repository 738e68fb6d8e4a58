"""Context parallelism against one process, parameter by parameter: a model parallelized with CP (each rank holding
its head-tail chunks of every sequence, K/V all-gathered) gives the one-process losses of 10 AdamW steps (3 for
the compositions) and the first step's gradients, under the causal and the document mask, at CP 2 and CP 4, for
Llama 3 (grouped-query attention) and DeepSeek-V3 (multi-head latent attention: the compressed latent and rotary key gathered; a
sequence-level balance loss summed over CP), alone and with FSDP, TP or EP, under full and selective activation
checkpointing.

Tolerance 1e-5 relative, per step loss and per parameter gradient (float32): CP changes only the order of sums
(FSDP's reduce-scatter of the chunks' gradients, the attention over gathered keys). Negative controls, planted and
seen red: a gather whose backward keeps each rank's own gradient (no reduce-scatter), and the balance loss without
its CP sums.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from _harness import run_ranks
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from models.deepseek_v3 import DEEPSEEK_V3_FLAVORS
from models.llama3 import LLAMA3_FLAVORS
from torchtitan_lite.components.data.batch import Batch
from torchtitan_lite.components.data.sequence_layout import model_batch
from torchtitan_lite.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan_lite.components.precision import Precision
from torchtitan_lite.config.sections import ActivationCheckpointConfig
from torchtitan_lite.distributed.parallelize import parallelize
from torchtitan_lite.mesh.parallel_dims import ParallelDims
from torchtitan_lite.protocols.model_spec import get_model_spec
from torchtitan_lite.protocols.module_names import unwrapped_name
from torchtitan_lite.protocols.parallelize import ParallelizeContext

SEQ, BATCH, STEPS, LR = 64, 4, 10, 3e-3
RTOL = 1e-5
ARGS = {
    "llama3": dataclasses.replace(LLAMA3_FLAVORS["debug"], n_layers=2),
    # A visible balance loss (the debug flavor's 1e-4 would hide a wrong CP sum under the language-model gradient).
    "deepseek_v3": dataclasses.replace(
        DEEPSEEK_V3_FLAVORS["debug"], n_layers=2,
        moe=dataclasses.replace(DEEPSEEK_V3_FLAVORS["debug"].moe, aux_loss_coeff=0.1)),
}


def _batches(vocab: int, steps: int) -> list[Batch]:
    """``steps`` batches of 4 rows of 64 tokens, documents of unequal lengths (one row a single document), 10% of
    labels ignored."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.1] = IGNORE_INDEX
        starts = [torch.tensor([0, 9, 30, 41]), torch.tensor([17, 50]), torch.tensor([0]), torch.tensor([3, 5, 60])]
        out.append(Batch(tokens[:, :-1].contiguous(), labels, starts))
    return out


def _initial(family: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in get_model_spec(family).model_cls(ARGS[family]).state_dict().items()}


def _train(model: torch.nn.Module, *, family: str, document: bool, cp: int, cp_rank: int, rows: slice, steps: int,
           group=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``steps`` AdamW steps; the step losses (summed over ``group``) and the first step's gradients (whole tensors)."""
    import torch.distributed as dist

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    losses: list[float] = []
    first: dict[str, torch.Tensor] = {}
    for batch in _batches(ARGS[family].vocab_size, steps):
        shard = Batch(batch.inputs[rows], batch.labels[rows], batch.doc_starts[rows])
        mb = model_batch(shard, document_mask=document, cp=cp, cp_rank=cp_rank)
        tokens = int((batch.labels != IGNORE_INDEX).sum())
        loss = cross_entropy_sum(model(mb.inputs, **mb.model_kwargs), mb.labels)[0] / tokens
        loss.backward()
        if not first:
            first = {unwrapped_name(n): (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
                     for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if group is not None:
            dist.all_reduce(loss, group=group)
        losses.append(float(loss))
    return losses, first


def _one_process(family: str, document: bool, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = get_model_spec(family).model_cls(ARGS[family])
    model.load_state_dict(_initial(family))
    return _train(model, family=family, document=document, cp=1, cp_rank=0, rows=slice(None), steps=steps)


def _worker(rank: int, world_size: int, family: str, document: bool, cp: int, dp: int, tp: int, ac: str,
            ep: int, steps: int) -> dict:
    spec = get_model_spec(family)
    dims = ParallelDims(1, dp, tp, world_size=world_size, cp=cp, ep=ep)
    dims.build_mesh("cpu")
    precision = Precision.Config(param_dtype="float32").build(device="cpu", fsdp_enabled=True)
    with torch.device("meta"):
        model = spec.model_cls(ARGS[family])
    parallelize(model, spec.parallel_plan, ParallelizeContext(
        parallel_dims=dims, mp_policy=precision.mp_policy(), sequence_parallel=tp > 1, loss_parallel=False,
        activation_checkpoint=ActivationCheckpointConfig(mode=ac), compile_model=False, compile_backend="inductor",
        compile_fullgraph=True, fsdp_reshard_after_forward="default", fsdp_cpu_offload=False), label=family)
    model.to_empty(device="cpu")
    model.init_weights()
    set_model_state_dict(model, _initial(family), options=StateDictOptions(full_state_dict=True))
    model.set_aux_loss_scale(1.0 / dp)  # as the trainer weights it: the data-parallel ranks' gradients are summed
    per_rank = BATCH // dp
    rows = slice(dims.dp_rank * per_rank, (dims.dp_rank + 1) * per_rank)
    losses, grads = _train(model, family=family, document=document, cp=cp, cp_rank=dims.cp_rank, rows=rows,
                           steps=steps, group=dims.batch_mesh.get_group())
    return {"losses": losses, "grads": grads if rank == 0 else None}


def _relative_errors(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    assert set(got) == set(ref)
    return {n: float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref}


CASES = [
    # family, document mask, cp, dp_shard, tp, AC mode, ep
    pytest.param("llama3", False, 2, 1, 1, "none", 1, id="llama3-causal-cp2"),
    pytest.param("llama3", True, 2, 1, 1, "none", 1, id="llama3-document-cp2"),
    pytest.param("llama3", False, 4, 1, 1, "none", 1, id="llama3-causal-cp4"),
    pytest.param("llama3", True, 4, 1, 1, "selective", 1, id="llama3-document-cp4-selective-ac"),
    pytest.param("deepseek_v3", False, 2, 1, 1, "none", 1, id="deepseek_v3-causal-cp2"),
    pytest.param("deepseek_v3", True, 2, 1, 1, "full", 1, id="deepseek_v3-document-cp2-full-ac"),
    pytest.param("deepseek_v3", False, 4, 1, 1, "none", 1, id="deepseek_v3-causal-cp4"),
    pytest.param("deepseek_v3", True, 4, 1, 1, "none", 1, id="deepseek_v3-document-cp4"),
    pytest.param("deepseek_v3", True, 2, 2, 1, "none", 1, id="deepseek_v3-document-fsdp2-cp2"),
    pytest.param("llama3", True, 2, 1, 2, "none", 1, id="llama3-document-cp2-tp2"),
    # EP borrows the CP ranks: the two ranks of one sequence exchange its tokens with each other's experts.
    pytest.param("deepseek_v3", True, 2, 1, 1, "none", 2, id="deepseek_v3-document-cp2-ep2"),
]


@pytest.mark.parametrize(("family", "document", "cp", "dp", "tp", "ac", "ep"), CASES)
def test_context_parallel_trains_as_one_process(family, document, cp, dp, tp, ac, ep):
    # The family x mask x CP degree matrix trains 10 steps; the compositions with FSDP, TP and EP (whose 4-rank
    # DTensor steps are slow on 2 cores) 3.
    steps = STEPS if dp * tp * ep == 1 else 3
    ref_losses, ref_grads = _one_process(family, document, steps)
    results = run_ranks(_worker, cp * dp * tp, family, document, cp, dp, tp, ac, ep, steps)
    for r in results:
        worst_loss = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref_losses, strict=True))
        assert worst_loss <= RTOL, (worst_loss, r["losses"], ref_losses)
    errors = _relative_errors(results[0]["grads"], ref_grads)
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= RTOL, (worst, errors[worst])
