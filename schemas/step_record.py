"""One engine step as TableTune sees it, and its Arrow schema.

A step record is the unit of telemetry: the fitter regresses step latency and acceptance
on these fields, so every field is measured on the engine, never derived downstream.
The Arrow schema below is the single source of truth for the column layout; the
`StepRecord` dataclass is its row view, for tests and small tools.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import pyarrow as pa

SCHEMA_VERSION = 3
"""Bump when a column changes meaning or type; readers refuse versions they do not know.
Version 2 added `finished_requests`, version 3 `by_match_length`; an earlier frame reads as
one with none of them."""

KNOWN_SCHEMA_VERSIONS = frozenset({1, 2, SCHEMA_VERSION})

REQUEST_SEGMENTS = 13
"""Segments of a request's generation: segment s holds the decode steps that started with
2^s to 2^(s+1) - 1 tokens generated (the last one, 4096 and more)."""

REQUEST_SEGMENT_TYPE = pa.struct(
    [
        pa.field("request", pa.int32(), nullable=False),
        pa.field("segment", pa.int8(), nullable=False),
        pa.field("decode_steps", pa.int32(), nullable=False),
        pa.field("drafting_steps", pa.int32(), nullable=False),
        pa.field("tokens", pa.int32(), nullable=False),
        pa.field("context_tokens", pa.int64(), nullable=False),
        pa.field("reached_per_pos", pa.list_(pa.int32()), nullable=False),
        pa.field("accepted_per_pos", pa.list_(pa.int32()), nullable=False),
    ]
)
"""One finished request's decode steps within one segment of its generation. `request`
numbers the requests of one step record (0, 1, ...) and groups their segments;
`reached_per_pos[i]` counts steps whose draft reached position i (all before it accepted),
`accepted_per_pos[i]` those that also accepted it; `tokens` counts what its decode steps
emitted (vLLM: as sampled, so a last step that ran past max_tokens or a stop string counts
what vLLM then trims) and `context_tokens` sums its context over them.

