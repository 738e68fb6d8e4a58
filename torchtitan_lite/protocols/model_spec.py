"""What the core needs to know about a model family, and the registry the families add themselves to.

A family package (``models/llama3``) registers one ``ModelSpec`` when it is imported; the entry points
(``train.py``, the scripts) import the families, the core only looks them up by ``model.name``. The spec
carries the family's parallel plan as data (``ParallelPlan``): the trainer's parallelize step, the
memory estimator and the dry run all read that one table.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import logging
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from torchtitan_lite.protocols.attention_shape import AttentionShape
from torchtitan_lite.protocols.model import BaseModel
from torchtitan_lite.protocols.moe_facts import MoEFacts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPInput:
    """An activation that several column-parallel Linears consume: TP all-gathers it once, at the input
    of ``module``, and it can travel in float8 only when every consumer casts to float8 itself."""

    module: str
    """Module (relative to a block) whose input is prepared, e.g. 'attention'."""
    consumers: tuple[str, ...]
    """Column-parallel Linears (relative to a block) that read it, e.g. ('attention.wq', ...)."""
    name: str
    """What the activation is, for logs and plans ('attention input')."""
    n_inputs: int = 1
    """Positional inputs of ``module``; only the first is the activation, the others (e.g. the rotary
    table) pass through untouched."""


@dataclass(frozen=True)
class MoETPPlan:
    """Expert tensor parallelism of a block's MoE feed-forward (names relative to a block).

    The layer's input is gathered over the sequence, so every TP rank routes the same tokens and counts the
    same tokens per expert; the router runs replicated; every routed expert's hidden dim is split over the
    ranks (w1 / w3 by their hidden rows, w2 by its hidden columns), as are the shared experts' (a dense
    SwiGLU split like a feed-forward), so the layer's output is a partial sum, reduce-scattered back to the
    sequence-parallel layout."""

    module: str
    """The MoE layer, e.g. 'moe': its input is gathered, its output reduced."""
    router: str
    """The router, e.g. 'moe.router': parameters replicated, run on the gathered tokens."""
    experts: str
    """The routed experts' module holding 3-D w1 / w3 [E, hidden, dim] and w2 [E, dim, hidden]."""
    shared_colwise: tuple[str, ...] = ()
    """Shared experts' input Linears (column-parallel), where a flavor has shared experts."""
    shared_rowwise: tuple[str, ...] = ()
    """Shared experts' output Linears (row-parallel, output left as a partial sum)."""

    @property
    def expert_shard_dims(self) -> dict[str, int]:
        """Shard dim of each routed-expert weight: the hidden dim."""
        return {f"{self.experts}.w1": 1, f"{self.experts}.w3": 1, f"{self.experts}.w2": 2}


