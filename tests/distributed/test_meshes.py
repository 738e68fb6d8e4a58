"""The meshes ParallelDims builds on 4 ranks (with and without expert parallelism, and EP x TP), and pure replication
(dp_replicate=2, dp_shard=1) with TP."""
from __future__ import annotations

from _harness import run_ranks
from _llama_steps import Run, run_layout, single_process_results

from torchtitan_lite.mesh.parallel_dims import ParallelDims


def _describe(dims: ParallelDims) -> dict:
    return {
        "dp_rank": dims.dp_rank,
        "dp_mesh": None if dims.dp_mesh is None else (dims.dp_mesh.size(), dims.dp_mesh.get_local_rank()),
        "fsdp_mesh": None if dims.fsdp_mesh is None else (tuple(dims.fsdp_mesh.shape), dims.fsdp_mesh.mesh_dim_names),
        "tp_mesh": None if dims.tp_mesh is None else (dims.tp_mesh.size(), dims.tp_mesh.get_local_rank()),
    }


def _describe_ep(dims: ParallelDims) -> dict:
    efsdp = dims.expert_fsdp_mesh
    return {
        "ep_mesh": None if dims.ep_mesh is None else (dims.ep_mesh.size(), dims.ep_mesh.get_local_rank()),
        "expert_fsdp_mesh": None if efsdp is None else (tuple(efsdp.shape), efsdp.mesh_dim_names,
                                                         tuple(efsdp.get_coordinate() or ())),
    }


def _worker(rank: int, world_size: int) -> dict:
    meshes = {}
    for degrees in [(2, 1, 2), (1, 2, 2), (1, 4, 1), (1, 1, 4)]:
        dims = ParallelDims(*degrees, world_size=world_size)
        dims.build_mesh("cpu")
        meshes[degrees] = _describe(dims)
    ep_meshes = {}
    for degrees, ep in [((1, 4, 1), 2), ((2, 2, 1), 2), ((1, 4, 1), 4), ((1, 4, 1), 1)]:
        dims = ParallelDims(*degrees, world_size=world_size, ep=ep)
        dims.build_mesh("cpu")
        ep_meshes[degrees + (ep,)] = _describe(dims) | _describe_ep(dims)
    dims = ParallelDims(1, 2, 2, world_size=world_size, ep=2)
    dims.build_mesh("cpu")
    ep_tp = {"ep_ranks": dims.ep_mesh.mesh.tolist(), "tp_ranks": dims.tp_mesh.mesh.tolist(),
             "ep_tp_mesh": (dims.ep_tp_mesh.mesh.tolist(), dims.ep_tp_mesh.mesh_dim_names),
             "expert_fsdp_mesh": (tuple(dims.expert_fsdp_mesh.shape), dims.expert_fsdp_mesh.mesh_dim_names)}
    replicate_tp = Run(dp_replicate=2, tp=2, steps=3)
    return {"meshes": meshes, "ep_meshes": ep_meshes, "ep_tp": ep_tp,
            "losses": run_layout(rank, world_size, replicate_tp)["losses"]}


def test_meshes_on_four_ranks_and_replication_with_tp_trains_like_one_process():
    results = run_ranks(_worker, 4)
    for rank, result in enumerate(results):
        m = result["meshes"]
        # (dp_replicate, dp_shard, tp) grid, tp innermost: ranks 2k and 2k+1 form a TP group.
        assert m[(2, 1, 2)] == {"dp_rank": rank // 2, "dp_mesh": (2, rank // 2),
                                "fsdp_mesh": ((2, 1), ("dp_replicate", "dp_shard")), "tp_mesh": (2, rank % 2)}
        assert m[(1, 2, 2)] == {"dp_rank": rank // 2, "dp_mesh": (2, rank // 2),
                                "fsdp_mesh": ((2,), ("dp_shard",)), "tp_mesh": (2, rank % 2)}
        assert m[(1, 4, 1)] == {"dp_rank": rank, "dp_mesh": (4, rank), "fsdp_mesh": ((4,), ("dp_shard",)),
                                "tp_mesh": None}
        assert m[(1, 1, 4)] == {"dp_rank": 0, "dp_mesh": None, "fsdp_mesh": None, "tp_mesh": (4, rank)}
        # EP borrows the inner ranks of dp_shard: dp_shard = (efsdp, ep), ep inner; the data-parallel meshes
        # are those of the same degrees without EP.
        e = result["ep_meshes"]
        assert e[(1, 4, 1, 2)] == m[(1, 4, 1)] | {"ep_mesh": (2, rank % 2),
                                                  "expert_fsdp_mesh": ((2,), ("efsdp",), (rank // 2,))}
        assert e[(2, 2, 1, 2)] == {"dp_rank": rank, "dp_mesh": (4, rank),
                                   "fsdp_mesh": ((2, 2), ("dp_replicate", "dp_shard")), "tp_mesh": None,
                                   "ep_mesh": (2, rank % 2),
                                   "expert_fsdp_mesh": ((2, 1), ("dp_replicate", "efsdp"), (rank // 2, 0))}
        assert e[(1, 4, 1, 4)]["ep_mesh"] == (4, rank) and e[(1, 4, 1, 4)]["expert_fsdp_mesh"][:2] == ((1,), ("efsdp",))
        assert e[(1, 4, 1, 1)] == m[(1, 4, 1)] | {"ep_mesh": None, "expert_fsdp_mesh": None}
        # EP 2 x TP 2: an EP group is the ranks of one tp coordinate (the same hidden-dim slice of the experts),
        # so the TP ranks of a data rank, which route the same tokens, exchange them in separate groups.
        assert result["ep_tp"] == {"ep_ranks": [rank % 2, rank % 2 + 2], "tp_ranks": [rank // 2 * 2, rank // 2 * 2 + 1],
                                   "ep_tp_mesh": ([[0, 1], [2, 3]], ("ep", "tp")), "expert_fsdp_mesh": ((1,), ("efsdp",))}
    reference = single_process_results(Run(steps=3))["losses"]
    # fp32 summation-order differences only (see test_parallel_layouts).
    for a, b in zip(results[0]["losses"], reference, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b)
