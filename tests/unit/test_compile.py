"""Per-block torch.compile and the compiled loss (aot_eager backend here: the graphs and autograd of the
real compile path without C++ code generation; inductor runs in tests/distributed/test_compile_composition.py)."""
from __future__ import annotations

import collections
import dataclasses
import os

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

import config_registry
from models.llama3.model import Llama3ModelArgs, Transformer
from torchtitan_lite.components.loss import cross_entropy_sum
from torchtitan_lite.config.sections import CompileConfig
from torchtitan_lite.distributed.activation_checkpoint import apply_ac
from torchtitan_lite.distributed.compile import (
    CompileStats,
    apply_compile,
    compile_label,
    compile_seconds,
    compile_stats,
    compiled_graphs,
    first_step_compile_label,
    maybe_compile_loss,
)
from torchtitan_lite.distributed.parallelize import parallelize
from torchtitan_lite.resolved_run import resolve_run

ARGS = Llama3ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)
AOT_EAGER = {"backend": "aot_eager", "fullgraph": True}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return Transformer(ARGS)


@pytest.mark.parametrize("enable, components, blocks, loss", [
    (False, ["model", "loss"], False, False),
    (True, ["model", "loss"], True, True),
    (True, ["loss"], False, True),
    (True, ["model"], True, False),
])
def test_what_is_compiled_is_decided_once_and_parallelize_follows_it(enable, components, blocks, loss):
    cfg = config_registry.get("llama3_debug")
    cfg.compile = CompileConfig(enable=enable, components=components, backend="aot_eager")
    run = resolve_run(cfg, world_size=1, device_type="cpu")
    assert (run.compile_model, run.compile_loss, run.compiles) == (blocks, loss, blocks or loss)
    context = run.parallelize_context(mp_policy=MixedPrecisionPolicy())
    assert (context.compile_model, context.compile_backend, context.compile_fullgraph) == (blocks, "aot_eager", True)
    with torch.device("meta"):
        spec = run.model_spec
        model = parallelize(spec.model_cls(run.model_args), spec.parallel_plan, context, label=spec.name)
    assert all((block._compiled_call_impl is not None) == blocks for block in model.layers.values())
    assert maybe_compile_loss(cross_entropy_sum, enabled=False, backend="inductor") is cross_entropy_sum


def test_checkpointed_blocks_compile_fullgraph_with_unchanged_names_and_numerics():
    reference, model = _model(), _model()
    apply_ac(model.layers, "selective", "op")
    names = model.state_dict().keys()
    assert apply_compile(model.layers, **AOT_EAGER) == ARGS.n_layers
    assert model.state_dict().keys() == names  # Module.compile keeps parameter names (no _orig_mod)
    loss_fn = maybe_compile_loss(cross_entropy_sum, enabled=True, backend=AOT_EAGER["backend"])
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


def _fresh_compile_state() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _model_of_depth(n_layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return Transformer(dataclasses.replace(ARGS, n_layers=n_layers))


@pytest.mark.parametrize(("ac_mode", "ac_option", "kinds"), [
    ("none", "op", 1), ("full", "op", 1), ("selective", "op", 1),
    ("selective", "2", 2),  # every second block checkpointed: two block kinds
])
def test_blocks_compile_once_per_block_kind_whatever_the_depth(ac_mode, ac_option, kinds):
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for n_layers in (2, 6):
        _fresh_compile_state()
        model = _model_of_depth(n_layers)
        apply_ac(model.layers, ac_mode, ac_option)
        apply_compile(model.layers, **AOT_EAGER)
        model(tokens).sum().backward()
        assert compiled_graphs() == kinds, (n_layers, compiled_graphs())


def test_shared_block_graph_trains_bitwise_like_one_graph_per_block():
    # The reference compiles every block into a graph of its own (a distinct backend object per block fails
    # dynamo's backend guard, so no block reuses another's graph); ours reuses the first block's graph for
    # all. aot_eager runs the same aten ops either way, so three optimizer steps agree bitwise.
    from torch._dynamo.backends.debugging import aot_eager

    tokens = torch.randint(0, ARGS.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))

    def train(model: torch.nn.Module) -> list[float]:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(3):
            loss, _ = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    _fresh_compile_state()
    shared = _model_of_depth(4)
    apply_compile(shared.layers, **AOT_EAGER)
    shared_losses = train(shared)
    assert compiled_graphs() == 1

    _fresh_compile_state()
    separate = _model_of_depth(4)
    for block in separate.layers.values():
        block.compile(backend=lambda gm, inputs: aot_eager(gm, inputs), fullgraph=True)
    separate_losses = train(separate)
    assert compiled_graphs() == 4
    assert shared_losses == separate_losses


