"""FP8 rowwise / MXFP8 / blockwise FP8 grouped expert GEMMs (grouped_gemm.py): the emulated tiles against an
independent float64 reference, the bf16 GEMM, torchao's own MXFP8 emulation, the dense blockwise emulation per
expert, and the token-group padding."""
from __future__ import annotations

import pytest
import torch

from torchtitan_lite.components.quantization import grouped_gemm
from torchtitan_lite.components.quantization.blockwise_fp8 import (
    dequantize_1x128,
    dequantize_128x128,
    emulated_blockwise_linear,
    quantize_1x128,
    quantize_128x128,
)
from torchtitan_lite.components.quantization.grouped_gemm import (
    GROUP_ALIGNMENT,
    pad_groups,
    pad_rows,
    quantized_grouped_mm,
    unpad_rows,
)

E4M3 = torch.float8_e4m3fn
RECIPES = ["rowwise", "mxfp8"]
# An empty expert, odd sizes, one group longer than both alignments and one that is a multiple of 32.
COUNTS = [5, 0, 37, 32, 1]
K, N = 64, 96
# Blockwise needs expert dims in 128s; its groups: an empty expert, one over a tile of 128 tokens (two tiles, the
# second short), one exactly a tile, odd short ones.
BLOCKWISE_COUNTS = [5, 0, 150, 128, 1]
BLOCKWISE_K, BLOCKWISE_N = 128, 256
# (recipe, power-of-2 blockwise scales): what the float64 reference test covers.
CASES = [("rowwise", False), ("mxfp8", False), ("blockwise", False), ("blockwise", True)]


def _shape(recipe: str) -> tuple[list[int], int, int]:
    return (BLOCKWISE_COUNTS, BLOCKWISE_K, BLOCKWISE_N) if recipe == "blockwise" else (COUNTS, K, N)


def _operands(dtype=torch.float32, seed=0, shape=(COUNTS, K, N)):
    """x [M, K], w_t [E, K, N] and an output gradient [M, N], with columns spread over 2^±4 so that per-row,
    per-column and per-block scales all differ."""
    counts, K, N = shape  # noqa: N806  (the module's names for the dims)
    g = torch.Generator().manual_seed(seed)
    m, e = sum(counts), len(counts)

    def spread(*shape):
        return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-4, 5, shape[-1:], generator=g).float())

    x = spread(m, K).to(dtype)
    w_t = spread(e, N, K).transpose(-2, -1).to(dtype)  # [E, K, N] column-major, as GroupedExperts passes it
    grad = spread(m, N).to(dtype)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    return x, w_t, grad, offsets


def _rowwise(t: torch.Tensor, dim: int) -> torch.Tensor:
    """torchao's axiswise cast (tensor_to_scale, power-of-2 scales), dequantized in float64."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    scale = tensor_to_scale(t, E4M3, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=dim,
                            round_scales_to_power_of_2=True)
    return to_fp8_saturated(t.float() * scale, E4M3).double() / scale.double()


def _mx(t: torch.Tensor) -> torch.Tensor:
    """MXFP8 blocks of 32 along the last dim (torchao to_mx, RCEIL), dequantized in float64."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx

    scale, data = to_mx(t.contiguous(), E4M3, 32, ScaleCalculationMode.RCEIL)
    return (data.double().reshape(*t.shape[:-1], -1, 32) * get_fp_scale(scale).double().unsqueeze(-1)).reshape(t.shape)


def _blockwise(t: torch.Tensor, power_of_2: bool) -> torch.Tensor:
    """1x128 tiles along the last dim (blockwise_fp8.quantize_1x128, a short last tile by its own amax), dequantized
    in float32 as the emulation does and then widened to float64."""
    return dequantize_1x128(*quantize_1x128(t, power_of_2=power_of_2)).double()


def _blocks(w: torch.Tensor, power_of_2: bool) -> torch.Tensor:
    return dequantize_128x128(*quantize_128x128(w, power_of_2=power_of_2)).double()


