"""Reading a table from a file: vLLM triples or a TableEnvelope, told apart by shape."""

from __future__ import annotations

import json
from pathlib import Path

from schemas import DraftTable, EnvelopeError, TableEnvelope, TableError

MAX_TABLE_FILE_BYTES = 16 << 20
"""A table file past this is not a table (an envelope, indented, is a few MB at most):
refused before it is read, so a wrong path (a dataset, an image) cannot fill memory."""


def load_table_file(path: str | Path) -> tuple[DraftTable, TableEnvelope | None]:
    """The table in FILE, and its envelope when the file holds one; TableError naming the
    file and the problem otherwise (unreadable, too large, not UTF-8 JSON, not a table)."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_TABLE_FILE_BYTES:
            raise TableError(f"{path} is {size} bytes, larger than a table file can be "
                             f"({MAX_TABLE_FILE_BYTES})")
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TableError(f"cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TableError(f"{path} is not a JSON text file (byte {exc.start} is not "
                         "UTF-8)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TableError(f"{path} is not JSON: {exc}") from None
    except RecursionError:
        raise TableError(f"{path} is not a table: its JSON nests deeper than the parser "
                         "goes") from None
    if isinstance(data, dict):
        try:
            envelope = TableEnvelope.from_dict(data)
        except EnvelopeError as exc:
            raise TableError(f"{path}: {exc}") from None
        return envelope.table, envelope
    return DraftTable.from_vllm(data), None