@dataclass(frozen=True)
class BlockTPPlan:
    """Megatron-style split of one transformer block.

    A family whose blocks differ (dense and MoE feed-forwards) names every part in one plan: each block applies
    the entries whose modules it has (``present_in``)."""

    inputs: tuple[TPInput, ...]
    rowwise: tuple[str, ...]
    """Output projections split by input features; their output is reduced (or reduce-scattered)."""
    norms: tuple[str, ...]
    """Norms that run sharded along the sequence under sequence parallelism."""
    head_norms: tuple[str, ...] = ()
    """Norms over each head's channels of [batch, seq, heads, head_dim] activations (Qwen3's QK-norm): each
    rank normalises its own heads; their weights are replicated and their gradients summed over the ranks."""
    replicated: tuple[str, ...] = ()
    """Modules every TP rank runs whole, with replicated parameters, on the gathered input of a region (they may
    be a TPInput's consumers) or on one another's outputs: latent attention's low-rank down-projections and
    their norms. Their outputs are plain tensors equal on every rank, which the ranks' own heads consume, so
    the gradient reaching them on each rank is that rank's share (replicated_modules.py)."""
    colwise_from_replicated: tuple[str, ...] = ()
    """Column-parallel Linears that read a replicated module's output (latent attention's up-projections):
    split by output features, nothing gathered, their input gradient left as each rank's share."""
    moe: MoETPPlan | None = None
    """The MoE feed-forward's expert tensor parallelism; None for a dense block."""

    @property
    def colwise(self) -> tuple[str, ...]:
        gathered = tuple(fqn for tp_input in self.inputs for fqn in tp_input.consumers if fqn not in self.replicated)
        return gathered + self.colwise_from_replicated

    @property
    def linears(self) -> tuple[str, ...]:
        return self.colwise + self.rowwise

    def present_in(self, modules: set[str]) -> BlockTPPlan:
        """This plan less the entries whose module is not among ``modules`` (a block's module names): a region
        whose module is absent goes whole, as does an MoE plan without its MoE layer."""
        def keep(names: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(fqn for fqn in names if fqn in modules)

        inputs = tuple(dataclasses.replace(i, consumers=keep(i.consumers)) for i in self.inputs if i.module in modules)
        moe = self.moe
        if moe is not None:
            moe = (dataclasses.replace(moe, shared_colwise=keep(moe.shared_colwise),
                                       shared_rowwise=keep(moe.shared_rowwise)) if moe.module in modules else None)
        return dataclasses.replace(self, inputs=inputs, rowwise=keep(self.rowwise), norms=keep(self.norms),
                                   head_norms=keep(self.head_norms), replicated=keep(self.replicated),
                                   colwise_from_replicated=keep(self.colwise_from_replicated), moe=moe)


HEAD_UNIT = "head"
"""The FSDP unit of the final norm and the output projection."""
ROOT_UNIT = "root"
"""The FSDP unit of the whole model: what no other unit holds (a tied embedding/output matrix)."""


@dataclass(frozen=True)
class FSDPUnit:
    """One FSDP unit: what one ``fully_shard`` call of distributed/fsdp.py groups."""

    name: str
    """'<embedding>', '<blocks>.<key>', '<blocks>.<key>.<experts>', 'head' or 'root'."""
    kind: Literal["embedding", "experts", "block", "head", "root"]
    modules: tuple[str, ...]
    """The modules sharded together, by name from the model's root; () for the root (the whole model). An
    experts unit names the plan's block-relative path, which an activation-checkpoint wrapper may hide."""
    block: str | None = None
    """The block's key in ``model.<blocks>`` (a block or its experts' unit); None otherwise."""


@dataclass(frozen=True)
class ParallelPlan:
    """A family's tensor-parallel plan and FSDP units, by module name.

    Blocks live in ``model.<blocks>`` (a ModuleDict); block-relative names apply to each of them.
    """

    blocks: str
    block_tp: BlockTPPlan
    embedding: str
    """Vocabulary-sharded embedding (weight rows split over TP ranks)."""
    output: str
    """Output projection, split by vocabulary (column-parallel); its logits may stay sharded."""
    final_norm: str
    """The norm before the output projection (sequence parallel with SP)."""
    tp_shard_dims: dict[str, int] = field(default_factory=dict)
    """Weight dim each TP-split module shards, by block-relative or root-level module name."""
    experts: str | None = None
    """Block-relative name of the routed experts (3-D weights, expert dim 0) that expert parallelism splits and
    FSDP shards over the ranks left after EP, e.g. 'moe.experts'; None for a dense family."""
    ep_compile_regions: tuple[str, ...] = ()
    """Under expert parallelism, what is compiled of each block holding ``experts`` (block-relative names):
    everything but the MoE layer's dispatch and combine, whose all-to-all split sizes are host integers (a
    whole-block graph would break there). Blocks without experts are compiled whole."""

    def tp_shard_dim(self, module: str) -> int | None:
        """Shard dim of ``module``'s weight under TP (full FQN, e.g. 'layers.3.attention.wo'); None if whole."""
        prefix = f"{self.blocks}."
        if module.startswith(prefix):
            module = module.split(".", 2)[-1]
        return self.tp_shard_dims.get(module)

    def param_tp_shard_dim(self, param: str) -> int | None:
        """Shard dim of parameter ``param`` (full FQN) under TP: its own entry (a 3-D expert weight), else its
        module's (a Linear's weight); None if whole."""
        own = self.tp_shard_dim(param)
        return own if own is not None else self.tp_shard_dim(param.rsplit(".", 1)[0])

    def fsdp_units(self, block_keys: Sequence[str], *, first: bool, last: bool, tied: bool,
                   expert_blocks: Container[str] = ()) -> tuple[FSDPUnit, ...]:
        """The FSDP units of a model, or of a pipeline rank's stages, holding the blocks ``block_keys`` (in
        order), the embedding if ``first`` and the final norm + output if ``last``, in the order apply_fsdp
        shards them (distributed/fsdp.py): the embedding, each block (the routed experts of the blocks in
        ``expert_blocks`` first, as their own unit inside the block's), the head, the root. A tied
        embedding/output matrix can belong to one unit only: it stays with the root, and so do the final norm
        and the output."""
        units = [FSDPUnit(self.embedding, "embedding", (self.embedding,))] if first and not tied else []
        for key in block_keys:
            block = f"{self.blocks}.{key}"
            if key in expert_blocks:
                units.append(FSDPUnit(f"{block}.{self.experts}", "experts", (f"{block}.{self.experts}",), block=key))
            units.append(FSDPUnit(block, "block", (block,), block=key))
        if last and not tied:
            units.append(FSDPUnit(HEAD_UNIT, "head", (self.final_norm, self.output)))
        return (*units, FSDPUnit(ROOT_UNIT, "root", ()))

    def fsdp_unit(self, module: str, *, tied: bool) -> str:
        """The FSDP unit that holds ``module``'s parameters (full module name) among ``fsdp_units`` of the whole
        model, routed experts counted with their block: '<blocks>.<i>', the embedding, 'head' or 'root'."""
        keys = (module.split(".")[1],) if module.startswith(f"{self.blocks}.") else ()
        for unit in self.fsdp_units(keys, first=True, last=True, tied=tied):
            if any(module == m or module.startswith(f"{m}.") for m in unit.modules):
                return unit.name
        return ROOT_UNIT


def build_tp_plan(block_tp: BlockTPPlan, *, ep_compile_regions: tuple[str, ...] = (), **root: str) -> ParallelPlan:
    """A ParallelPlan whose shard dims follow from the Megatron split: column-parallel Linears and the
    embedding and output split dim 0 (output features / vocabulary rows), row-parallel Linears dim 1."""
    dims = {fqn: 0 for fqn in block_tp.colwise} | {fqn: 1 for fqn in block_tp.rowwise}
    if block_tp.moe is not None:
        dims |= {fqn: 0 for fqn in block_tp.moe.shared_colwise} | {fqn: 1 for fqn in block_tp.moe.shared_rowwise}
        dims |= block_tp.moe.expert_shard_dims
    dims |= {root["embedding"]: 0, root["output"]: 0}
    return ParallelPlan(block_tp=block_tp, tp_shard_dims=dims, ep_compile_regions=ep_compile_regions, **root)


@dataclass(frozen=True)
class RunFacts:
    """What a family's ``check_run`` may read of a resolved run."""

    model_args: Any
    """The family's args, as the run builds them."""
    compile_model: bool
    """The blocks are compiled."""
    param_dtype: torch.dtype
    """The compute dtype of the parameters (precision.param_dtype, 'auto' decided)."""
    tp: int = 1
    """Tensor-parallel degree (parallelism.tp)."""


RunCheck = Callable[[RunFacts], None]


@dataclass(frozen=True)
class ModelSpec:
    name: str
    """Family name, the value of model.name in the config."""
    model_cls: type[BaseModel]
    """Called as model_cls(args)."""
    args_cls: type
    """Dataclass of the family's hyper-parameters."""
    flavors: dict[str, Any]
    """Size presets: flavor name -> args_cls instance."""
    parallel_plan: ParallelPlan
    """Which modules TP splits how, and the FSDP units."""
    state_dict_adapter_cls: type | None
    """Converts state dicts to and from Hugging Face names; None when the family has no HF counterpart."""
    kv_cache_cls: type | None = None
    """Incremental decoding for generation, called as kv_cache_cls(model, batch_size=, max_len=); the
    instance maps (new tokens, start position) to their logits, caching keys and values. None: generation
    reruns the whole prefix for each new token."""
    moe_facts: Callable[[Any], MoEFacts] | None = None
    """The family's Mixture-of-Experts layers, from its args (experts, top_k, widths, which blocks); the
    planning tools and the expert-parallel rules read these facts. None: a dense family."""
    check_run: RunCheck | None = None
    """Refuses a run the family cannot train (raises ValueError naming the fix). resolve_run calls it, so
    --check-config refuses before launch what the family's build would refuse after it; None: no rule."""
    args_from_hf: Callable[[dict[str, Any], Any], Any] | None = None
    """The family's args for a Hugging Face config.json of any size the family supports, called as
    args_from_hf(config, flavor_args): the architecture (shapes, experts, rotary settings) comes from the file,
    what it has no field for (balancing, init) from the flavor's args; raises ValueError naming a feature the
    family cannot build. None: the family's models are only built from its flavors."""
    attention_shape: Callable[[Any], AttentionShape] | None = None
    """The widths context parallelism gathers and attention keeps (protocols/attention_shape.py), from the family's
    args, when K and V are expanded inside the block from something smaller (latent attention). None: K and V
    of kv_heads heads, gathered as they are."""


_MODEL_SPECS: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> ModelSpec:
    """Make ``spec`` known under ``spec.name`` (a family package calls this when imported)."""
    known = _MODEL_SPECS.get(spec.name)
    if known is not None and known is not spec:
        raise ValueError(f"model family {spec.name!r} is registered twice")
    _MODEL_SPECS[spec.name] = spec
    return spec


def model_specs() -> dict[str, ModelSpec]:
    """Every registered family by name."""
    return dict(_MODEL_SPECS)


def args_from_hf_file(spec: ModelSpec, flavor: str, path: str) -> Any:
    """``spec.args_from_hf`` of the config.json at ``path``, the flavor giving what the file does not."""
    if spec.args_from_hf is None:
        raise ValueError(f"model.hf_config={path!r}: model family {spec.name!r} builds its models from its flavors "
                         f"only ({', '.join(spec.flavors)}); unset model.hf_config")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"model.hf_config={path!r} is not a readable config.json ({e}); give the config.json of the "
                         "Hugging Face model, or unset model.hf_config to build the flavor") from None
    try:
        return spec.args_from_hf(config, spec.flavors[flavor])
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _unknown(kind: str, name: str, valid: list[str]) -> ValueError:
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"unknown {kind} {name!r}; valid: {', '.join(valid)}.{hint}")


