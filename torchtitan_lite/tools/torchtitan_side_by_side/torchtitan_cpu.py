"""Runs inside the separate torchtitan virtual environment made by scripts/torchtitan_side_by_side.py
(it imports torchtitan and the ``tokenizers`` package, neither of which this project depends on).

    python _torchtitan_cpu.py tokenizer OUT_DIR VOCAB_SIZE FILE.jsonl...
        byte-level BPE tokenizer.json + tokenizer_config.json, trained on the "text" field of the files
    python _torchtitan_cpu.py train --module M --config C [torchtitan flags...]
        ``python -m torchtitan.train`` with the shims below applied first (launch it under torchrun)
    python _torchtitan_cpu.py compile-time --module M --dtype float32|bfloat16 --batch B --seq-len S --steps N
        the cold / warm compile time of the blocks of the model in config module M (function
        ``ttl_side_by_side``), compiled by torchtitan's own ``apply_compile``; one process, no process group
    python _torchtitan_cpu.py moe-bench SPEC_JSON
        its MoE layer and Qwen3 MoE model timed at our shapes (torchtitan_lite.tools.moe_experts_bench_torchtitan)

torchtitan 0.3.0 on a machine without an accelerator, with torch 2.13, fails in five places. Each
shim is applied only where the thing it replaces is missing or unusable:

1. ``torchtitan.tools.utils`` takes ``torch._utils._get_available_device_type() or "cuda"`` as the
   device type, so without a GPU it calls ``torch.cuda.set_device`` and stops with
   ``AttributeError: module 'torch._C' has no attribute '_cuda_setDevice'``. Shim: the available
   device type is "cpu" (then ``torch.cpu`` is its device module and gloo its process-group backend).
2. Its ``DeviceMemoryMonitor`` calls the CUDA memory API on that module
   (``AttributeError: module 'torch.cpu' has no attribute 'get_device_name'``), and after step 1
   ``barrier(device_ids=[device_module.current_device()])`` needs an int where ``torch.cpu`` returns
   "cpu". Shim: the CPU model as name, physical RAM as capacity, empty memory statistics (torchtitan
   then logs memory as -0.00GiB), no-op peak reset / cache flush, device index 0.
3. After step 1 it shortens process-group timeouts with ``torch.distributed.set_timeout``, which
   torch 2.13 does not have (``AttributeError: module 'torch.distributed' has no attribute
   'set_timeout'``; the release targets newer torch builds). Shim: a no-op (a timeout only).
4. With 2+ data-parallel ranks, FSDP's gradient divide factor of 1 (torchtitan divides by the global
   token count itself) makes FSDP reduce-scatter with ``ReduceOp.PREMUL_SUM``, which gloo rejects
   (``RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo``). Shim: torchtitan's
   ``disable_fsdp_gradient_division`` also forces plain SUM collectives, the same gradients (factor 1).
5. Its float8 converter refuses any device below CUDA sm89 / MI300 (``ValueError: Failed to swap to
   Float8Linear because float8 is only supported on NVIDIA SM89 or later``), although torch 2.13's
   CPU ``torch._scaled_mm`` runs the tensorwise and rowwise FP8 GEMMs. Shim: that capability check
   passes when there is no GPU.

Two more limits are not shimmed but configured around by the generated config: torchtitan's default
FlexAttention raises ``NotImplementedError: FlexAttention does not support backward on CPU``, so the
side-by-side config uses torchtitan's own ``ScaledDotProductAttention`` (causal), as our model does;
and with 2+ ranks its default ``parallelism.spmd_backend="spmd_types"`` stops in ``fully_shard``
(``ValueError: When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh``)
for a purely data-parallel model, so those runs select ``spmd_backend="partial_dtensor"`` (DTensor
on the model-parallel axes only, of which there are none here: plain FSDP2).
"""
# The docstring above is the usage text of scripts/_torchtitan_cpu.py. Only the standard library and
# torch may be imported at module level: torchtitan's environment has none of this project's dependencies.
from __future__ import annotations

import json
import os
import runpy
import sys
import types
from collections.abc import Iterator
from typing import Any


