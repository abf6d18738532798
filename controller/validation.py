"""Why an engine refuses a table. Each check returns a reason an operator can act on."""

from __future__ import annotations

from dataclasses import dataclass

from controller.vllm_compat import check_with_vllm
from schemas import DraftTable, SignatureError, TableEnvelope, TableError, TableKey
from schemas.signing import Keyring


@dataclass(frozen=True, slots=True)
class EngineLimits:
    """What an engine can take: its key, its startup K set and its batch limit."""

    key: TableKey
    startup_k_values: frozenset[int]
    max_batch: int

    @property
    def max_k(self) -> int:
        return max(self.startup_k_values, default=0)


class Rejection(ValueError):
    """A table the engine will not apply; `reason` is a stable code for the status topic."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def check_envelope(envelope: TableEnvelope, limits: EngineLimits,
                   keyring: Keyring) -> None:
    """Raise `Rejection` unless the envelope is for this engine and safe to apply."""
    if envelope.key != limits.key:
        raise Rejection("wrong_key", f"table is for {envelope.key}, engine is {limits.key}")
    if keyring:
        try:
            envelope.verify(keyring)
        except SignatureError as exc:
            raise Rejection(exc.reason, str(exc)) from None
    check_table(envelope.table, limits)


def check_table(table: DraftTable, limits: EngineLimits) -> None:
    """Raise `Rejection` unless vLLM and the engine's limits accept `table`."""
    try:
        check_with_vllm(table)
        table.validate(limits.max_k, limits.max_batch)
    except TableError as exc:
        raise Rejection("invalid_table", str(exc)) from None
    outside = sorted(table.k_values - limits.startup_k_values)
    if outside:
        raise Rejection("k_not_in_startup_set",
                        f"K {outside} not in the engine's startup set "
                        f"{sorted(limits.startup_k_values)}")
