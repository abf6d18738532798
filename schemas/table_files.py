"""Reading a table from a file: vLLM triples or a TableEnvelope, told apart by shape."""

from __future__ import annotations

import json
from pathlib import Path

from schemas import DraftTable, EnvelopeError, TableEnvelope, TableError


def load_table_file(path: str | Path) -> tuple[DraftTable, TableEnvelope | None]:
    """The table in FILE, and its envelope when the file holds one."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TableError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TableError(f"{path} is not JSON: {exc}") from None
    if isinstance(data, dict):
        try:
            envelope = TableEnvelope.from_dict(data)
        except EnvelopeError as exc:
            raise TableError(f"{path}: {exc}") from None
        return envelope.table, envelope
    return DraftTable.from_vllm(data), None
