"""The kept consensus: a state is kept only when every floating-point value is finite.

``Consensus.keep`` checks finiteness with one test over the tensors' sums
instead of one per element; these pin that it still refuses every NaN and
infinity wherever it sits, in every float dtype, and keeps a half-precision
state whose sum would overflow its own dtype.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from elche.runtime.consensus import Consensus

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Net(nn.Module):
    """Two parameters, a float buffer and an integer buffer (as BatchNorm has)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, 64, dtype=dtype).view(8, 8))
        self.bias = nn.Parameter(torch.zeros(8, dtype=dtype))
        self.register_buffer("running", torch.ones(8, dtype=dtype))
        self.register_buffer("count", torch.tensor(3, dtype=torch.long))


@pytest.mark.parametrize("dtype", FLOATS)
def test_a_finite_state_is_kept_as_a_copy(dtype: torch.dtype) -> None:
    net, kept = _Net(dtype), Consensus()
    assert kept.keep(net, 4)
    assert kept.round == 4 and kept.state is not None
    with torch.no_grad():
        net.weight.add_(1.0)  # the copy does not follow the model
    assert_close(kept.state["weight"], torch.linspace(-1.0, 1.0, 64, dtype=dtype).view(8, 8))
    assert kept.state["count"].item() == 3


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["weight", "bias", "running"])
def test_any_non_finite_value_is_refused_and_the_last_state_stays(
    dtype: torch.dtype, bad: float, where: str
) -> None:
    net, kept = _Net(dtype), Consensus()
    assert kept.keep(net, 1)
    with torch.no_grad():
        getattr(net, where).view(-1)[5] = bad
    assert not kept.keep(net, 2)
    assert kept.round == 1 and kept.state is not None
    assert torch.isfinite(kept.state[where]).all()


def test_infinities_of_both_signs_are_refused() -> None:
    """+inf and -inf in one tensor sum to NaN: still not finite."""
    net, kept = _Net(torch.float32), Consensus()
    with torch.no_grad():
        net.weight.view(-1)[0] = float("inf")
        net.weight.view(-1)[1] = float("-inf")
    assert not kept.keep(net)
    assert kept.state is None


def test_a_float16_state_whose_sum_overflows_float16_is_kept() -> None:
    """4096 values of 60000 sum past float16's largest (65504); summed in float32, kept."""
    net, kept = _Net(torch.float16), Consensus()
    net.weight = nn.Parameter(torch.full((64, 64), 60000.0, dtype=torch.float16))
    assert torch.isinf(net.weight.detach().sum())  # the premise: its own dtype overflows
    assert kept.keep(net)
    assert kept.state is not None and kept.state["weight"].dtype is torch.float16


def test_restore_loads_the_kept_state() -> None:
    net, kept = _Net(torch.float32), Consensus()
    assert not kept.restore(net)  # nothing kept yet
    kept.keep(net)
    with torch.no_grad():
        net.bias.fill_(float("nan"))
    assert kept.restore(net)
    assert_close(net.bias.detach(), torch.zeros(8))
