"""Where every parameter of a config's model lives, per rank: built on the meta device, sharded on paper.

The shapes follow what `models.llama3.parallelize` does at run time:

- TP (`torchtitan_lite.distributed.tensor_parallel`): wq/wk/wv/w1/w3 and `output` are split by output
  rows (weight Shard(0)), wo/w2 by input columns (Shard(1)), `tok_embeddings` by vocabulary rows
  (Shard(0)); norms are replicated.
- FSDP2 (`torchtitan_lite.distributed.fsdp`): one unit per block, one for `tok_embeddings`, one for
  `norm` + `output` (the "head"), and the root; a tied embedding stays with the root. FSDP2 shards dim 0
  of the (TP-local) tensor and pads it to a multiple of the shard degree: every rank stores
  ceil(dim0 / dp_shard) rows (`FSDPParam._init_sharded_param`, torch/distributed/fsdp/_fully_shard/
  _fsdp_param.py), so rank 0's shapes below are also the padded storage of every rank.
- dp_replicate copies the shards (HSDP): it does not divide anything.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from models import build_model_args, get_model_spec
from torchtitan_lite.components.quantization.float8 import Float8LinearConverter
from torchtitan_lite.components.quantization.float8_plan import float8_plan
from torchtitan_lite.distributed.parallel_dims import ParallelDims

MASTER_WEIGHT_BYTES = 4
"""Parameters are created and kept in float32 (precision.py: master weights always stay float32)."""

_BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                  "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")

# TP shard dim of each weight, by module-name suffix (the plan of distributed/tensor_parallel.py).
_TP_SHARD_DIM = {
    "attention.wq": 0, "attention.wk": 0, "attention.wv": 0, "attention.wo": 1,
    "feed_forward.w1": 0, "feed_forward.w3": 0, "feed_forward.w2": 1,
    "tok_embeddings": 0, "output": 0,
}


@dataclass(frozen=True)
class ParamLayout:
    fqn: str
    global_shape: tuple[int, ...]
    tp_shape: tuple[int, ...]
    """Shape after TP only: what one rank all-gathers from its FSDP shard group."""
    local_shape: tuple[int, ...]
    """Shape on rank 0 after TP and FSDP (with FSDP's padding, every rank's storage)."""
    unit: str
    """FSDP unit holding the parameter: 'layers.<i>', 'tok_embeddings', 'head' (norm + output) or 'root'."""
    is_linear: bool
    float8: bool
    """The Linear is swapped for torchao's Float8Linear by the config's float8 converter."""
    replicated_grad: bool = False
    """Backward produces this parameter's gradient unsharded on every TP rank (see model_layout)."""

    @property
    def global_numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def tp_numel(self) -> int:
        return math.prod(self.tp_shape)


@dataclass(frozen=True)
class LinearLayout:
    fqn: str
    """Module name; a tied output projection is listed although its weight is tok_embeddings.weight."""
    in_features: int
    out_features: int
    tp_numel: int
    """Weight elements one rank computes with (after TP)."""
    float8: bool


@dataclass(frozen=True)
class ModelLayout:
    args: object
    """The model family's args (Llama3ModelArgs): dims, heads, vocabulary."""
    dims: ParallelDims
    params: tuple[ParamLayout, ...]
    linears: tuple[LinearLayout, ...]
    buffer_bytes: int
    """Non-persistent buffers (the float32 rotary table), replicated on every rank."""
    float8_all_gather: bool
    """FSDP all-gathers the float8 Linears' weights in float8 (tensorwise, enabled, and FSDP on)."""
    float8_tp: bool
    """TP uses torchao's float8 styles: every block Linear is tensorwise float8 (see apply_tp)."""

    def unit_params(self, unit: str) -> list[ParamLayout]:
        return [p for p in self.params if p.unit == unit]


