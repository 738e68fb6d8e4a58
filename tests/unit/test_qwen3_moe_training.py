"""qwen3_moe through the trainer, in process: it trains, the expert bias moves exactly once per applied step
(gradient accumulation and full activation checkpointing included, none on a skipped step) and the
balance loss reaches the gradients."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from _transformers import import_transformers

from config_registry import DEFAULT_REGISTRY
from models.qwen3_moe import QWEN3_MOE_FLAVORS, Qwen3MoeModel
from tests._spike_runs import plant, record_steps, reference_labels
from torchtitan_lite.config import parse_cli
from torchtitan_lite.trainer import Trainer

# 2 micro-batches of 2 x 32 tokens per step (global batch 4 on one process), 2 blocks, no validation.
TINY = ["--model.n_layers", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--training.global_batch_size", "4", "--validation.enable", "false", "--metrics.log_freq", "1",
        "--metrics.cpu_peak_tflops", "1", "--checkpoint.enable", "false"]
TOKENS_PER_STEP = 4 * 32


def _flavor(monkeypatch, **moe) -> None:
    debug = QWEN3_MOE_FLAVORS["debug"]
    monkeypatch.setitem(QWEN3_MOE_FLAVORS, "debug", dataclasses.replace(debug, moe=dataclasses.replace(debug.moe, **moe)))


def _trainer(folder, steps: int, *extra: str) -> Trainer:
    argv = ["--config", "qwen3_moe_debug", *TINY, "--training.steps", str(steps), "--job.dump_folder", str(folder),
            *extra]
    return parse_cli(argv, registry=DEFAULT_REGISTRY).config.build()


def _spy_bias_updates(monkeypatch) -> list[float]:
    """Each call of the post-step hook records the loads layer 0 counted since the previous one."""
    loads: list[float] = []
    original = Qwen3MoeModel.post_optimizer_step

    def spy(self, dp_group):
        loads.append(float(self.layers["0"].moe.tokens_per_expert.sum()))
        original(self, dp_group)

    monkeypatch.setattr(Qwen3MoeModel, "post_optimizer_step", spy)
    return loads


def test_trains_and_updates_the_bias_once_per_step_with_accumulation_and_full_ac(tmp_path, monkeypatch):
    _flavor(monkeypatch, bias_update_rate=1e-3)
    loads = _spy_bias_updates(monkeypatch)
    trainer = _trainer(tmp_path, 3, "--activation_checkpoint.mode", "full")
    records = record_steps(trainer)
    trainer.train()
    model = trainer.model_parts[0]
    assert isinstance(model, Qwen3MoeModel) and trainer.n_microbatches == 2
    # One update per step, each from both micro-batches' tokens counted once (top-2 routing), although full
    # activation checkpointing re-runs every block's forward in backward.
    assert loads == [2.0 * TOKENS_PER_STEP] * 3
    bias = model.layers["0"].moe.expert_bias
    assert bias.abs().max() > 0 and abs(float(bias.sum())) < 1e-6
    assert all(torch.isfinite(torch.tensor(r.loss)) for r in records)


def test_no_bias_update_on_a_step_the_spike_policy_skipped(tmp_path, monkeypatch):
    _flavor(monkeypatch, bias_update_rate=1e-3)
    loads = _spy_bias_updates(monkeypatch)
    trainer = _trainer(tmp_path, 6, "--training.spike_policy.enable", "true", "--training.spike_policy.min_history",
                       "3", "--training.spike_policy.max_rollbacks", "0")
    plant(trainer, reference_labels(trainer, 10)[8:10])  # the two micro-batches of step 5
    records = record_steps(trainer)
    trainer.train()
    assert [r.action for r in records][4] == "skip"
    assert len(loads) == 5  # 6 steps, one skipped
    # The skipped step's loads carry into the next applied step's update.
    assert loads[:4] == [2.0 * TOKENS_PER_STEP] * 4 and loads[4] == 4.0 * TOKENS_PER_STEP


def _gate_after_one_step(tmp_path, config: str, *extra: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Router gate of the last layer before and after one step whose language-model loss is zeroed: only the
    balance loss can move it. (Earlier layers' experts feed later routers, so only the last layer's experts
    are out of the balance loss's reach.)"""
    argv = ["--config", config, *TINY, "--training.steps", "1", "--job.dump_folder", str(tmp_path),
            "--optimizer.weight_decay", "0", "--activation_checkpoint.mode", "full", *extra]
    trainer = parse_cli(argv, registry=DEFAULT_REGISTRY).config.build()
    original = trainer.runner.loss_fn
    trainer.runner.loss_fn = lambda logits, labels: (lambda s, n: (s * 0.0, n))(*original(logits, labels))
    moe = trainer.model_parts[0].layers["1"].moe
    gate, experts = moe.router.gate.weight.detach().clone(), moe.experts.w1.detach().clone()
    trainer.train()
    assert torch.equal(moe.experts.w1, experts)  # no gradient reaches the experts from the balance loss
    return gate, moe.router.gate.weight.detach().clone()