def main(argv: list[str]) -> int:
    """``tokenizer OUT_DIR VOCAB_SIZE FILE...`` or ``train [torchtitan flags]``; 2 with the usage otherwise."""
    if not argv or argv[0] not in ("tokenizer", "train", "compile-time", "moe-bench"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "tokenizer":
        out_dir, vocab_size, *files = argv[1:]
        build_tokenizer(out_dir, int(vocab_size), files)
        return 0
    if argv[0] == "compile-time":
        measure_compile_time(argv[1:])
        return 0
    if argv[0] == "moe-bench":
        from torchtitan_lite.tools.moe_experts_bench_torchtitan import main as moe_bench

        moe_bench(argv[1])
        return 0
    apply_cpu_shims()
    sys.argv = ["torchtitan.train", *argv[1:]]
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
    return 0


def measure_compile_time(argv: list[str]) -> None:
    """torchtitan's side of scripts/compile_time_bench.py: build, compile, time (torchtitan_lite.tools.compile_time)."""
    import argparse
    import importlib

    import torch

    parser = argparse.ArgumentParser(prog="_torchtitan_cpu.py compile-time")
    parser.add_argument("--module", required=True)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    apply_cpu_shims()
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile
    from torchtitan.tools.utils import set_default_dtype

    from torchtitan_lite.tools.compile_time.protocol import measure, print_result

    config = importlib.import_module(args.module).ttl_side_by_side()
    model_config = config.model_spec.model
    torch.manual_seed(0)
    # As torchtitan's trainer builds it: on meta under the training dtype, then materialised and initialised
    # (a later .to(bfloat16) would also cast its complex rotary table to a real one).
    with torch.device("meta"), set_default_dtype(getattr(torch, args.dtype)):
        model = model_config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=None)
    apply_compile(model, compile_config=CompileConfig(enable=True, components=["model"]),
                  parallel_dims=types.SimpleNamespace(tp_enabled=False))  # read only for async TP
    print_result(measure(model, vocab_size=model_config.vocab_size, batch=args.batch, seq_len=args.seq_len,
                         steps=args.steps))


def build_tokenizer(out_dir: str, vocab_size: int, files: list[str]) -> None:
    """Byte-level BPE on the \"text\" field of ``files``, saved with BOS / EOS as torchtitan's HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[bos, eos],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(_texts(files), trainer)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    # Documents are packed between BOS and EOS, as the project's own loader packs them.
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": bos, "eos_token": eos, "add_bos_token": True, "add_eos_token": True}, f)
    print(f"tokenizer with {tokenizer.get_vocab_size()} pieces written to {out_dir}")


def _texts(files: list[str]) -> Iterator[str]:
    for path in files:
        with open(path) as f:
            for line in f:
                yield json.loads(line)["text"]


def apply_cpu_shims() -> None:
    """The shims of the module docstring, each only where what it replaces is missing."""
    import torch
    import torch._utils
    import torch.distributed

    if not torch.cuda.is_available():
        torch._utils._get_available_device_type = lambda: "cpu"
        cpu: Any = torch.cpu  # patched with functions torch does not declare there
        cpu.get_device_name = lambda device=None: _cpu_name()
        cpu.get_device_properties = lambda device=None: types.SimpleNamespace(
            name=_cpu_name(), total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        cpu.memory_stats = lambda device=None: {}
        cpu.reset_peak_memory_stats = lambda device=None: None
        cpu.empty_cache = lambda: None
        cpu.current_device = lambda: 0
    dist: Any = torch.distributed
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda timeout, group=None: None
    if not torch.cuda.is_available():
        _sum_reductions_for_gloo()
        _float8_on_cpu()


def _sum_reductions_for_gloo() -> None:
    import torchtitan.distributed.fsdp as fsdp

    original = fsdp.disable_fsdp_gradient_division

    def disable_division_with_sum_reductions(model: Any) -> None:
        original(model)
        for module in model.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_division_with_sum_reductions


def _float8_on_cpu() -> None:
    import torchtitan.components.quantization.float8 as float8

    float8.has_cuda_capability = lambda major, minor: True


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"

