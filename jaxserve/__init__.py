"""jaxserve: an LLM inference engine on JAX/XLA with continuous batching over a paged KV cache."""

from jaxserve.config import EngineConfig
from jaxserve.engine import LLMEngine
from jaxserve.llm import LLM
from jaxserve.outputs import CompletionOutput, RequestOutput
from jaxserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput",
           "SamplingParams"]