def _tiles(recipe: str, x_e, w_e, g_e, power_of_2: bool = False):
    """The quantized operands of one expert's three GEMMs, built group by group:
    (forward A, forward B [K, N], dgrad A, dgrad B [N, K], wgrad A [K, tokens], wgrad B [tokens, N])."""
    if recipe == "blockwise":
        # The expert's weight in nn.Linear's layout [N, K], in 128x128 blocks for both GEMMs that read it; the
        # weight gradient's tiles of 128 tokens taken over this expert's tokens alone.
        w_blocks = _blocks(w_e.t(), power_of_2)
        return (_blockwise(x_e, power_of_2), w_blocks.t(), _blockwise(g_e, power_of_2), w_blocks,
                _blockwise(x_e.t(), power_of_2), _blockwise(g_e.t(), power_of_2).t())
    if recipe == "rowwise":
        return (_rowwise(x_e, -1), _rowwise(w_e, 0), _rowwise(g_e, -1), _rowwise(w_e, -1).t(),
                _rowwise(x_e, 0).t(), _rowwise(g_e, 0))
    pad = -x_e.shape[0] % 32  # the weight-gradient blocks of 32 tokens lie inside this expert's group
    x_p = torch.cat([x_e, x_e.new_zeros(pad, x_e.shape[1])])
    g_p = torch.cat([g_e, g_e.new_zeros(pad, g_e.shape[1])])
    return (_mx(x_e), _mx(w_e.t()).t(), _mx(g_e), _mx(w_e).t(), _mx(x_p.t()), _mx(g_p.t()).t())


def _reference(recipe: str, x, w_t, grad, offsets, power_of_2: bool = False):
    """float64 (out, grad_x, grad_w_t) of the quantized tiles and, for each, sum |a||b| of its dot products."""
    outs = [torch.zeros(x.shape[0], w_t.shape[2], dtype=torch.float64),
            torch.zeros(x.shape[0], w_t.shape[1], dtype=torch.float64), torch.zeros(w_t.shape, dtype=torch.float64)]
    mags = [torch.zeros_like(t) for t in outs]
    start = 0
    for e, end in enumerate(offsets.tolist()):
        rows = slice(start, end)
        if end > start:
            fa, fb, da, db, wa, wb = _tiles(recipe, x[rows], w_t[e], grad[rows], power_of_2)
            for i, (a, b) in enumerate([(fa, fb), (da, db), (wa, wb)]):
                target = outs[i][e] if i == 2 else outs[i][rows]
                target.copy_(a @ b)
                (mags[i][e] if i == 2 else mags[i][rows]).copy_(a.abs() @ b.abs())
        start = end
    return outs, mags


def _emulated(recipe, x, w_t, grad, offsets, power_of_2=False):
    x, w_t = x.clone().requires_grad_(), w_t.detach().clone().requires_grad_()
    out = quantized_grouped_mm(x, w_t, offsets, recipe=recipe, emulate=True, power_of_2=power_of_2)
    grad_x, grad_w = torch.autograd.grad(out, (x, w_t), grad)
    return [out, grad_x, grad_w]


@pytest.mark.parametrize("recipe, power_of_2", CASES)
def test_emulated_gemms_equal_a_float64_reference_of_the_same_tiles(recipe, power_of_2):
    counts, k, n = _shape(recipe)
    x, w_t, grad, offsets = _operands(shape=(counts, k, n))
    # One token's gradient 2^12 times the others' (a confidently wrong prediction next to right ones): every recipe
    # scales the input-gradient GEMM's output gradient per token (rowwise), per block of 32 (MXFP8) or per 1x128
    # tile (blockwise) along N, so the quiet tokens keep their own scales. One scale for the whole gradient would
    # push them 2^12 down, into e4m3's subnormals, and move their input gradients far beyond the bound below.
    grad[7] *= 2.0 ** 12
    got = _emulated(recipe, x, w_t, grad, offsets, power_of_2)
    expected, magnitudes = _reference(recipe, x, w_t, grad, offsets, power_of_2)
    plain = [torch._grouped_mm(x, w_t, offs=offsets)]
    for name, value, ref, mag, length in zip(("output", "input gradient", "weight gradient"), got, expected,
                                             magnitudes, (k, n, max(counts))):
        # The tiles are the same (blockwise: the same float32 dequantized values, as its float32 scales make them
        # inexact in bfloat16), so only float32 accumulation differs: |error| <= length * u * sum |a||b| with
        # u = 2^-24 for any summation order; 2^-23 doubles the margin.
        bound = length * 2.0 ** -23 * mag
        assert ((value.double() - ref).abs() <= bound).all(), name
    # Not vacuous: quantization moved the output far beyond that bound.
    assert ((got[0].double() - plain[0]).abs() > k * 2.0 ** -23 * magnitudes[0]).float().mean() > 0.5
    # The empty expert's weight gradient is exactly zero.
    assert torch.count_nonzero(got[2][1]) == 0


