"""Per-block torch.compile and the compiled loss (aot_eager backend here: the graphs and autograd of the
real compile path without C++ code generation; inductor runs in tests/distributed/test_compile_composition.py)."""
from __future__ import annotations

import torch

from models.llama3.model import Llama3ModelArgs, Transformer
from torchtitan_lite.components.loss import cross_entropy_sum
from torchtitan_lite.config.sections import CompileConfig
from torchtitan_lite.distributed.activation_checkpoint import apply_ac
from torchtitan_lite.distributed.compile import apply_compile, compile_seconds, maybe_compile_loss

ARGS = Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)
AOT_EAGER = CompileConfig(enable=True, backend="aot_eager", fullgraph=True)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Transformer(ARGS)


def test_disabled_or_not_selected_compiles_nothing():
    model = _model()
    assert apply_compile(model, CompileConfig(enable=False)) == 0
    assert apply_compile(model, CompileConfig(enable=True, components=["loss"])) == 0
    assert all(block._compiled_call_impl is None for block in model.layers.values())
    assert maybe_compile_loss(cross_entropy_sum, enabled=False, backend="inductor") is cross_entropy_sum


def test_checkpointed_blocks_compile_fullgraph_with_unchanged_names_and_numerics():
    reference, model = _model(), _model()
    apply_ac(model, "selective", "op")
    names = model.state_dict().keys()
    assert apply_compile(model, AOT_EAGER) == ARGS.n_layers
    assert model.state_dict().keys() == names  # Module.compile keeps parameter names (no _orig_mod)
    loss_fn = maybe_compile_loss(cross_entropy_sum, enabled=True, backend=AOT_EAGER.backend)
    assert loss_fn is not cross_entropy_sum

    tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    before = compile_seconds()
    losses = []
    for m, fn in ((reference, cross_entropy_sum), (model, loss_fn)):
        loss, n_tokens = fn(m(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        losses.append(loss.detach())
    assert compile_seconds() > before  # the first call paid (and recorded) the compile
    # aot_eager runs the same aten kernels after decomposition; only fusion-free reorderings remain.
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=0)
    grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name.replace("_checkpoint_wrapped_module.", "")].grad,
                                   rtol=1e-5, atol=1e-7, msg=name)
