"""Session-wide test settings.

Each test session compiles into its own Inductor cache: kernels cached by a run under the AVX2 emulation
(`ATEN_CPU_CAPABILITY=avx2`) were loaded by a later default-numerics run on the same machine and returned wrong
values (tests/engine/test_logprobs.py::test_fused_pieces_compile_on_cpu, 2026-12-01).
"""

from __future__ import annotations

import os
import tempfile

if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hybridflow_inductor_")
