"""The engine side of control: what runs inside each engine process.

`follower` reads the tables topic on a background thread and hands its key's messages to
`feed.EngineFeed`, which folds them through `agent.TableAgent` and stages the wanted table into
`table_switch.TableSwitch`, the one object the engine thread touches between steps; `watch`
runs the guardrail and the drift detector on the engine's own telemetry. Never imports
`controller.fleet`.
"""
