"""apply_fsdp argument checks, made before any sharding (the sharding itself: tests/distributed)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from models.llama3.parallelize import LLAMA3_PARALLEL_PLAN
from torchtitan_lite.distributed.fsdp import apply_fsdp


def test_cpu_offload_needs_cuda():
    with pytest.raises(ValueError, match="fsdp_cpu_offload=true needs CUDA, but the mesh is on 'cpu'"):
        apply_fsdp(nn.Linear(2, 2), SimpleNamespace(device_type="cpu"), LLAMA3_PARALLEL_PLAN, cpu_offload=True)


def test_unknown_reshard_policy_is_refused():
    with pytest.raises(ValueError, match="fsdp_reshard_after_forward='sometimes' must be 'default', 'always' or 'never'"):
        apply_fsdp(nn.Linear(2, 2), SimpleNamespace(device_type="cpu"), LLAMA3_PARALLEL_PLAN, reshard_after_forward="sometimes")


def _fully_shard_calls(monkeypatch, model: nn.Module, plan, **kwargs) -> list[tuple[tuple[str, ...], bool, str]]:
    """(module names, reshard_after_forward, mesh) of every fully_shard call apply_fsdp makes, in order."""
    import torchtitan_lite.distributed.fsdp as fsdp

    names = {id(m): name for name, m in model.named_modules()}
    calls = []

    def record(modules, *, mesh, reshard_after_forward, **_):
        group = modules if isinstance(modules, list) else [modules]
        calls.append((tuple(names[id(m)] for m in group), reshard_after_forward, mesh.name))
    monkeypatch.setattr(fsdp, "fully_shard", record)
    mesh = SimpleNamespace(device_type="cuda", ndim=1, size=lambda: 2, name="fsdp")
    apply_fsdp(model, mesh, plan, **kwargs)
    return calls


def test_fsdp_units_are_the_plans_and_in_its_order(monkeypatch):
    """apply_fsdp shards what ParallelPlan.fsdp_units lists, in that order: the embedding, each block (its
    routed experts first, as their own unit, under EP), the head, the root; and the memory estimator's unit of
    every parameter (ParallelPlan.fsdp_unit) is one of them (experts counted with their block)."""
    import torch

    from models import DEEPSEEK_V3_SPEC
    from torchtitan_lite.protocols.model_spec import build_model_args

    spec = DEEPSEEK_V3_SPEC
    plan = spec.parallel_plan
    with torch.device("meta"):
        model = spec.model_cls(build_model_args(spec, "debug"))
    keys = list(model.layers.keys())
    expert_blocks = [k for k in keys if plan.experts in dict(model.layers[k].named_modules())]
    assert 0 < len(expert_blocks) < len(keys)  # a dense first block: the experts' units are per block
    experts_mesh = SimpleNamespace(shape=(2,), mesh_dim_names=("efsdp",), name="experts")
    calls = _fully_shard_calls(monkeypatch, model, plan, expert_mesh=experts_mesh)
    expected = [(("tok_embeddings",), True, "fsdp")]
    for k in keys:
        last = k == keys[-1]
        if k in expert_blocks:
            expected.append(((f"layers.{k}.moe.experts",), not last, "experts"))
        expected.append(((f"layers.{k}",), not last, "fsdp"))
    expected += [(("norm", "output"), False, "fsdp"), (("",), False, "fsdp")]
    assert calls == expected
    units = plan.fsdp_units(keys, first=True, last=True, tied=False, expert_blocks=expert_blocks)
    assert [u.modules or ("",) for u in units] == [c[0] for c in calls]
    unit_names = {u.name for u in units if u.kind != "experts"}
    assert {plan.fsdp_unit(name.rsplit(".", 1)[0], tied=False) for name, _ in model.named_parameters()} == unit_names - {"root"}
    assert plan.fsdp_unit("tok_embeddings", tied=True) == plan.fsdp_unit("output", tied=True) == "root"
