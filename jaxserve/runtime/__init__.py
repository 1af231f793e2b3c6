"""The device side of a step: the KV pool arrays, padded step inputs, on-device sampling, and the
ModelRunner that compiles one program per bucket and runs it with the pool donated."""