@pytest.mark.parametrize("hits, misses, label", [
    (0, 4, "73.0s cold compile of 2 graph(s) (nothing in inductor's cache)"),
    (4, 0, "73.0s cached compile of 2 graph(s) (every kernel from inductor's cache: traced again, not compiled)"),
    (3, 1, "73.0s partly cached compile of 2 graph(s) (3 of 4 forward / backward graphs from inductor's cache)"),
    (0, 0, "73.0s compile of 2 graph(s) (no inductor cache involved)"),
])
def test_the_first_step_says_whether_its_compile_was_cold_or_cached(hits, misses, label):
    assert compile_label(CompileStats(seconds=73.0, graphs=2, cache_hits=hits, cache_misses=misses)) == label


def test_the_first_step_is_charged_only_its_own_compile_and_never_more_than_its_time():
    # Read once at the end, the process's counters gave "first step took 36.7s (... 63.5s cold compile ...)": the
    # step-0 validation had compiled the forward before the step began.
    before = CompileStats(seconds=27.0, graphs=1, cache_hits=0, cache_misses=1)
    after = CompileStats(seconds=63.5, graphs=3, cache_hits=0, cache_misses=4)
    assert first_step_compile_label(before, after, step_s=36.7) == (
        "36.5s cold compile of 2 graph(s) (nothing in inductor's cache); 27.0s compiling 1 graph(s) before the step")
    # torch's phase sums can run past the wall clock: the step's share stops at the step's own time.
    label = first_step_compile_label(CompileStats(0.0, 0, 0, 0), after, step_s=36.7)
    assert label == "36.7s cold compile of 3 graph(s) (nothing in inductor's cache)"


def test_compile_stats_count_inductor_cache_lookups(monkeypatch):
    # What torch 2.13 counted for a compiled block and loss (measured: llama3_debug_fp8_rowwise, 2 layers): a
    # cold process misses inductor's cache for each forward and backward graph, a second process on the same
    # cache folder hits it for all four; the AOT-autograd cache in front is bypassed for the block either way.
    counters: collections.defaultdict = collections.defaultdict(collections.Counter)
    counters["stats"]["unique_graphs"] = 2
    counters["aot_autograd"].update(autograd_cache_bypass=1, autograd_cache_hit=1)
    counters["inductor"].update(fxgraph_cache_hit=4)
    monkeypatch.setattr(torch._dynamo.utils, "counters", counters)
    assert (compile_stats().graphs, compile_stats().cache_hits, compile_stats().cache_misses) == (2, 4, 0)
    counters["inductor"].update(fxgraph_cache_bypass=1)  # a graph inductor cannot cache is compiled afresh
    assert (compile_stats().cache_hits, compile_stats().cache_misses) == (4, 1)


def test_the_first_step_says_whether_triton_autotuned_and_that_the_result_is_kept(monkeypatch, tmp_path):
    """torchao's FP8 Triton kernels autotune ~100 s a shape: the first step's line says whether that happened."""
    from torchtitan_lite import compile_cache

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    before = compile_stats()
    assert before.autotuned == 0
    for name in ("a/k1", "b/k2"):  # what Triton writes per tuned kernel with TRITON_CACHE_AUTOTUNING=1
        (tmp_path / "triton" / name).parent.mkdir(parents=True)
        (tmp_path / "triton" / f"{name}{compile_cache.AUTOTUNE_SUFFIX}").write_text("{}")
    after = compile_stats()
    assert after.autotuned == 2
    assert first_step_compile_label(before, after, step_s=5.0).endswith(
        "; Triton autotuned 2 kernel(s) (kept in $TRITON_CACHE_DIR: the next run reuses them)")
    assert first_step_compile_label(after, after, step_s=5.0).endswith(
        "; no Triton autotuning (2 result(s) reused from $TRITON_CACHE_DIR)")


def test_a_training_process_keeps_compiled_kernels_and_autotuning_under_the_project_cache(monkeypatch, tmp_path):
    from torchtitan_lite import compile_cache

    monkeypatch.setenv("TORCHTITAN_LITE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))  # a user's own choice stays
    chosen = compile_cache.use_project_compile_caches()
    assert chosen == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor"), "TRITON_CACHE_AUTOTUNING": "1"}
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    # inductor reads the variable when it first needs its cache, so setting it before any compile is enough.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert cache_dir() == str(tmp_path / "cache" / "inductor")
