"""The comparison each model family's FP8 verdict runs (scripts/loss_compare.py --verdict FAMILY).

Every arm is a registered debug config of the family trained with the same schedule (``overrides``), so that
arms differ in their precision only: FP32 (the control's reference), BF16 (the baseline every recipe is
judged against), the recipes, and one recipe with a planted fault. The schedule was chosen on CPU so that
the loss leaves the unigram plateau well inside the run and the BF16-vs-FP32 paired gap is small and stable
(docs/mixed_precision.md, "The FP8 verdict", has the measurements): 4 blocks, 100 steps of 16 x 128 tokens,
learning rate 1e-3 after 20 warm-up steps, cosine decay; validation on the same 10 held-out batches at steps
50, 75 and 100, whose mean is the statistic.
"""
from __future__ import annotations

from dataclasses import dataclass, field

SCHEDULE = ("--model.n_layers", "4", "--training.steps", "100", "--optimizer.lr", "1e-3",
            "--lr_scheduler.warmup_steps", "20", "--validation.enable", "true", "--validation.freq", "25",
            "--validation.steps", "10")
EVAL_STEPS = (50, 75, 100)


@dataclass(frozen=True)
class FamilySetup:
    family: str
    reference: str
    """The FP32 config: the control judges the baseline against it."""
    baseline: str
    """The BF16 config every recipe is judged against."""
    recipes: dict[str, str]
    """recipe -> its config (the baseline plus that recipe's converter)."""
    fault: str
    """The planted fault (fp8_faults.FAULTS) of the fault arm."""
    fault_recipe: str
    """The recipe the fault is planted into."""
    delta: float
    """Largest acceptable mean validation-loss cost of a recipe over the baseline, nats."""
    delta_why: str
    overrides: tuple[str, ...] = SCHEDULE
    eval_steps: tuple[int, ...] = EVAL_STEPS
    default_recipes: tuple[str, ...] = field(default=())
    """Recipes run when --recipes is not given (all of them when empty)."""


_DELTA_WHY = ("0.5% of the validation loss at step 100 (~4.6 nats): a cost that matters at pretraining scale (DeepSeek-V3 "
              "reports < 0.25% relative loss error for its FP8 recipe over ~1T tokens) and that 4 paired seeds resolve "
              "here. Not a multiple of the BF16-vs-FP32 gap: with FP32 master weights that gap is ~1e-4 nats at this "
              "scale (measured on llama3), so a δ built from it would fail a recipe for a 0.03% cost; the control still "
              "shows δ is not tighter than BF16, and the fault arm that it is loose enough to catch a real bug")

SETUPS: dict[str, FamilySetup] = {setup.family: setup for setup in (
    FamilySetup(
        family="llama3", reference="llama3_debug", baseline="llama3_debug_bf16",
        recipes={"tensorwise": "llama3_debug_fp8", "rowwise": "llama3_debug_fp8_rowwise",
                 "mxfp8": "llama3_debug_mxfp8", "blockwise": "llama3_debug_fp8_blockwise",
                 "fp16": "llama3_debug_fp16", "tensorwise_head": "llama3_debug_fp8_head"},
        fault="round_toward_zero", fault_recipe="tensorwise", delta=0.023, delta_why=_DELTA_WHY,
        # The FP8 head is an opt-in speed option, judged on its own (--recipes tensorwise_head): the default
        # verdict keeps the arms of the shipped recipes.
        default_recipes=("tensorwise", "rowwise", "mxfp8", "blockwise", "fp16")),
    FamilySetup(
        family="qwen3_moe", reference="qwen3_moe_debug", baseline="qwen3_moe_debug_bf16",
        recipes={"experts_rowwise": "qwen3_moe_debug_fp8", "experts_mxfp8": "qwen3_moe_debug_mxfp8"},
        fault="round_toward_zero", fault_recipe="experts_rowwise", delta=0.023, delta_why=_DELTA_WHY),
    FamilySetup(
        family="deepseek_v3", reference="deepseek_v3_debug", baseline="deepseek_v3_debug_bf16",
        recipes={"blockwise": "deepseek_v3_debug_fp8_blockwise"},
        fault="round_toward_zero", fault_recipe="blockwise", delta=0.023, delta_why=_DELTA_WHY),
)}


def setup_for(family: str) -> FamilySetup:
    if family not in SETUPS:
        raise ValueError(f"no FP8 verdict setup for family {family!r}; choose one of: {', '.join(SETUPS)}")
    return SETUPS[family]