# Compiled (bf16, full AC) only with the loss on: the buffer it lives in must carry its gradient out of the
# compiled graph; the control without it is the eager case's. Whether it does is decided by dynamo and AOT
# autograd, which the aot_eager backend runs without inductor's code generation (inductor compiles these
# blocks in test_compiled_blocks_with_activation_checkpointing_train_as_eager).
@pytest.mark.parametrize(("run", "aux_loss_coeff"), [("eager", 0.0), ("eager", 1e-2), ("compiled", 1e-2)])
def test_the_balance_loss_reaches_the_router(tmp_path, monkeypatch, run, aux_loss_coeff):
    _flavor(monkeypatch, aux_loss_coeff=aux_loss_coeff)
    config = ("qwen3_moe_debug",) if run == "eager" else (
        "qwen3_moe_debug_bf16", "--compile.enable", "true", "--compile.backend", "aot_eager")
    before, after = _gate_after_one_step(tmp_path, *config)
    assert torch.equal(before, after) == (aux_loss_coeff == 0.0)


def test_compiling_float32_grouped_experts_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"needs bfloat16 compute, but precision.param_dtype is float32 .* set "
                                         r"--precision.param_dtype bfloat16 or --compile.enable false"):
        _trainer(tmp_path, 1, "--compile.enable", "true")


@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory) -> str:
    """The checkpoint of a 1-step qwen3_moe_debug run (TINY)."""
    folder = tmp_path_factory.mktemp("qwen3_moe_run")
    trainer = _trainer(folder, 1, "--checkpoint.enable", "true", "--checkpoint.interval", "1")
    trainer.train()
    return str(folder / "checkpoint" / "step-1")


def test_a_trained_checkpoint_exports_to_transformers_with_the_same_logits(tmp_path, trained_checkpoint):
    """scripts/convert_to_hf.py on a qwen3_moe run: the folder loads in Qwen3MoeForCausalLM and its float32
    logits equal our model's from the DCP checkpoint (tolerance as in test_qwen3_moe_hf: rounding only)."""
    transformers = import_transformers()
    from tests.unit.test_hf_export_run import _script
    from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint
    from torchtitan_lite.components.generation import load_from_dcp

    _script("convert_to_hf").main(["--checkpoint", trained_checkpoint, "--output", str(tmp_path / "hf")])
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    ours = load_from_dcp(trained_checkpoint, config_for_checkpoint(trained_checkpoint, registry=DEFAULT_REGISTRY)).model
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max() <= 1e-5