def model_layout(config, *, world_size: int) -> ModelLayout:
    """Shard the config's model (built on meta) over `world_size` ranks as the trainer would."""
    par = config.parallelism
    dims = ParallelDims(dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, tp=par.tp, world_size=world_size)
    spec = get_model_spec(config.model.name)
    args = build_model_args(spec, config.model.flavor, n_layers=config.model.n_layers,
                            min_vocab_size=_tokenizer_vocab_size(config.tokenizer))
    dims.validate_for_model(args, config.training.seq_len, sequence_parallel=par.enable_sequence_parallel)
    with torch.device("meta"):
        model = spec.model_cls(args)

    float8_cfg = _float8_config(config)
    converted = set()
    if float8_cfg is not None:
        converted = {row.fqn for row in float8_plan(model, float8_cfg) if row.recipe is not None}
    tied = model.output.weight is model.tok_embeddings.weight
    shard = dims.dp_shard if dims.fsdp_enabled else 1

    linear_modules = {fqn: m for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    params = []
    for fqn, p in model.named_parameters():  # a tied matrix is listed once, as tok_embeddings.weight
        module = fqn.rsplit(".", 1)[0]
        tp_shape = _tp_shape(module, tuple(p.shape), dims.tp)
        params.append(ParamLayout(
            fqn=fqn, global_shape=tuple(p.shape), tp_shape=tp_shape, local_shape=_fsdp_shape(tp_shape, shard),
            unit=_fsdp_unit(module, tied), is_linear=module in linear_modules, float8=module in converted,
            # DTensor's embedding backward has no row-sharded strategy (embedding_dense_backward_strategy in
            # torch/distributed/tensor/_ops/_embedding_ops.py), so the vocabulary-sharded embedding gets a
            # replicated, full-size gradient on every TP rank.
            replicated_grad=dims.tp_enabled and module == "tok_embeddings",
        ))
    linears = tuple(
        LinearLayout(fqn=fqn, in_features=m.in_features, out_features=m.out_features,
                     tp_numel=math.prod(_tp_shape(fqn, tuple(m.weight.shape), dims.tp)), float8=fqn in converted)
        for fqn, m in linear_modules.items()
    )
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())

    recipe = float8_cfg.recipe_name if float8_cfg is not None else None
    block_linears = {f"layers.{i}.{name}" for i in range(args.n_layers) for name in _BLOCK_LINEARS}
    return ModelLayout(
        args=args, dims=dims, params=tuple(params), linears=linears, buffer_bytes=buffer_bytes,
        float8_all_gather=bool(float8_cfg and float8_cfg.enable_fsdp_float8_all_gather and dims.fsdp_enabled),
        float8_tp=dims.tp_enabled and recipe == "tensorwise" and block_linears <= converted,
    )


def _tokenizer_vocab_size(tokenizer_config) -> int:
    """The vocabulary the trainer sizes the model with (it grows a smaller flavor vocabulary to it)."""
    if tokenizer_config.path is None:
        # The default tokenizer is trained to exactly this size; no need to build (or train) it here.
        return tokenizer_config.vocab_size
    return tokenizer_config.build().vocab_size  # loads the sentencepiece file


def _float8_config(config) -> Float8LinearConverter.Config | None:
    found = [c for c in config.model_converters.converters if isinstance(c, Float8LinearConverter.Config)]
    return found[0] if found else None


def _tp_shape(module: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    suffix = module.split(".", 2)[-1] if module.startswith("layers.") else module
    dim = _TP_SHARD_DIM.get(suffix)
    if tp == 1 or dim is None:
        return shape
    # DTensor's Shard gives rank 0 the ceil-sized chunk.
    return tuple(math.ceil(s / tp) if d == dim else s for d, s in enumerate(shape))


def _fsdp_shape(shape: tuple[int, ...], shard: int) -> tuple[int, ...]:
    if shard == 1:
        return shape
    return (math.ceil(shape[0] / shard),) + shape[1:]


def _fsdp_unit(module: str, tied: bool) -> str:
    if module.startswith("layers."):
        return ".".join(module.split(".")[:2])
    if tied:
        return "root"
    return "tok_embeddings" if module == "tok_embeddings" else "head"
