"""Our side of one compile-time measurement, in its own process (started by scripts/compile_time_bench.py).

    python scripts/_compile_time_worker.py --flavor debug --layers 8 --vocab-size 2048 --dtype float32 \\
        --batch 16 --seq-len 128 --steps 3

The model is built as the trainer builds it (meta device, then ``to_empty`` and ``init_weights`` on the
CPU), cast to ``--dtype``, and its blocks compiled by the trainer's own ``apply_compile``; then
``protocol.measure`` times it and the result line is printed.
"""
from __future__ import annotations

import argparse

from torchtitan_lite.tools.compile_time.protocol import measure, print_result


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3", help="model family (default llama3)")
    parser.add_argument("--flavor", required=True, help="the family's size preset, e.g. debug or 8B")
    parser.add_argument("--layers", type=int, required=True, help="transformer blocks")
    parser.add_argument("--vocab-size", type=int, required=True, help="vocabulary (embedding and output rows)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), required=True, help="parameter and compute dtype")
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3, help="steps after the first, whose median is the steady step")
    args = parser.parse_args(argv)

    import torch

    from torchtitan_lite.config.sections import CompileConfig
    from torchtitan_lite.distributed.compile import apply_compile
    from torchtitan_lite.library_notices import silence_known_library_notices
    from torchtitan_lite.protocols.model_spec import build_model_args, get_model_spec

    silence_known_library_notices()
    spec = get_model_spec(args.model)
    model_args = build_model_args(spec, args.flavor, n_layers=args.layers, vocab_size=args.vocab_size)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    model.to_empty(device="cpu")
    model.init_weights()
    model.to(getattr(torch, args.dtype))
    defaults = CompileConfig()  # the trainer's default backend and fullgraph, as a run with compile.enable=true
    apply_compile(getattr(model, spec.parallel_plan.blocks), backend=defaults.backend, fullgraph=defaults.fullgraph)
    print_result(measure(model, vocab_size=model_args.vocab_size, batch=args.batch, seq_len=args.seq_len,
                         steps=args.steps))
    return 0