def test_the_readme_hugging_face_round_trip_keeps_the_weights_and_the_samples(tmp_path, trained_checkpoint):
    """README "Train an MoE model": convert_to_hf -> generate --hf-dir, and convert_from_hf writes a seed holding
    the run's weights bit for bit; greedy sampling from the exported folder gives the run's text."""
    from tests.unit.test_hf_export_run import _script
    from torchtitan_lite.components.checkpoint.run_config import config_for_checkpoint
    from torchtitan_lite.components.generation import load_from_dcp
    from torchtitan_lite.tools import generate as generate_tool

    hf, seed = str(tmp_path / "qwen3_moe_hf"), str(tmp_path / "qwen3_moe_seed")
    _script("convert_to_hf").main(["--checkpoint", trained_checkpoint, "--output", hf])
    _script("convert_from_hf").main(["--hf-dir", hf, "--output", seed])
    config = config_for_checkpoint(trained_checkpoint, registry=DEFAULT_REGISTRY)
    run, seeded = load_from_dcp(trained_checkpoint, config).model, load_from_dcp(seed, config).model
    assert run.state_dict().keys() == seeded.state_dict().keys()
    assert all(torch.equal(value, seeded.state_dict()[key]) for key, value in run.state_dict().items())
    prompt = ["--prompt", "def main(", "--max-new-tokens", "8"]
    texts = [generate_tool.main([*source, *prompt], registry=DEFAULT_REGISTRY)
             for source in (["--checkpoint", trained_checkpoint], ["--hf-dir", hf])]
    assert texts[0].startswith("def main(") and len(texts[0]) > len("def main(") and texts[1] == texts[0]


def test_router_metrics_reach_tensorboard_and_the_console(tmp_path, monkeypatch, caplog):
    from tests.integration._cli import read_scalars

    _flavor(monkeypatch, bias_update_rate=1e-3)
    trainer = _trainer(tmp_path, 3, "--metrics.log_freq", "2")
    with caplog.at_level("INFO", logger="torchtitan_lite"):
        trainer.train()
    scalars = read_scalars(tmp_path / "tb")
    layers = ("layers.0", "layers.1")
    per_layer = [f"moe/{layer}/{stat}" for layer in layers for stat in ("imbalance", "dead_share", "bias_min", "bias_max")]
    for tag in [*per_layer, "moe/imbalance_max", "moe/dead_share", "moe/aux_loss"]:
        assert sorted(scalars[tag]) == [1, 2, 3], tag  # the log steps: 1, every log_freq, the last
    for step in (1, 2, 3):
        imbalances = [scalars[f"moe/{layer}/imbalance"][step] for layer in layers]
        # Between balanced (1) and one expert taking every token of its top-2 slots (8 experts / 2 = 4).
        assert all(1.0 <= value <= 4.0 for value in imbalances)
        assert scalars["moe/imbalance_max"][step] == max(imbalances)
        assert scalars["moe/aux_loss"][step] > 0  # the debug flavor's balance loss (coefficient 1e-3)
    # The bias moved after the first applied step (centred: some experts down, some up).
    assert scalars["moe/layers.0/bias_min"][3] < 0 < scalars["moe/layers.0/bias_max"][3]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 3 and all(" moe imb " in line and " dead " in line and " aux " in line for line in lines)


def _spy_aux_loss_scales(monkeypatch) -> list[float]:
    """The balance-loss weights the trainer sets, one per step."""
    scales: list[float] = []
    original = Qwen3MoeModel.set_aux_loss_scale

    def spy(self, scale):
        scales.append(scale)
        original(self, scale)

    monkeypatch.setattr(Qwen3MoeModel, "set_aux_loss_scale", spy)
    return scales


def _bf16_losses(folder, *extra: str) -> list[float]:
    argv = ["--config", "qwen3_moe_debug_bf16", *TINY, "--training.steps", "3", "--job.dump_folder", str(folder),
            *extra]
    trainer = parse_cli(argv, registry=DEFAULT_REGISTRY).config.build()
    records = record_steps(trainer)
    trainer.train()
    return [r.loss for r in records]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compiled_blocks_with_activation_checkpointing_train_as_eager(tmp_path, monkeypatch, mode):
    """Compile traces each checkpointed block, balance loss included (it used to stop dynamo with an unsafe
    side effect). Tolerance 1e-3 relative: the compiled kernels round bf16 intermediates differently
    (measured gaps up to 1.1e-5 relative over 3 steps), far below bf16's own step of 7.8e-3."""
    scales = _spy_aux_loss_scales(monkeypatch)
    eager = _bf16_losses(tmp_path / "eager", "--activation_checkpoint.mode", mode)
    compiled = _bf16_losses(tmp_path / "compiled", "--activation_checkpoint.mode", mode, "--compile.enable", "true")
    assert compiled == pytest.approx(eager, rel=1e-3)
    # Both runs, every step: the balance loss weighted 1 / 2 micro-batches (the compiled graph carries its
    # gradient: tests/unit/test_moe_experts.py).
    assert scales == [0.5] * 6


