"""Applies published tables inside engines: follow the tables topic, validate, stage into the
engine's table switch, report on the status topic; guardrails and staleness checks."""
