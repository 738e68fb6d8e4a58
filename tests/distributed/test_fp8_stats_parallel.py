"""FP8 stats under FSDP (float8 all-gather: the weight measured from the master shards) and tensor
parallelism: rank 0 reports the numbers of the global micro-batch, as one process computes them."""
from __future__ import annotations

import dataclasses

import pytest
from _harness import run_ranks
from _llama_steps import GLOBAL_BATCH, Run, build, global_batches

from torchtitan_lite.components.loss import IGNORE_INDEX, cross_entropy_sum
from torchtitan_lite.components.quantization.fp8_stats import Fp8StatsCollector
from torchtitan_lite.distributed.tensor_parallel import loss_parallel_context

FSDP = Run(dp_shard=2, float8="tensorwise", fp8_all_gather=True, steps=1)
TP_ROWWISE = Run(tp=2, float8="rowwise", steps=1)
TP_TENSORWISE = Run(tp=2, float8="tensorwise", steps=1)


def _health(run: Run, rows: slice | None = None) -> dict:
    """One stats micro-batch of ``run`` (this rank's data-parallel share, or ``rows`` of the global batch)."""
    model, dims, precision, config = build(run)
    inputs, labels = global_batches(1)[0]
    global_tokens = (labels != IGNORE_INDEX).sum().float()
    if rows is None:
        per_rank = GLOBAL_BATCH // dims.dp_degree
        rows = slice(dims.dp_rank * per_rank, (dims.dp_rank + 1) * per_rank)
    group = dims.dp_mesh.get_group() if dims.dp_mesh is not None else None
    collector = Fp8StatsCollector([model], freq=1, dp_group=group)
    with collector.capture(), precision.autocast(), loss_parallel_context(config.loss_parallel):
        loss_sum, _ = cross_entropy_sum(model(inputs[rows]), labels[rows])
        (loss_sum / global_tokens).backward()
    return {h.fqn: h for h in collector.collect()}


def _worker(rank: int, world_size: int) -> dict:
    return {"fsdp": _health(FSDP), "tp_rowwise": _health(TP_ROWWISE), "tp_tensorwise": _health(TP_TENSORWISE)}


@pytest.fixture(scope="module")
def parallel():
    return run_ranks(_worker, 2)


def test_fsdp_ranks_sum_their_micro_batches_and_measure_the_master_weights(parallel):
    # One process measuring each data-parallel rank's half: per-rank tensorwise scales, so the global share
    # is the mean of the two halves' (equal sizes) and the amax their maximum. float32 and the same shapes
    # as on each rank: the numbers are identical, not just close.
    one_process = Run(float8=FSDP.float8, steps=1)  # no FSDP: each half measured on its own
    halves = [_health(one_process, slice(0, 2)), _health(one_process, slice(2, 4))]
    for rank_result in parallel:
        got = rank_result["fsdp"]
        assert set(got) == set(halves[0]) and len(got) == 14  # 7 float8 Linears x 2 blocks
        for fqn, health in got.items():
            parts = [half[fqn] for half in halves]
            assert health.amax == {k: max(p.amax[k] for p in parts) for k in health.amax}
            assert health.amax["weight"] == parts[0].amax["weight"]  # float32 master weight, gathered
            for name, share in health.underflow.items():
                assert share == pytest.approx(sum(p.underflow[name] for p in parts) / 2, abs=1e-12)
            low, high = sorted(p.output_sqnr_db for p in parts)
            assert low - 1e-9 <= health.output_sqnr_db <= high + 1e-9


# Underflow shares of the TP run against one process (rowwise, one micro-batch; 2-core AMD EPYC Zen 5 CPU).
# Casts of activations, weights and gi-GEMM operands: measured differences 0 while the smallest nonzero
# share is 4.1e-5 (one element in 24,576), so an absolute 1e-5 tolerates no moved element. The weight-
# gradient cast of the output gradient (grad_output_gw, 128 tokens per column): sharded GEMMs sum in another
# order, a column amax can cross a power of 2 and halve that column's scale; measured shares 1.95e-3 (TP)
# against 7.81e-3 (one process) at worst, a difference of 0.75 of the larger. Both bounds are below the
# shares they compare, so a layer reported without its underflow fails (the negative control below).
UNDERFLOW_ABS = 1e-5
GW_UNDERFLOW_REL = 0.8


def _underflow_mismatches(got: dict, single: dict) -> list[tuple[str, str, float, float]]:
    """(fqn, cast, share, single-process share) of every cast whose underflow share is out of tolerance."""
    bad = []
    for fqn, health in got.items():
        for name, share in health.underflow.items():
            ref = single[fqn].underflow[name]
            limit = GW_UNDERFLOW_REL * max(share, ref) if name == "grad_output_gw" else UNDERFLOW_ABS
            if abs(share - ref) > limit:
                bad.append((fqn, name, share, ref))
    return bad


def test_tensor_parallel_layers_are_measured_whole(parallel):
    single = _health(TP_ROWWISE.single_process())
    # Enough underflow to compare: both kinds of cast report nonzero shares in several layers.
    nonzero = [(fqn, n) for fqn, h in single.items() for n, share in h.underflow.items() if share > 0]
    assert len(nonzero) >= 10 and {n for _, n in nonzero} >= {"input", "grad_output_gw"}, nonzero
    for rank_result in parallel:
        got = rank_result["tp_rowwise"]
        assert set(got) == set(single)
        for fqn, health in got.items():
            # Sharded GEMMs sum in another order: activations and gradients differ by float32 rounding.
            # The weights are the same exactly.
            assert health.amax["weight"] == single[fqn].amax["weight"]
            assert health.amax["input"] == pytest.approx(single[fqn].amax["input"], rel=1e-5)
            assert health.output_sqnr_db == pytest.approx(single[fqn].output_sqnr_db, abs=0.05)
            assert len(health.casts) == 6 and set(health.saturated) == set(health.casts)
        assert _underflow_mismatches(got, single) == []
    # Negative control: the same report with underflow not measured (all shares 0) fails in every layer
    # whose single-process share is nonzero.
    unmeasured = {fqn: dataclasses.replace(h, underflow={n: 0.0 for n in h.underflow})
                  for fqn, h in parallel[0]["tp_rowwise"].items()}
    assert {(fqn, n) for fqn, n, _, _ in _underflow_mismatches(unmeasured, single)} == set(nonzero)


def test_tensorwise_tp_measures_what_reaches_the_linear_in_high_precision(parallel):
    got = parallel[0]["tp_tensorwise"]
    # Float8 TP communication casts inputs and output gradients before the Linear: only the weight remains.
    for health in got.values():
        assert set(health.amax) == {"weight"} and set(health.underflow) == {"weight"}
        assert health.output_sqnr_db is None
