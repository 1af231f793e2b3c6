"""The engine: LLMEngine steps schedule -> run -> postprocess; LLM is the offline entry point;
per-request and engine-wide metrics; profiler sessions over a window of steps."""