def _sqnr_db(value: torch.Tensor, reference: torch.Tensor) -> float:
    reference = reference.detach().double()
    return float(10 * torch.log10(reference.square().sum() / (value.detach().double() - reference).square().sum()))


@pytest.mark.parametrize("recipe", [*RECIPES, "blockwise"])
def test_bf16_emulation_tracks_the_bf16_grouped_gemm_above_an_sqnr_floor(recipe):
    counts, k, n = _shape(recipe)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(counts), k, generator=g).bfloat16()
    w_t = torch.randn(len(counts), n, k, generator=g).transpose(-2, -1).bfloat16()
    grad = torch.randn(sum(counts), n, generator=g).bfloat16()
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    got = _emulated(recipe, x, w_t, grad, offsets)
    x_ref, w_ref = x.clone().requires_grad_(), w_t.detach().clone().requires_grad_()
    out = torch._grouped_mm(x_ref, w_ref, offs=offsets)
    expected = [out, *torch.autograd.grad(out, (x_ref, w_ref), grad)]
    assert [t.dtype for t in got] == [torch.bfloat16] * 3
    # e4m3 keeps 3 mantissa bits (relative rounding error <= 2^-4, ~31 dB per element); dot products of Gaussian
    # operands land at 28-29 dB (measured; blockwise 28.7-28.9). 25 dB leaves margin and still fails for e5m2 (2 bits, ~25 dB per
    # element before the GEMM) or a scale that is off by a power of 2 in the saturating direction.
    for name, value, ref in zip(("output", "input gradient", "weight gradient"), got, expected):
        assert 25.0 < _sqnr_db(value, ref) < 40.0, name


