"""Known start-up notices of torch / torchao that are harmless and not actionable, filtered once for
train.py and the scripts alike."""
from __future__ import annotations

import logging
import warnings


def _not_pytree_enum_notice(record: logging.LogRecord) -> bool:
    # torchao registers its KernelPreference enum with pytree, which torch 2.13 reports as deprecated
    # on every import of torchao.
    return "is an Enum subclass and is now natively supported" not in record.getMessage()


def silence_known_library_notices() -> None:
    """Idempotent. On a machine without CUDA, torchao's "Failed to load ..." lines for its optional
    CUDA kernels are expected and hidden; with CUDA they stay, because there they mean a torchao
    build that does not match the installed torch."""
    import torch

    logging.getLogger("torch.utils._pytree").addFilter(_not_pytree_enum_notice)
    # The rotary embedding multiplies complex pairs, which inductor leaves to torch's eager kernel on
    # purpose (models/common/attention/rope.py says why); the notice says so once per compiled run.
    warnings.filterwarnings("ignore", message="Torchinductor does not support code generation for complex operators")
    if not torch.cuda.is_available():
        logging.getLogger("torchao").setLevel(logging.ERROR)