def get_model_spec(name: str) -> ModelSpec:
    """The spec of family ``name``; the error lists the known families."""
    if name not in _MODEL_SPECS:
        if not _MODEL_SPECS:
            raise ValueError(f"no model family is registered, so model.name={name!r} cannot be built: the entry "
                             f"point must import the model packages first (import models)")
        raise _unknown("model.name", name, sorted(_MODEL_SPECS))
    return _MODEL_SPECS[name]


def build_model_args(spec: ModelSpec, flavor: str, *, vocab_size: int | None = None, n_layers: int | None = None,
                     max_seq_len: int | None = None, min_vocab_size: int | None = None,
                     hf_config: str | None = None) -> Any:
    """A fresh copy of ``spec.flavors[flavor]`` with overrides applied and validated again.

    hf_config (a Hugging Face config.json, model.hf_config) replaces the flavor's architecture by the file's
    (``spec.args_from_hf``). vocab_size / n_layers / max_seq_len replace the value when not None. min_vocab_size
    (the tokenizer's vocabulary) grows vocab_size when the flavor's is smaller, so that every token id has an
    embedding row; a larger flavor vocabulary is kept (HF-compatible shapes, unused rows are harmless).
    """
    if flavor not in spec.flavors:
        raise _unknown(f"model.flavor for {spec.name}", flavor, list(spec.flavors))
    overrides = {k: v for k, v in (("vocab_size", vocab_size), ("n_layers", n_layers), ("max_seq_len", max_seq_len))
                 if v is not None}
    base = spec.flavors[flavor] if hf_config is None else args_from_hf_file(spec, flavor, hf_config)
    try:
        args = dataclasses.replace(base, **overrides)  # re-runs __post_init__ validation
    except ValueError as e:
        raise ValueError(f"{spec.name} flavor {flavor!r} with overrides {overrides}: {e}") from None
    if min_vocab_size is not None:
        if min_vocab_size < 1:
            raise ValueError(f"min_vocab_size={min_vocab_size} must be positive (it is the tokenizer's vocab size)")
        if vocab_size is not None and vocab_size < min_vocab_size:
            raise ValueError(
                f"vocab_size={vocab_size} is smaller than the tokenizer's vocabulary ({min_vocab_size}): token ids "
                f"above {vocab_size - 1} would have no embedding; use vocab_size >= {min_vocab_size} or leave it unset"
            )
        if args.vocab_size < min_vocab_size:
            logger.info("model vocab_size raised from %d to the tokenizer's %d", args.vocab_size, min_vocab_size)
            args = dataclasses.replace(args, vocab_size=min_vocab_size)
    return args
