"""Scenario TOML -> `Scenario`, with errors that name the field path and the reason.

The loader checks types and unknown keys against the dataclass fields (so a typo such as
`concurency` is an error, not a silently ignored key), resolves trace paths relative to the
file, and lets the dataclasses' own checks speak for values.
"""

from __future__ import annotations

import tomllib
import types
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

from twin.config import (
    CostConfig,
    DrafterConfig,
    EngineConfig,
    PhaseConfig,
    Scenario,
    ScenarioError,
)

BUILTIN_SCENARIOS = Path(__file__).resolve().parent / "scenarios"
"""The scenario files that ship with the twin (drift scenarios, calibration loads)."""

_SECTIONS = {"engine": EngineConfig, "cost": CostConfig, "drafter": DrafterConfig}
_TOP_LEVEL = ("seed", "name", "engine", "cost", "drafter", "phases")


def load_scenario(path: str | Path) -> Scenario:
    """Read and check a scenario file."""
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError("", f"cannot read scenario {source}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ScenarioError("", f"scenario {source} is not a TOML text file (byte {exc.start} "
                                "is not UTF-8)") from None
    return parse_scenario(text, base_dir=source.parent, name=source.stem)


def parse_scenario(text: str, *, base_dir: str | Path = ".", name: str = "scenario") -> Scenario:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError("", f"not valid TOML: {exc}") from None
    return scenario_from_dict(data, base_dir=Path(base_dir), name=name)


def scenario_from_dict(data: dict[str, Any], *, base_dir: Path, name: str) -> Scenario:
    for key in data:
        if key not in _TOP_LEVEL:
            raise ScenarioError(key, f"unknown field (known: {', '.join(_TOP_LEVEL)})")
    sections: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        raw = data.get(section, {})
        if not isinstance(raw, dict):
            raise ScenarioError(section, f"must be a table, got {raw!r}")
        if section == "cost" and isinstance(raw.get("table"), str) and raw["table"]:
            raw = {**raw, "table": str(_resolve(raw["table"], base_dir))}
        sections[section] = _build(cls, raw, section)
    raw_phases = data.get("phases", [])
    if not isinstance(raw_phases, list):
        raise ScenarioError("phases", "must be an array of tables ([[phases]])")
    phases = []
    for index, raw in enumerate(raw_phases):
        where = f"phases[{index}]"
        if not isinstance(raw, dict):
            raise ScenarioError(where, f"must be a table, got {raw!r}")
        raw = dict(raw)
        if isinstance(raw.get("trace"), str):
            raw["trace"] = str(_resolve(raw["trace"], base_dir))
        phases.append(_build(PhaseConfig, raw, where))
    seed = data.get("seed", 1)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ScenarioError("seed", f"must be an integer, got {seed!r}")
    scenario_name = data.get("name", name)
    if not isinstance(scenario_name, str):
        raise ScenarioError("name", f"must be a string, got {scenario_name!r}")
    return Scenario(seed=seed, phases=tuple(phases), name=scenario_name, **sections)


def _resolve(path_text: str, base_dir: Path) -> Path:
    path = Path(path_text).expanduser()
    return path if path.is_absolute() else (base_dir / path).resolve()


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = [f.name for f in fields(cls)]
    values = {}
    for key, value in raw.items():
        if key not in known:
            raise ScenarioError(f"{where}.{key}", f"unknown field (known: {', '.join(known)})")
        values[key] = _coerce(f"{where}.{key}", value, hints[key])
    try:
        return cls(**values)
    except ScenarioError as exc:
        raise exc.under(where) from None


def _coerce(path: str, value: Any, hint: Any) -> Any:
    """Check `value` against a field's annotation; ints are accepted where floats are."""
    is_union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    options = typing.get_args(hint) if is_union else (hint,)
    options = tuple(o for o in options if o is not type(None))
    target = options[0]
    if typing.get_origin(target) is tuple:
        if not isinstance(value, list) or not all(_is_number(v) for v in value):
            raise ScenarioError(path, f"must be a list of numbers, got {value!r}")
        return tuple(float(v) for v in value)
    if target is bool:
        if not isinstance(value, bool):
            raise ScenarioError(path, f"must be true or false, got {value!r}")
        return value
    if target is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ScenarioError(path, f"must be an integer, got {value!r}")
        return value
    if target is float:
        if not _is_number(value):
            raise ScenarioError(path, f"must be a number, got {value!r}")
        return float(value)
    if target is str:
        if not isinstance(value, str):
            raise ScenarioError(path, f"must be a string, got {value!r}")
        return value
    raise ScenarioError(path, f"unsupported field type {hint!r}")  # a bug in the config types


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
