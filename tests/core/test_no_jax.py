"""The host core (and what the scheduler simulator needs) imports no jax."""

from __future__ import annotations

import subprocess
import sys

HOST_MODULES = ("jaxserve", "jaxserve.core.scheduler", "jaxserve.core.policies",
                "jaxserve.core.block_manager",
                "jaxserve.core.swap_space", "jaxserve.core.sequence",
                "jaxserve.core.sampling_params", "jaxserve.core.admission", "jaxserve.core.outputs",
                "jaxserve.core.router",
                "jaxserve.config",
                "jaxserve.engine.postprocess", "jaxserve.testing.sim")


def test_host_core_imports_without_jax():
    code = ("import sys; sys.modules['jax'] = None\n"  # any `import jax` now raises ImportError
            f"for m in {HOST_MODULES!r}: __import__(m)\n"
            "assert 'jax' not in [m.split('.')[0] for m in sys.modules if sys.modules[m]]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_the_check_notices_a_jax_import():
    code = "import sys; sys.modules['jax'] = None; import jaxserve.runtime.runner"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "jax" in proc.stderr
