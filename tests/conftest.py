"""Test-wide setup: 8 fake CPU devices for JAX, set before anything imports JAX."""

from __future__ import annotations

import os

# XLA reads these once, when JAX first initialises its backend; later changes are ignored.
# LLVM's optimisations off: compiling is most of the suite's time, and what the tests check
# (values, shardings, collectives: the SPMD partitioner runs before LLVM) does not depend on them.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
