"""The host core: sequences, KV block bookkeeping, the scheduler, sampling parameters and
outputs. Plain Python (ints, lists, deques): it imports no jax, so a fake executor can drive it
and its tests run in milliseconds."""
