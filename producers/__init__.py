"""Engine-side producers: the per-step recorder, its sinks, the table switch, the vLLM hook
(`producers.vllm`) and the simulated engine (`producers.twin`)."""
