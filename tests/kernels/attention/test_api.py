"""The curated public API of warpforge.kernels.attention."""

import warpforge.kernels.attention as attention


def test_every_exported_name_imports():
    assert attention.__all__
    for name in attention.__all__:
        assert getattr(attention, name) is not None, name
