"""The control plane, in two halves and what they share.

- `controller.engine`: what runs inside an engine process (vLLM's hook, a twin): follow the
  tables topic, fold envelopes and controls, validate, stage into the engine's table switch,
  watch the swapped-in table (guardrail, drift) and report on the status topic.
- `controller.fleet`: the control service (`tabletune control`), one closed loop per table key
  for all its engines: profile, refit, guard, re-profile, publish.
- Beside them, what both use: table validation and vLLM's own validator (`validation`,
  `vllm_compat`), the step columns the detectors read (`steps`), the guardrail, the drift
  detector, the explorer and the status publisher.

The engine side never imports the fleet side (an import contract in pyproject.toml).
"""
