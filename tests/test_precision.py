"""bf16-mixed under every ZeRO stage stays close to the fp32 run; autocast follows the device type."""

import pytest
import torch

from lightning_mgpu import HybridPrecision
from tests.helpers.equivalence import fit
from tests.helpers.modules import LlamaModule, RandomTokenDataModule

BF16_RTOL = 2e-2  # bf16 keeps 8 mantissa bits (~4e-3 relative per op); 10 steps of a tiny LM stay within 2%


def test_autocast_uses_bf16_on_the_device_type():
    plugin = HybridPrecision("bf16-mixed", device_type="cpu")
    with plugin.forward_context():
        out = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16
    with HybridPrecision("32-true").forward_context():
        assert torch.nn.Linear(4, 4)(torch.randn(2, 4)).dtype == torch.float32


@pytest.mark.parametrize("name", ["16-mixed", "bf16-true", "16-true"])
def test_precisions_of_a_later_version_are_refused(name):
    with pytest.raises(NotImplementedError, match=name):
        HybridPrecision(name)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_bf16_mixed_tracks_fp32(zero_stage):
    dp = 2
    fp32, _ = fit(LlamaModule, lambda: RandomTokenDataModule(batch_size=4), {"zero_stage": zero_stage}, dp, 10)
    bf16, _ = fit(LlamaModule, lambda: RandomTokenDataModule(batch_size=4), {"zero_stage": zero_stage}, dp, 10,
                  trainer_kwargs={"precision": "bf16-mixed"})
    assert all(torch.isfinite(torch.tensor(bf16.losses)))
    assert bf16.losses != fp32.losses  # autocast really ran
    torch.testing.assert_close(torch.tensor(bf16.losses), torch.tensor(fp32.losses), rtol=BF16_RTOL, atol=0)
    for key, value in bf16.state_dict.items():
        assert value.dtype == torch.float32, key  # master weights stay fp32
