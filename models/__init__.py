"""Model families known to the trainer: `MODEL_SPECS[name]` says how to build, parallelize and convert one."""
from __future__ import annotations

import dataclasses
import difflib
import logging
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from models.llama3 import LLAMA3_FLAVORS, Llama3ModelArgs, Transformer
from models.llama3.state_dict_adapter import Llama3StateDictAdapter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    """Family name, the value of model.name in the config."""
    model_cls: type[nn.Module]
    """Called as model_cls(args); the module offers init_weights, num_params and flops_per_token."""
    args_cls: type
    """Dataclass of the family's hyper-parameters."""
    flavors: dict[str, Any]
    """Size presets: flavor name -> args_cls instance."""
    parallelize_fn: Callable[..., nn.Module]
    """parallelize_fn(model, parallel_dims, config, *, precision) -> model (TP, AC, compile, FSDP)."""
    state_dict_adapter_cls: type | None
    """Converts state dicts to and from Hugging Face names; None when the family has no HF counterpart."""


def _parallelize_llama(model: nn.Module, parallel_dims, config, *, precision) -> nn.Module:
    # Imported on call so that the model code imports without the distributed stack.
    from models.llama3.parallelize import parallelize_llama

    return parallelize_llama(model, parallel_dims, config, precision=precision)


MODEL_SPECS: dict[str, ModelSpec] = {
    "llama3": ModelSpec(
        name="llama3",
        model_cls=Transformer,
        args_cls=Llama3ModelArgs,
        flavors=LLAMA3_FLAVORS,
        parallelize_fn=_parallelize_llama,
        state_dict_adapter_cls=Llama3StateDictAdapter,
    ),
}


def _unknown(kind: str, name: str, valid: list[str]) -> ValueError:
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"unknown {kind} {name!r}; valid: {', '.join(valid)}.{hint}")


def get_model_spec(name: str) -> ModelSpec:
    """The spec of family `name`; the error lists the known families."""
    if name not in MODEL_SPECS:
        raise _unknown("model.name", name, sorted(MODEL_SPECS))
    return MODEL_SPECS[name]


def build_model_args(spec: ModelSpec, flavor: str, *, vocab_size: int | None = None, n_layers: int | None = None,
                     max_seq_len: int | None = None, min_vocab_size: int | None = None):
    """A fresh copy of `spec.flavors[flavor]` with overrides applied and validated again.

    vocab_size / n_layers / max_seq_len replace the flavor's value when not None. min_vocab_size (the
    tokenizer's vocabulary) grows vocab_size when the flavor's is smaller, so that every token id has an
    embedding row; a larger flavor vocabulary is kept (HF-compatible shapes, unused rows are harmless).
    """
    if flavor not in spec.flavors:
        raise _unknown(f"model.flavor for {spec.name}", flavor, list(spec.flavors))
    overrides = {k: v for k, v in (("vocab_size", vocab_size), ("n_layers", n_layers), ("max_seq_len", max_seq_len))
                 if v is not None}
    try:
        args = dataclasses.replace(spec.flavors[flavor], **overrides)  # re-runs __post_init__ validation
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