def test_mxfp8_emulation_equals_torchaos_own_emulated_mxfp8_grouped_gemm():
    from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    g = torch.Generator().manual_seed(2)
    counts = [32, 0, 64, 32]  # already aligned: torchao's emulation takes the groups as they are
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    x = torch.randn(sum(counts), K, generator=g).bfloat16()
    w_t = torch.randn(len(counts), N, K, generator=g).transpose(-2, -1).bfloat16()
    grad = torch.randn(sum(counts), N, generator=g).bfloat16()
    results = []
    for fn in (lambda a, b: quantized_grouped_mm(a, b, offsets, recipe="mxfp8", emulate=True),
               lambda a, b: _to_mxfp8_then_scaled_grouped_mm(a, b, offsets, out_dtype=torch.bfloat16,
                                                             kernel_preference=KernelPreference.EMULATED)):
        a, b = x.clone().requires_grad_(), w_t.detach().clone().requires_grad_()
        out = fn(a, b)
        results.append([out, *torch.autograd.grad(out, (a, b), grad)])
    for ours, theirs in zip(*results):
        # Same tiles, both dequantized exactly to bf16 and multiplied by the same bf16 grouped GEMM.
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("alignment", sorted(set(GROUP_ALIGNMENT.values())))
def test_padding_puts_every_group_on_an_aligned_start_and_round_trips(alignment):
    counts = [0, 3, alignment, alignment + 1, 0, 1]
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    layout = pad_groups(offsets, sum(counts), alignment)
    padded_counts = [-(-c // alignment) * alignment for c in counts]
    assert layout.offsets.tolist() == torch.cumsum(torch.tensor(padded_counts), 0).tolist()
    assert layout.total_rows % alignment == 0 and layout.total_rows >= layout.offsets[-1]
    x = torch.arange(1, sum(counts) + 1, dtype=torch.float32).unsqueeze(1).repeat(1, 4)
    padded = pad_rows(x, layout)
    starts = [0, *layout.offsets.tolist()[:-1]]
    for c, start, rows in zip(counts, starts, torch.split(x, counts)):
        torch.testing.assert_close(padded[start:start + c], rows, rtol=0, atol=0)
    assert int(torch.count_nonzero(padded[:, 0])) == sum(counts)  # everything else is zero padding
    torch.testing.assert_close(unpad_rows(padded, layout), x, rtol=0, atol=0)


KERNEL_ROW_ALIGNMENT = {"rowwise": 16, "mxfp8": 32, "blockwise": 128}
"""What the kernels need of each token group, stated apart from GROUP_ALIGNMENT: torch._scaled_grouped_mm's FP8
groups start at multiples of 16 rows; MXFP8's weight-gradient scale blocks hold 32 tokens and blockwise's tiles 128,
which must not straddle two experts."""


@pytest.mark.parametrize("recipe, emulate", [("rowwise", True), ("rowwise", False), ("mxfp8", True), ("mxfp8", False),
                                             ("blockwise", True)])
def test_every_grouped_gemm_sees_its_groups_padded_to_the_kernels_row_alignment(monkeypatch, recipe, emulate):
    """The operands that reach the GEMMs (the torchao kernels' on a GPU; here a stand-in receives what they would)
    hold each expert's rows at a start that is a multiple of the kernel's alignment, zeros in between, and the
    unpadded result is the GEMM of the unpadded groups."""
    counts, k, n = _shape(recipe)
    x, w_t, grad, offsets = _operands(dtype=torch.float32 if emulate else torch.bfloat16, shape=(counts, k, n))
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    grouped_mm = torch._grouped_mm

    def recording(a, b, offs=None):
        seen.append((a.detach(), offs))
        return grouped_mm(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", recording)
    if not emulate:  # torchao's kernels need CUDA
        monkeypatch.setattr(grouped_gemm, "native_grouped_mm", lambda a, b, offs, _recipe: torch._grouped_mm(a, b, offs=offs))
    x_in, w_in = x.clone().requires_grad_(), w_t.detach().clone().requires_grad_()
    out = quantized_grouped_mm(x_in, w_in, offsets, recipe=recipe, emulate=emulate)
    torch.autograd.grad(out, (x_in, w_in), grad)
    align = KERNEL_ROW_ALIGNMENT[recipe]
    # The emulation's output, input-gradient and weight-gradient GEMMs; the stand-in kernel's own backward is autograd's.
    assert len(seen) == (3 if emulate else 1)
    (padded_x, _), padded_ends = seen[0], seen[0][1].tolist()
    for _, offs in seen:
        assert offs is not None and not (offs % align).any(), f"group ends {offs.tolist()} not multiples of {align}"
    assert padded_x.shape[0] % align == 0
    starts, padded_starts = [0, *offsets.tolist()[:-1]], [0, *padded_ends[:-1]]
    for count, start, padded_start, padded_end in zip(counts, starts, padded_starts, padded_ends, strict=True):
        assert padded_end - padded_start == -(-count // align) * align  # no more rows than the alignment asks
        rows = padded_x[padded_start:padded_end]
        # The group's rows as the emulation's forward tiles or the kernel read them, then zero rows.
        want = x[start:start + count] if not emulate else grouped_gemm.grouped_tiles(recipe).forward_input(padded_x)[
            padded_start:padded_start + count]
        torch.testing.assert_close(rows[:count], want.to(rows.dtype), rtol=0, atol=0)
        assert torch.count_nonzero(rows[count:]) == 0
    assert torch.count_nonzero(padded_x[padded_ends[-1]:]) == 0
    if not emulate:
        # The padding changes no row of the product and comes off again: the plain GEMM of the unpadded groups.
        torch.testing.assert_close(out, grouped_mm(x, w_t, offs=offsets), rtol=0, atol=0)


def test_every_token_in_the_last_group_or_none_at_all():
    for counts in ([0, 0, 7], [0, 0, 0]):
        offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        x = torch.randn(sum(counts), K)
        w_t = torch.randn(3, N, K).transpose(-2, -1)
        out = quantized_grouped_mm(x, w_t, offsets, recipe="rowwise", emulate=True)
        assert out.shape == (sum(counts), N) and torch.isfinite(out).all()


@pytest.mark.parametrize("power_of_2", [False, True])
def test_blockwise_experts_compute_the_dense_blockwise_recipe_on_each_group_alone(power_of_2):
    """Padding each token group to 128 rows keeps the weight gradient's tiles of 128 tokens inside one expert: every
    expert's three GEMMs equal the dense blockwise emulation (emulated_blockwise_linear) run on its group alone."""
    x, w_t, grad, offsets = _operands(seed=3, shape=(BLOCKWISE_COUNTS, BLOCKWISE_K, BLOCKWISE_N))
    got = _emulated("blockwise", x, w_t, grad, offsets, power_of_2)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end == start:
            continue  # the empty expert (its zero weight gradient: the float64 reference test)
        x_e = x[start:end].clone().requires_grad_()
        w_e = w_t[e].t().contiguous().requires_grad_()  # nn.Linear's [N, K]
        out = emulated_blockwise_linear(x_e, w_e, power_of_2=power_of_2)
        grad_x, grad_w = torch.autograd.grad(out, (x_e, w_e), grad[start:end])
        # Same float32 tiles and float32 products; torch._grouped_mm and mm may sum in another order, so 1e-5
        # relative to the largest entry (float32 accumulation over at most 256 terms: under 256 x 2^-24 = 1.5e-5 of
        # sum |a||b|, itself within a few times the largest entry for these Gaussian operands).
        for name, value, ref in (("output", got[0][start:end], out), ("input gradient", got[1][start:end], grad_x),
                                 ("weight gradient", got[2][e], grad_w.t())):
            torch.testing.assert_close(value, ref, rtol=0, atol=1e-5 * float(ref.detach().abs().max().clamp(min=1)),
                                       msg=f"expert {e} {name}")
        start = end
    # Expert 2's 150 tokens end at row 155, inside the second tile of 128 rows of the unpadded operands. Made 2^8
    # larger, they leave expert 3's weight gradient bit for bit as it was (its tiles hold its own tokens only) ...
    loud = x.clone()
    loud[5:155] *= 2.0 ** 8
    assert torch.equal(_emulated("blockwise", loud, w_t, grad, offsets, power_of_2)[2][3], got[2][3])
    # ... whereas tiles over the unpadded rows (straddling experts 2 and 3) would be scaled by expert 2's amax.
    from torchtitan_lite.components.quantization.blockwise_fp8 import fake_1x128

    def straddling(t: torch.Tensor) -> torch.Tensor:
        return fake_1x128(t.t(), power_of_2=power_of_2)[:, 155:283]

    assert not torch.equal(straddling(grad) @ straddling(loud).t(), straddling(grad) @ straddling(x).t())


def test_power_of_2_blockwise_runs_its_grouped_gemms_in_bf16_on_the_same_tiles_as_float32(monkeypatch):
    """Power-of-2 scales make every dequantized element an e4m3 value times a power of 2, exact in bfloat16: the
    bf16 grouped GEMMs see exactly the operands the float32 path multiplies (float32 scales would not: the control
    runs float32 GEMMs). Results then differ only by float32 summation order and the final bf16 rounding: within
    one bf16 unit in the last place (2^-8 relative) of the float32 path's result, plus 2^-23 x length x sum |a||b|
    for the order of sums."""
    x, w_t, grad, offsets = _operands(seed=4, shape=(BLOCKWISE_COUNTS, BLOCKWISE_K, BLOCKWISE_N))
    x, w_t, grad = x.bfloat16(), w_t.bfloat16(), grad.bfloat16()
    dtypes: list[torch.dtype] = []
    grouped_mm = torch._grouped_mm

    def recording(a, b, offs=None):
        dtypes.append(a.dtype)
        return grouped_mm(a, b, offs=offs)

    monkeypatch.setattr(torch, "_grouped_mm", recording)
    got = _emulated("blockwise", x, w_t, grad, offsets, power_of_2=True)
    assert dtypes == [torch.bfloat16] * 3
    dtypes.clear()
    float32 = _emulated("blockwise", x.float(), w_t.float(), grad.float(), offsets, power_of_2=True)
    assert dtypes == [torch.float32] * 3
    dtypes.clear()
    _emulated("blockwise", x, w_t, grad, offsets, power_of_2=False)
    assert dtypes == [torch.float32] * 3  # the control: float32 scales multiply in float32
    _, magnitudes = _reference("blockwise", x.float(), w_t.float(), grad.float(), offsets, True)
    for name, value, ref, mag, length in zip(("output", "input gradient", "weight gradient"), got, float32,
                                             magnitudes, (BLOCKWISE_K, BLOCKWISE_N, max(BLOCKWISE_COUNTS))):
        bound = 2.0 ** -8 * ref.double().abs() + length * 2.0 ** -23 * mag
        assert ((value.double() - ref.double()).abs() <= bound).all(), name
