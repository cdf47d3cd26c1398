"""The machine's limits: datasheets (:mod:`.specs`), measured ceilings (:mod:`.probe`), roofline math.

``warpforge probe`` measures and caches; :func:`ceilings` reads that cache (else the datasheet) and
:func:`roofline` turns FLOPs and bytes into a floor time. Importing this package loads no Triton;
the probe and its kernels load only when used.
"""

from warpforge.hw.roofline import CeilingError, Ceilings, ceilings, check_fraction, dtype_key, roofline
from warpforge.hw.specs import SPECS, DeviceSpec, spec_for

__all__ = ["SPECS", "CeilingError", "Ceilings", "DeviceSpec", "ceilings", "check_fraction", "dtype_key", "roofline",
           "spec_for"]
