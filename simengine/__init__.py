"""A simulated OpenAI-compatible LLM engine (`python -m simengine`): no GPU, no model.

It answers like vLLM or llama-server (chat and text completions, streaming, /v1/models, /health,
/metrics in either engine's names) with load that behaves like a real engine's: continuous batching,
a waiting queue, a KV budget, and fault injection for supervision tests. See docs/engines.md.
"""

from simengine.core import SimConfig, SimCore, simulate

__all__ = ["SimConfig", "SimCore", "simulate"]