CHOSEN = 3
"""The expert a planted collapsed router sends every token to."""


def _collapse_every_router(model: Qwen3MoeModel) -> None:
    """Every router sees the same input for every token (a pre-hook replaces it by ones), and its gate gives
    expert CHOSEN a logit 12.8 above the others': top-1 sends every token there. The margin is ~100 times
    what three AdamW steps at lr 3e-3 can move a 128-wide gate row, and the expert bias moves 1.75e-3 a step."""
    for block in model.layers.values():
        router = block.moe.router
        router.register_forward_pre_hook(lambda _module, args: (torch.ones_like(args[0]), *args[1:]))
        with torch.no_grad():
            router.gate.weight.zero_()
            router.gate.weight[CHOSEN] = 0.1


def test_a_collapsed_router_shows_full_imbalance_and_its_bias_responds_each_step(tmp_path, monkeypatch, caplog):
    from tests.integration._cli import read_scalars

    rate, experts = 1e-3, QWEN3_MOE_FLAVORS["debug"].moe.num_experts
    _flavor(monkeypatch, top_k=1, bias_update_rate=rate)
    trainer = _trainer(tmp_path, 3)
    _collapse_every_router(trainer.model_parts[0])
    with caplog.at_level("INFO", logger="torchtitan_lite"):
        trainer.train()
    scalars = read_scalars(tmp_path / "tb")
    # One expert takes every token: max / mean = num_experts, the other 7 of 8 experts get none. Exact: counts
    # of small integers and their ratio.
    for layer in ("layers.0", "layers.1"):
        for step in (1, 2, 3):
            assert scalars[f"moe/{layer}/imbalance"][step] == experts
            assert scalars[f"moe/{layer}/dead_share"][step] == (experts - 1) / experts
            # Logged after the step's bias update: the centred sign step, rate * sign(mean - load) minus its
            # mean, is -rate * (2E - 2) / E for the overloaded expert and 2 * rate / E for each idle one, once per
            # step. Tolerance 1e-9: three float32 additions of values ~1e-3 round at ~1e-10.
            assert scalars[f"moe/{layer}/bias_min"][step] == pytest.approx(-step * rate * (2 * experts - 2) / experts,
                                                                          abs=1e-9)
            assert scalars[f"moe/{layer}/bias_max"][step] == pytest.approx(step * 2 * rate / experts, abs=1e-9)
        bias = trainer.model_parts[0].layers[layer.split(".")[1]].moe.expert_bias
        assert int(bias.argmin()) == CHOSEN  # the chosen expert's bias fell, every other one's rose
        assert float(bias[CHOSEN]) < 0 < float(torch.cat([bias[:CHOSEN], bias[CHOSEN + 1:]]).min())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 3 and all(" moe imb 8.00 (layers.0) dead 0.88 aux " in line for line in lines)


def test_no_bias_update_on_a_step_the_fp16_scaler_skipped(tmp_path, monkeypatch):
    _flavor(monkeypatch, bias_update_rate=1e-3)
    loads = _spy_bias_updates(monkeypatch)
    trainer = _trainer(tmp_path, 3, "--precision.param_dtype", "float16")
    original = trainer.runner.loss_fn

    def loss_fn(logits, labels):
        # Step 2's first micro-batch: a finite loss whose gradient overflows, as an FP16 overflow does.
        if trainer.train_state.step == 2 and not overflowed:
            overflowed.append(True)
            logits.register_hook(lambda grad: grad * float("inf"))
        return original(logits, labels)

    overflowed: list[bool] = []
    trainer.runner.loss_fn = loss_fn
    trainer.train()
    assert trainer.grad_scaler is not None and trainer.grad_scaler.skipped_steps == 1
    # Steps 1 and 3 applied; step 2's loads were counted, and carry into step 3's update.
    assert loads == [2.0 * TOKENS_PER_STEP, 4.0 * TOKENS_PER_STEP]