Why per request, by segment. In a closed loop a request holds its slot for as many steps as
it needs, so which requests (and which parts of them) a batch holds moves with K: under
n-gram a larger K drains the long, well-accepting requests faster and the batch's context
falls; under EAGLE it rises. Step records only show the batch that was; these sums let the
fitter weigh each request by the steps it would need at any K (`fitter.surface.context`).
Segments carry the trend within one request: acceptance grows with what has been generated
(magnitudes in docs/TUNING.md)."""

MATCH_LENGTH_TYPE = pa.struct(
    [
        pa.field("match_length", pa.int16(), nullable=False),
        pa.field("requests", pa.int32(), nullable=False),
        pa.field("draft_tokens", pa.int32(), nullable=False),
        pa.field("reached_per_pos", pa.list_(pa.int32()), nullable=False),
        pa.field("accepted_per_pos", pa.list_(pa.int32()), nullable=False),
    ]
)
"""This step's decode requests whose drafts came from an n-gram match of `match_length`
tokens (0: no match, so no drafts): how many, the drafts they verified, and per draft
position how many drafts reached it (all before it accepted) and how many also accepted it.
Acceptance by match length is what per-request budgets are fitted from
(`schemas.draft_budget`); drafters that report no match length leave the list empty."""

SCHEMA_VERSION_METADATA_KEY = b"tabletune.schema_version"

STEP_RECORD_SCHEMA = pa.schema(
    [
        pa.field("schema_version", pa.int16(), nullable=False),
        pa.field("engine_id", pa.string(), nullable=False),
        pa.field("model", pa.string(), nullable=False),
        pa.field("drafter", pa.string(), nullable=False),
        pa.field("hardware", pa.string(), nullable=False),
        pa.field("ts_ns", pa.int64(), nullable=False),
        pa.field("step_seq", pa.int64(), nullable=False),
        pa.field("batch_size", pa.int32(), nullable=False),
        pa.field("num_decode_reqs", pa.int32(), nullable=False),
        pa.field("num_prefill_reqs", pa.int32(), nullable=False),
        pa.field("num_prefill_tokens", pa.int32(), nullable=False),
        pa.field("k", pa.int16(), nullable=False),
        pa.field("k_next", pa.int16(), nullable=False),
        pa.field("table_version", pa.int64(), nullable=False),
        pa.field("num_drafts", pa.int32(), nullable=False),
        pa.field("num_draft_tokens", pa.int32(), nullable=False),
        pa.field("num_accepted_tokens", pa.int32(), nullable=False),
        pa.field("accepted_per_pos", pa.list_(pa.int32()), nullable=False),
        pa.field("kv_tokens", pa.int64(), nullable=False),
        pa.field("ctx_len_mean", pa.float64(), nullable=False),
        pa.field("ctx_len_max", pa.int32(), nullable=False),
        pa.field("step_latency_s", pa.float64(), nullable=False),
        pa.field("inter_step_s", pa.float64(), nullable=False),
        pa.field("forced", pa.bool_(), nullable=False),
        pa.field("finished_requests", pa.list_(REQUEST_SEGMENT_TYPE), nullable=False),
        pa.field("by_match_length", pa.list_(MATCH_LENGTH_TYPE), nullable=False),
    ],
    metadata={SCHEMA_VERSION_METADATA_KEY: str(SCHEMA_VERSION).encode()},
)
"""Column layout of a telemetry frame and of the fitter's Parquet files."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step (row view of `STEP_RECORD_SCHEMA`)."""

    engine_id: str
    model: str
    drafter: str
    hardware: str
    ts_ns: int
    """Wall clock at the start of the step (time.time_ns)."""
    step_seq: int
    """Per-engine, strictly increasing by 1: dedupe key with engine_id, and gap detector."""
    batch_size: int
    """Number of scheduled requests, prefills included: the index vLLM uses into its table."""
    num_decode_reqs: int
    num_prefill_reqs: int
    num_prefill_tokens: int
    k: int
    """Drafts verified this step (max over requests)."""
    k_next: int
    """K scheduled for the drafts proposed this step (the table lookup)."""
    table_version: int
    """Version of the active table; 0 = the startup table."""
    num_drafts: int
    """Requests that had drafts verified this step."""
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]
    """Unconditional counts: requests whose draft at position i (0-based) was accepted."""
    kv_tokens: int
    """Tokens in the KV cache of the scheduled requests."""
    ctx_len_mean: float
    ctx_len_max: int
    step_latency_s: float
    inter_step_s: float
    forced: bool = False
    """An exploration or profile step whose K was not the table's choice."""
    finished_requests: tuple[dict[str, object], ...] = ()
    """Requests that left the batch since the previous step, one `REQUEST_SEGMENT_TYPE`
    row per segment of their generation that had decode steps."""
    by_match_length: tuple[dict[str, object], ...] = ()
    """One `MATCH_LENGTH_TYPE` row per match length among this step's decode requests
    (n-gram drafters that report it; empty otherwise)."""
    schema_version: int = field(default=SCHEMA_VERSION)


STEP_RECORD_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(StepRecord))
assert set(STEP_RECORD_FIELDS) == set(STEP_RECORD_SCHEMA.names), "dataclass and schema drifted"


def records_to_table(records: list[StepRecord]) -> pa.Table:
    """Columnar view of a list of records, in `STEP_RECORD_SCHEMA` column order."""
    columns = {name: [getattr(r, name) for r in records] for name in STEP_RECORD_SCHEMA.names}
    columns["accepted_per_pos"] = [list(r.accepted_per_pos) for r in records]
    columns["finished_requests"] = [[dict(x) for x in r.finished_requests] for r in records]
    columns["by_match_length"] = [[dict(x) for x in r.by_match_length] for r in records]
    return pa.table(columns, schema=STEP_RECORD_SCHEMA)


def table_to_records(table: pa.Table) -> list[StepRecord]:
    """Row view of a step-record table (the inverse of `records_to_table`)."""
    out = []
    for row in table.select(list(STEP_RECORD_SCHEMA.names)).to_pylist():
        row["accepted_per_pos"] = tuple(row["accepted_per_pos"])
        row["finished_requests"] = tuple(row["finished_requests"])
        row["by_match_length"] = tuple(row["by_match_length"])
        out.append(StepRecord(**row))
    return out
