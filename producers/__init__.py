"""Engine-side producers: the per-step recorder, its sinks and the vLLM hook (`producers.vllm`).

The engine's table switch and the tables-topic follower live in `controller.engine`; the
simulated engine that uses the same recorder and switch is the top-level `twin` package."""
