"""Parallelism degrees and the device meshes built from them.

The world is laid out as a (pp, dp_replicate, dp_shard, cp, tp) grid, tp innermost so that tensor-parallel ranks
are neighbours (same host on GPU clusters) and pp outermost so that pipeline stages, which exchange only one
activation per micro-batch, may sit on different hosts. Context parallelism (cp) splits each sequence over its
ranks: they read the same samples but hold different tokens, so they hold the same weights and get different
gradients; FSDP therefore shards over dp_shard x cp flattened (as torchtitan does), and the token and loss sums
run over the batch mesh (dp_replicate, dp_shard, cp). With cp=1 every mesh, name and log line is the one
without it.

Expert parallelism borrows its ranks from dp_shard: dp_shard is unflattened into (efsdp, ep), ep inner, so the
ranks that exchange tokens are neighbours and the efsdp ranks that hold the same experts shard those experts'
weights (FSDP; under CP over efsdp x cp, since CP ranks hold the same experts too). Every check here is
arithmetic on the degrees, so a wrong layout fails before any process group exists.
"""
from __future__ import annotations

import logging
import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan_lite.protocols.model_shape import ModelShape

logger = logging.getLogger(__name__)

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


def _grid(cp: int, pp: int, dp_replicate: int, dp_shard: int | None, tp: int) -> str:
    """'pp x dp_replicate x dp_shard x tp = 1 x 2 x 4 x 2' (dp_shard None: left out; cp named only when > 1)."""
    pairs = [("pp", pp), ("dp_replicate", dp_replicate)] + ([("dp_shard", dp_shard)] if dp_shard is not None else [])
    pairs += ([("cp", cp)] if cp > 1 else []) + [("tp", tp)]
    return " x ".join(n for n, _ in pairs) + " = " + " x ".join(str(v) for _, v in pairs)


