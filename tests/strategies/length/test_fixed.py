"""strategies/length/fixed.py."""

from __future__ import annotations

import pytest

from framework.config import ConfigError
from framework.testing import LengthControllerContract
from strategies.length.fixed import FixedLength, FixedLengthConfig


class TestFixedDefaultContract(LengthControllerContract):
    def make(self):
        return FixedLength()


class TestFixedOneContract(LengthControllerContract):
    def make(self):
        return FixedLength(FixedLengthConfig(k=1))


class TestFixedLongContract(LengthControllerContract):
    def make(self):
        return FixedLength(FixedLengthConfig(k=9))


@pytest.mark.parametrize("k", [0, -1, -10, 65])
def test_k_outside_range_rejected(k):
    with pytest.raises(ConfigError, match=rf"^k must be an integer in \[1, 64\], got {k}$"):
        FixedLengthConfig(k=k)


@pytest.mark.parametrize("k", [1, 4, 17])
def test_constant_k_and_never_stops_early(k):
    ctl = FixedLength(FixedLengthConfig(k=k))
    assert ctl.needs_confidence is False
    assert ctl.max_length(None) == k
    assert all(ctl.should_continue(i, None) for i in range(1, k + 3))
    assert FixedLength().config.k == 4
