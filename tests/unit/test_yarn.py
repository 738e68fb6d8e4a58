"""YaRN rotary scaling: the frequencies, the table factor and the softmax scale equal transformers' (the published
DeepSeek-V3 reference formulas) for DeepSeek-V3's settings and for a table factor != 1."""
import math

import pytest
import torch
from _transformers import import_transformers

from models.common.attention.rope import rope_cache, rope_frequencies
from models.common.attention.yarn import YarnScaling

transformers = import_transformers()
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402


def _hf(scaling: YarnScaling, head_dim: int, theta: float) -> tuple[torch.Tensor, float]:
    positions = int(scaling.factor * scaling.original_max_position_embeddings)
    config = transformers.DeepseekV3Config(qk_rope_head_dim=head_dim, rope_theta=theta,
                                           max_position_embeddings=positions, rope_scaling=scaling.hf_dict())
    return ROPE_INIT_FUNCTIONS["yarn"](config)


V3 = YarnScaling(factor=40.0, original_max_position_embeddings=4096)
LITE = YarnScaling(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=1.0)


@pytest.mark.parametrize("scaling", [V3, LITE, YarnScaling(factor=4.0, original_max_position_embeddings=512)])
def test_frequencies_and_table_factor_equal_transformers(scaling):
    inv_freq, attention_factor = _hf(scaling, 64, 10000.0)
    # Same float32 operations in the same order: bitwise.
    assert torch.equal(rope_frequencies(64, 10000.0, scaling), inv_freq)
    assert scaling.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    # Interpolation happened: the slowest frequency is divided by the factor, the fastest is kept.
    plain = rope_frequencies(64, 10000.0, None)
    assert float(inv_freq[-1]) == pytest.approx(float(plain[-1]) / scaling.factor, rel=1e-6)
    assert float(inv_freq[0]) == float(plain[0])


def test_table_factor_scales_the_rotary_table():
    table = rope_cache(64, 16, 10000.0, LITE)
    assert LITE.attention_factor == pytest.approx((0.0707 * math.log(40) + 1) / (0.1 * math.log(40) + 1))
    torch.testing.assert_close(table.abs(), torch.full((16, 32), LITE.attention_factor), rtol=1e-6, atol=0)
    assert torch.allclose(rope_cache(64, 16, 10000.0, V3).abs(), torch.ones(16, 32))


def test_softmax_scale_factor_is_mscale_all_dim_squared():
    assert V3.softmax_scale_factor == pytest.approx((0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert YarnScaling(mscale_all_dim=0.0).softmax_scale_factor == 1.0
    with pytest.raises(ValueError, match="beta_slow=32.0, beta_fast=1.0; DeepSeek-V3 uses 1 and 32"):
        YarnScaling(beta_fast=1.0, beta_slow=32.0)
