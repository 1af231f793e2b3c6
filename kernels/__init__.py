"""The engine's kernels: the attention backends over the paged KV pool (attention/), the C++
kernels for CPUs (cpu/, built by cpu_library.py; the block-quantized matmul, cpu_matmul.py), the
quantized weight forms they read (quant.py: GGUF's blocks; fp8.py: FP8 checkpoints), and where
built artifacts are kept (cache_dir.py). Installed as jaxserve.kernels; it imports nothing from
the rest of jaxserve."""

if __name__ == "kernels":  # this folder by its own name, from a checkout's root
    import os as _os

    from jaxserve.checkout import step_aside

    step_aside(__name__, _os.path.dirname(__file__))