class ParallelDims:
    """Validated degrees; `build_mesh` then creates the named meshes (none at all for a single process)."""

    def __init__(self, dp_replicate: int, dp_shard: int, tp: int, world_size: int, ep: int = 1, pp: int = 1,
                 cp: int = 1) -> None:
        for name, value in (("world_size", world_size), ("parallelism.dp_replicate", dp_replicate),
                            ("parallelism.tp", tp), ("parallelism.ep", ep), ("parallelism.pp", pp),
                            ("parallelism.cp", cp)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if not isinstance(dp_shard, int) or (dp_shard < 1 and dp_shard != -1):
            raise ValueError(
                f"parallelism.dp_shard={dp_shard!r} must be a positive integer, or -1 to use the ranks left "
                "after pp, dp_replicate" + (", cp" if cp > 1 else "") + " and tp"
            )
        self.cp = cp
        filled = dp_shard == -1
        others = pp * dp_replicate * cp * tp
        if dp_shard == -1:
            if world_size % others != 0:
                raise ValueError(
                    f"parallelism.dp_shard=-1 cannot fill world size {world_size}: it is not divisible by "
                    f"{_grid(cp, pp, dp_replicate, None, tp)} = {others}; choose degrees whose "
                    f"product divides {world_size}"
                )
            dp_shard = world_size // others
        product = others * dp_shard
        if product != world_size:
            raise ValueError(
                f"parallelism degrees {_grid(cp, pp, dp_replicate, dp_shard, tp)} = {product} must equal the world "
                f"size {world_size}; change the degrees (dp_shard=-1 takes the rest) or launch with that many processes"
            )
        if cp > 1 and (dp_shard * cp) % ep != 0:
            raise ValueError(
                f"parallelism.ep={ep} must divide parallelism.dp_shard x parallelism.cp = {dp_shard} x {cp}: under "
                f"context parallelism the experts are split over the FSDP ranks, dp_shard x cp = {dp_shard * cp}; use "
                f"an ep among the divisors of {dp_shard * cp}, or raise dp_shard"
            )
        if cp == 1 and dp_shard % ep != 0 and filled:
            # dp_shard took what the processes left: more processes are the fix, so name how many.
            need = others * math.ceil(dp_shard / ep) * ep
            step = "" if need == others * ep else f"; any multiple of {others * ep} runs"
            raise ValueError(
                f"parallelism.ep={ep} splits the experts over data-parallel (FSDP) ranks, and {world_size} process(es) "
                f"leave parallelism.dp_shard={dp_shard} after {_grid(cp, pp, dp_replicate, None, tp)} = "
                f"{others}: this layout needs {need} processes ({_grid(cp, pp, dp_replicate, need // others, tp)}"
                f"{step}); launch {need} (NPROC={need}, or NGPU={need} on GPUs) or "
                + ("drop expert parallelism (ep=1)" if dp_shard == 1 else f"use an ep that divides {dp_shard}")
            )
        if cp == 1 and dp_shard % ep != 0:
            raise ValueError(
                f"parallelism.ep={ep} must divide parallelism.dp_shard={dp_shard}: expert parallelism splits "
                f"the experts over data-parallel (FSDP) ranks, so ep cannot exceed them; use an ep among the "
                f"divisors of {dp_shard}, or raise dp_shard"
            )
        self.dp_replicate = dp_replicate
        self.dp_shard = dp_shard
        self.tp = tp
        self.ep = ep
        self.pp = pp
        self.world_size = world_size
        self.world_mesh: DeviceMesh | None = None
        self._dp_mesh: DeviceMesh | None = None
        self._fsdp_shard_mesh: DeviceMesh | None = None
        self._batch_mesh: DeviceMesh | None = None
        self._expert_mesh: DeviceMesh | None = None

    def validate_for_model(self, args: ModelShape, seq_len: int, *, sequence_parallel: bool = True) -> None:
        """Check that the model's shapes split over `tp` and the sequence over `cp` (``args``: the family's args)."""
        self._validate_sequence_split(seq_len, sequence_parallel=sequence_parallel)
        if self.tp == 1:
            return
        n_kv_heads = args.kv_heads
        if args.n_heads % self.tp != 0:
            raise ValueError(
                f"parallelism.tp={self.tp} must divide the model's n_heads={args.n_heads} (each rank computes "
                f"whole attention heads); use a tp among the divisors of {args.n_heads}"
            )
        if n_kv_heads % self.tp != 0:
            raise ValueError(
                f"parallelism.tp={self.tp} must divide the model's n_kv_heads={n_kv_heads} (each rank holds "
                f"whole key/value heads); use a tp among the divisors of {n_kv_heads}"
            )
        if sequence_parallel and seq_len % self.tp != 0:
            raise ValueError(
                f"training.seq_len={seq_len} must be divisible by parallelism.tp={self.tp} when sequence "
                "parallelism shards activations along the sequence; change seq_len or set "
                "parallelism.enable_sequence_parallel=false"
            )
        if args.tie_word_embeddings:
            raise ValueError(
                f"parallelism.tp={self.tp} does not support tied embeddings: the embedding is sharded by "
                "vocabulary rows and the output projection by vocabulary columns of the same matrix; use "
                "parallelism.tp=1 (FSDP) for this flavor"
            )

    def _validate_sequence_split(self, seq_len: int, *, sequence_parallel: bool) -> None:
        """CP cuts every sequence into 2 x cp chunks (rank r holds chunks r and 2 cp - 1 - r, which balances the
        causal work), so seq_len must split into them; sequence parallelism then splits each rank's part over tp."""
        if self.cp == 1:
            return
        if seq_len % (2 * self.cp) != 0:
            raise ValueError(
                f"training.seq_len={seq_len} must be divisible by 2 x parallelism.cp = {2 * self.cp}: context "
                f"parallelism cuts each sequence into 2 x cp load-balanced chunks; use a seq_len that is a multiple "
                f"of {2 * self.cp}, or a cp that divides seq_len / 2"
            )
        if sequence_parallel and self.tp > 1 and (seq_len // self.cp) % self.tp != 0:
            raise ValueError(
                f"training.seq_len / parallelism.cp = {seq_len} / {self.cp} = {seq_len // self.cp} tokens per rank "
                f"must be divisible by parallelism.tp={self.tp} when sequence parallelism shards them; change "
                "seq_len or set parallelism.enable_sequence_parallel=false"
            )

    # ----------------------------------------------------------------------------------------------
    # Degrees

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_enabled(self) -> bool:
        return self.dp_degree > 1

    @property
    def fsdp_enabled(self) -> bool:
        """Parameters are wrapped by FSDP2 whenever data or context is parallel (HSDP with shard size 1 is
        replication; CP ranks hold the same weights and sum their gradients, so they join the FSDP group)."""
        return self.dp_degree * self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def expert_fsdp_degree(self) -> int:
        """The FSDP ranks (dp_shard, under CP dp_shard x cp) left after EP: how many ranks shard each expert's
        weights."""
        return self.dp_shard * self.cp // self.ep

    @property
    def dp_rank(self) -> int:
        """This rank's data shard (0..dp_degree-1); the tp and cp ranks of one group and the pipeline stages of
        one data shard read the same data."""
        if self.world_size == 1:
            return 0
        return (dist.get_rank() // (self.tp * self.cp)) % self.dp_degree

    @property
    def cp_rank(self) -> int:
        """This rank's place in its context-parallel group (0..cp-1): which chunks of each sequence it holds."""
        if self.world_size == 1:
            return 0
        return (dist.get_rank() // self.tp) % self.cp

    @property
    def pp_rank(self) -> int:
        """This rank's position in its pipeline (0..pp-1); pp is the outermost mesh dimension."""
        if self.world_size == 1:
            return 0
        return dist.get_rank() // (self.dp_degree * self.cp * self.tp)

    # ----------------------------------------------------------------------------------------------
    # Meshes

    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Create the world mesh (needs the default process group); returns None for a single process."""
        if self.world_size == 1:
            return None
        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            actual = dist.get_world_size() if dist.is_initialized() else "no process group"
            raise RuntimeError(
                f"ParallelDims was validated for world size {self.world_size} but the process group has "
                f"{actual}; launch with torchrun --nproc-per-node {self.world_size} (or NPROC/NGPU)"
            )
        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                mesh_dim_names=MESH_DIM_NAMES)
        self._dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
        if self.cp_enabled:
            # Flattened only under CP: with cp=1 FSDP and the sums keep the plain dimensions they always had.
            self._fsdp_shard_mesh = mesh["dp_shard", "cp"]._flatten(mesh_dim_name="dp_shard_cp")
            self._batch_mesh = mesh["dp_replicate", "dp_shard", "cp"]._flatten(mesh_dim_name="batch")
        if self.ep_enabled and self.cp_enabled:
            # EP takes its ranks from dp_shard x cp (the FSDP ranks), as torchtitan does: the experts' mesh is its own
            # root over the same ranks, (pp, dp_replicate, efsdp, ep, tp) with efsdp x ep = dp_shard x cp in the world
            # mesh's rank order, so that the experts' 2-D (efsdp, ep) layout is made of contiguous dimensions (a
            # flattened (efsdp, cp) beside ep is not a mesh DTensor can reduce over). EP then exchanges tokens
            # between CP ranks as between data ranks: routing is per token, whatever part of a sequence it is.
            self._expert_mesh = init_device_mesh(
                device_type, (self.pp, self.dp_replicate, self.expert_fsdp_degree, self.ep, self.tp),
                mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep", "tp"))
        elif self.ep_enabled:
            # The same ranks as the world mesh, dp_shard seen as (efsdp, ep): the meshes sliced from it share
            # the world's root, which FSDP needs to shard the EP-sharded expert weights further. The dimension
            # goes by index: torch 2.11's _unflatten refuses a name that IS one of the mesh's (inverted check).
            self._expert_mesh = mesh._unflatten(MESH_DIM_NAMES.index("dp_shard"), (self.expert_fsdp_degree, self.ep),
                                                ("efsdp", "ep"))
        self.world_mesh = mesh
        experts = f" (ep={self.ep} x efsdp={self.expert_fsdp_degree})" if self.ep_enabled else ""
        cp = f" cp={self.cp}" if self.cp_enabled else ""
        logger.info("device mesh %s: pp=%d dp_replicate=%d dp_shard=%d%s tp=%d%s", device_type, self.pp,
                    self.dp_replicate, self.dp_shard, cp, self.tp, experts)
        return mesh

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """1-D mesh over all data-parallel ranks, for data loading and token / loss sums."""
        return self._dp_mesh if self.world_mesh is not None and self.dp_enabled else None

    @property
    def batch_mesh(self) -> DeviceMesh | None:
        """1-D mesh over every rank that holds different tokens of one step (dp x cp): token, loss and statistic
        sums run over it. Without CP it is ``dp_mesh``; None when dp x cp is 1."""
        if self.world_mesh is None or self.dp_degree * self.cp == 1:
            return None
        return self._batch_mesh if self.cp_enabled else self._dp_mesh

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        """1-D mesh of the ranks that split one sequence (same data shard, pipeline stage and tp coordinate)."""
        return self.world_mesh["cp"] if self.world_mesh is not None and self.cp_enabled else None

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """dp_shard (FSDP) or (dp_replicate, dp_shard) (HSDP) mesh that parameters are sharded over; under CP
        dp_shard x cp flattened (dp_shard_cp) takes dp_shard's place."""
        if self.world_mesh is None or not self.fsdp_enabled:
            return None
        if self.hsdp_enabled:
            return self.world_mesh["dp_replicate", "dp_shard_cp" if self.cp_enabled else "dp_shard"]
        return self._fsdp_shard_mesh if self._fsdp_shard_mesh is not None else self.world_mesh["dp_shard"]

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """1-D mesh of the ranks that split the experts and exchange tokens (all-to-all); None without EP. Under
        TP it joins the ranks of one tp coordinate (tp stays innermost), which hold the same hidden-dim slice."""
        return self._expert_mesh["ep"] if self._expert_mesh is not None else None

    @property
    def ep_tp_mesh(self) -> DeviceMesh | None:
        """2-D (ep, tp) mesh the routed expert weights are split over when EP and TP are both on: experts over
        ep, every expert's hidden dim over tp (the same tp groups as ``tp_mesh``); None otherwise."""
        if self._expert_mesh is None or not self.tp_enabled:
            return None
        return self._expert_mesh["ep", "tp"]

    @property
    def expert_fsdp_mesh(self) -> DeviceMesh | None:
        """The mesh expert weights are FSDP-sharded over under EP: efsdp (the FSDP ranks holding the same experts),
        with dp_replicate in front for HSDP; None without EP."""
        if self._expert_mesh is None:
            return None
        return self._expert_mesh["dp_replicate", "efsdp"] if self.hsdp_enabled else self._expert_mesh["efsdp"]

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.world_mesh["tp"] if self.world_mesh is not None and self.tp_enabled else None

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        """1-D mesh of the ranks of this rank's pipeline (same data shard and tp coordinate); None without PP."""
        return self.world_mesh["pp"] if self.world_mesh is not None and self.pp_enabled else None

    def describe(self) -> str:
        """One line naming the active layouts, e.g. 'HSDP 2x2 + TP 2'."""
        parts = []
        if self.pp_enabled:
            parts.append(f"PP {self.pp}")
        if self.hsdp_enabled:
            parts.append(f"HSDP {self.dp_replicate}x{self.dp_shard}")
        elif self.dp_degree > 1:
            parts.append(f"FSDP {self.dp_shard}")
        if self.cp_enabled:
            parts.append(f"CP {self.cp}")
        if self.tp_enabled:
            parts.append(f"TP {self.tp}")
        if self.ep_enabled:
            parts.append(f"EP {self.ep}")
        return " + ".join(parts) if parts else "single process"

    def __repr__(self) -> str:
        return (f"ParallelDims(pp={self.pp}, dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}, tp={self.tp}, "
                f"ep={self.ep}, " + (f"cp={self.cp}, " if self.cp_enabled else "") + f"world_size={self.world_size})")
