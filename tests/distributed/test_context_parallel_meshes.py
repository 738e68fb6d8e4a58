"""The meshes ParallelDims builds with a cp dimension, on 8 ranks, against groups computed by hand: rank =
((((pp * dp_replicate + r) * dp_shard + s) * cp + c) * tp + t), tp innermost. CP ranks read the same data
(one dp rank), FSDP shards over dp_shard x cp, the batch mesh sums over dp x cp, and EP borrows its ranks from
dp_shard x cp (the experts' own (efsdp, ep) mesh over the same ranks, in the world mesh's order)."""
from __future__ import annotations

import torch.distributed as dist
from _harness import run_ranks

from torchtitan_lite.mesh.parallel_dims import ParallelDims


def _ranks(mesh) -> list[int] | None:
    """The global ranks of this rank's group of a 1-D mesh (a flattened one included)."""
    return None if mesh is None else sorted(dist.get_process_group_ranks(mesh.get_group()))


def _describe(dims: ParallelDims) -> dict:
    fsdp = dims.fsdp_mesh
    efsdp = dims.expert_fsdp_mesh
    return {
        "ranks": (dims.pp_rank, dims.dp_rank, dims.cp_rank),
        "cp": _ranks(dims.cp_mesh), "cp_local": None if dims.cp_mesh is None else dims.cp_mesh.get_local_rank(),
        "dp": _ranks(dims.dp_mesh), "batch": _ranks(dims.batch_mesh), "pp": _ranks(dims.pp_mesh),
        "tp": _ranks(dims.tp_mesh), "ep": _ranks(dims.ep_mesh),
        "fsdp": None if fsdp is None else (fsdp.mesh_dim_names, tuple(fsdp.shape), _ranks(fsdp[fsdp.mesh_dim_names[-1]])),
        "efsdp": None if efsdp is None else (efsdp.mesh_dim_names, tuple(efsdp.shape),
                                             _ranks(efsdp[efsdp.mesh_dim_names[-1]])),
    }


def _worker(rank: int, world_size: int) -> dict:
    layouts = {
        "pp2_dp2_cp2": dict(dp_replicate=1, dp_shard=2, tp=1, pp=2, cp=2),
        "dp2_cp2_tp2": dict(dp_replicate=1, dp_shard=2, tp=2, cp=2),
        "hsdp2x2_cp2": dict(dp_replicate=2, dp_shard=2, tp=1, cp=2),
        "dp4_cp2_ep2": dict(dp_replicate=1, dp_shard=4, tp=1, cp=2, ep=2),
        "hsdp2x2_cp2_ep2": dict(dp_replicate=2, dp_shard=2, tp=1, cp=2, ep=2),
    }
    out = {}
    for name, degrees in layouts.items():
        dims = ParallelDims(world_size=world_size, **degrees)
        dims.build_mesh("cpu")
        out[name] = _describe(dims)
        if dims.expert_fsdp_mesh is not None and dims.hsdp_enabled:
            out[name]["efsdp_replicas"] = _ranks(dims.expert_fsdp_mesh["dp_replicate"])
    return out


def test_cp_meshes_on_eight_ranks_match_the_hand_computed_groups():
    results = run_ranks(_worker, 8)
    for rank, got in enumerate(results):
        # pp 2 x dp_shard 2 x cp 2: rank = 4 pp + 2 dp + c.
        pp, dp, c = rank // 4, rank // 2 % 2, rank % 2
        assert got["pp2_dp2_cp2"] == {
            "ranks": (pp, dp, c), "cp": [4 * pp + 2 * dp, 4 * pp + 2 * dp + 1], "cp_local": c,
            "dp": [4 * pp + c, 4 * pp + 2 + c], "batch": [4 * pp + i for i in range(4)],
            "pp": [2 * dp + c, 4 + 2 * dp + c], "tp": None, "ep": None,
            "fsdp": (("dp_shard_cp",), (4,), [4 * pp + i for i in range(4)]), "efsdp": None,
        }
        # dp_shard 2 x cp 2 x tp 2: rank = 4 dp + 2 c + t; the TP pair sits inside one CP rank.
        dp, c, t = rank // 4, rank // 2 % 2, rank % 2
        assert got["dp2_cp2_tp2"] == {
            "ranks": (0, dp, c), "cp": [4 * dp + t, 4 * dp + 2 + t], "cp_local": c,
            "dp": [2 * c + t, 4 + 2 * c + t], "batch": [t, 2 + t, 4 + t, 6 + t], "pp": None,
            "tp": [4 * dp + 2 * c, 4 * dp + 2 * c + 1], "ep": None,
            "fsdp": (("dp_shard_cp",), (4,), [t, 2 + t, 4 + t, 6 + t]), "efsdp": None,
        }
        # dp_replicate 2 x dp_shard 2 x cp 2 (HSDP): shards over dp_shard x cp, replicates over dp_replicate.
        r, s, c = rank // 4, rank // 2 % 2, rank % 2
        assert got["hsdp2x2_cp2"] == {
            "ranks": (0, 2 * r + s, c), "cp": [4 * r + 2 * s, 4 * r + 2 * s + 1], "cp_local": c,
            "dp": [c, 2 + c, 4 + c, 6 + c], "batch": list(range(8)), "pp": None, "tp": None, "ep": None,
            "fsdp": (("dp_replicate", "dp_shard_cp"), (2, 4), [4 * r + i for i in range(4)]), "efsdp": None,
        }
        # dp_shard 4 x cp 2 = 8 FSDP ranks = (efsdp 4, ep 2): the FSDP coordinate is 2 s + c = rank, so EP exchanges
        # tokens between the two CP ranks of one data shard, and each expert is sharded over the four ranks of
        # one ep coordinate.
        e, x, c = rank // 2, rank % 2, rank % 2
        assert got["dp4_cp2_ep2"] == {
            "ranks": (0, e, c), "cp": [2 * e, 2 * e + 1], "cp_local": c,
            "dp": [c, 2 + c, 4 + c, 6 + c], "batch": list(range(8)), "pp": None, "tp": None,
            "ep": [2 * e, 2 * e + 1],
            "fsdp": (("dp_shard_cp",), (8,), list(range(8))),
            "efsdp": (("efsdp",), (4,), [x, 2 + x, 4 + x, 6 + x]),
        }
        # HSDP 2 x dp_shard 2 x cp 2: in each replica the FSDP coordinate 2 s + c = (efsdp 2, ep 2); the expert
        # shard group is the ranks of one ep coordinate, replicated over dp_replicate.
        r, s, x = rank // 4, rank // 2 % 2, rank % 2
        got_hsdp_ep = got["hsdp2x2_cp2_ep2"]
        assert got_hsdp_ep["ep"] == [4 * r + 2 * s, 4 * r + 2 * s + 1]
        assert got_hsdp_ep["fsdp"] == (("dp_replicate", "dp_shard_cp"), (2, 4), [4 * r + i for i in range(4)])
        assert got_hsdp_ep["efsdp"] == (("dp_replicate", "efsdp"), (2, 2), [4 * r + x, 4 * r + 2 + x])
        assert got_hsdp_ep["efsdp_replicas"] == [rank % 4, 4 + rank % 4]
