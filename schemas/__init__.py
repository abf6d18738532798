"""Contracts shared by producers, fitter and controller. Depends on nothing else of ours."""

from schemas.control import TableControl, parse_table_message
from schemas.draft_table import DraftTable, TableError
from schemas.envelope import (
    EnvelopeError,
    Signature,
    SignatureError,
    TableEnvelope,
    TableKey,
    canonical_json,
)
from schemas.frames import Frame, FrameError, decode_frame, encode_frame
from schemas.step_record import (
    SCHEMA_VERSION,
    STEP_RECORD_SCHEMA,
    StepRecord,
    records_to_table,
    table_to_records,
)

__all__ = [
    "SCHEMA_VERSION",
    "STEP_RECORD_SCHEMA",
    "DraftTable",
    "EnvelopeError",
    "Frame",
    "FrameError",
    "Signature",
    "SignatureError",
    "StepRecord",
    "TableControl",
    "TableEnvelope",
    "TableError",
    "TableKey",
    "canonical_json",
    "decode_frame",
    "encode_frame",
    "records_to_table",
    "parse_table_message",
    "table_to_records",
]
