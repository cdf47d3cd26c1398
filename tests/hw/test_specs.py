"""Datasheet lookup by the names torch reports, and the datasheet table's own consistency."""

from __future__ import annotations

import dataclasses

import pytest

from warpforge.hw.specs import PRECISIONS, SPECS, DeviceSpec, spec_for


@pytest.mark.parametrize("torch_name, spec_name", [
    ("NVIDIA H200", "H200"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("Orin", "Jetson AGX Orin"),
    ("nvidia h200", "H200"),  # any case
])
def test_spec_for_torch_names(torch_name, spec_name):
    spec = spec_for(torch_name)
    assert spec is not None and spec.name == spec_name


@pytest.mark.parametrize("name", ["NVIDIA L40", "NVIDIA GeForce GTX 1080", "NVIDIA H1000", "CPU AMD EPYC", "", None])
def test_spec_for_unknown_is_none(name):
    # "L40" must not fall back to "L4" (whole-word match), nor "H1000" to "H100".
    assert spec_for(name) is None


def test_required_devices_present():
    names = {s.name for s in SPECS}
    assert {"H100 SXM", "H100 PCIe", "H200", "A100 SXM 80GB", "L40S", "L4", "RTX 4090", "Jetson AGX Orin"} <= names


def test_dense_figures_not_sparse():
    h200 = spec_for("NVIDIA H200")
    # Datasheet prints 1,979 (bf16) and 3,958 (fp8) with sparsity; dense is half.
    assert h200.bf16 == pytest.approx(989.5) and h200.fp8 == pytest.approx(1979)
    assert h200.hbm_GBps == 4800 and h200.l2_MiB == 60 and h200.sms == 132 and h200.pcie_GBps == 64
    for s in SPECS:
        assert set(s.tflops) == set(PRECISIONS)
        if s.bf16 and s.fp8:
            # every fp8 part: fp8 = 2x bf16 dense (the datasheets round: L40S prints 362.05 vs 733)
            assert s.fp8 == pytest.approx(2 * s.bf16, rel=0.02), s.name
        if s.tf32 and s.fp16 and s.name != "RTX 4090":
            assert s.tf32 == pytest.approx(s.fp16 / 2, rel=0.02), s.name


def test_a100_and_orin_have_no_fp8():
    assert spec_for("NVIDIA A100-SXM4-80GB").fp8 is None
    assert spec_for("Orin").fp8 is None and spec_for("Orin").pcie_GBps is None


def test_devicespec_validates():
    base = spec_for("NVIDIA L4")
    with pytest.raises(ValueError, match="hbm_GBps"):
        dataclasses.replace(base, hbm_GBps=0)
    with pytest.raises(ValueError, match="fp8"):
        dataclasses.replace(base, fp8=-1.0)
    with pytest.raises(ValueError, match="match"):
        dataclasses.replace(base, match=())
    assert isinstance(base, DeviceSpec) and base.as_dict()["match"] == ["L4"]
