"""Attention backends over the paged KV pool: one contract (base.py), one module per backend,
named after it.

| backend | where it runs | what it is |
| --- | --- | --- |
| reference | anywhere | plain jnp, gathers K/V per token: the oracle of the others |
| cpu | CPU with a C++ compiler; float32 | C++ kernel through XLA's FFI, built on first use |
| xla | anywhere | plain jnp for XLA: the reference, plus query tiles in prefill-heavy steps |
| mosaic | Hopper GPU (sm_90a); bf16/fp16 | Pallas kernel, Mosaic GPU lowering: TMA, wgmma |
| triton | GPU with jax-triton | Triton kernel through `jax_triton.triton_call` |
| pallas | GPU; CPU in interpret mode (slow: for tests) | Pallas kernel, Triton lowering |

Beside them: the step metadata every backend takes (metadata.py), the K/V page write they share
(kv_write.py), the backend behind each name (registry.py), auto's self-test on the device and its
batches (selftest.py, ragged.py), and the engine's choice (choose.py).
"""
