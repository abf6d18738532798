"""Semantic checks of step records: what the Arrow schema cannot say.

`decode_frame` guarantees columns and types; these checks guarantee values a fitter can
trust: ranges, finiteness, and the relations between counts that every engine's arithmetic
keeps (accepted <= drafted <= drafts x K). They run over a whole table at once (numpy over
Arrow buffers, no per-row Python), because ingest checks every frame it reads.

Each row is charged to the first check it fails, in the order below, so a reason names one
field. A check whose columns are absent is skipped (the fitter also screens partial
tables); a decoded frame always has them all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from schemas.draft_budget import MAX_MATCH_LENGTHS
from schemas.envelope import MAX_BATCH_SIZE, MAX_K, MAX_NAME_CHARS
from schemas.step_record import KNOWN_SCHEMA_VERSIONS, REQUEST_SEGMENTS

MIN_TS_NS = 1_577_836_800 * 10**9
"""2020-01-01 UTC: TableTune postdates it, so an earlier stamp is an unset clock (1970) or a
forgery (1823)."""
MAX_FUTURE_S = 86_400.0
"""A day ahead of the reader's clock: skewed clocks and wrong time zones are still data, 2262
is not (and every bad hour would open a Parquet folder of its own)."""
MAX_STEP_LATENCY_S = 60.0
"""No engine step takes a minute (a long prefill chunk takes seconds): slower is a stalled
clock or a forgery, and one such step outweighs hours of honest ones in a time share."""

_SAMPLES = 3


@dataclass(frozen=True, slots=True)
class Violation:
    """The rows charged to one check."""

    field: str
    """The column the check is about (its first column, for a relation)."""
    rule: str
    rows: np.ndarray
    """Row indices, ascending."""
    values: np.ndarray | None
    """The field's values at `rows` (None for list columns)."""

    @property
    def reason(self) -> str:
        """Stable machine-readable code: `invalid_<field>`."""
        return f"invalid_{self.field}"

    @property
    def detail(self) -> str:
        shown = ""
        if self.values is not None and len(self.values):
            examples = (v.item() if isinstance(v, np.generic) else v
                        for v in self.values[:_SAMPLES])
            shown = f" (e.g. {', '.join(map(repr, examples))})"
        return f"{self.field} {self.rule}: {len(self.rows)} rows{shown}"

    def subset(self, positions: np.ndarray) -> Violation:
        """The same violation for `rows[positions]` only."""
        return Violation(self.field, self.rule, self.rows[positions],
                         None if self.values is None else self.values[positions])


@dataclass(frozen=True, slots=True)
class StepChecks:
    """Which rows of a table passed, and why the others did not."""

    valid: np.ndarray
    """Boolean mask over the rows."""
    violations: tuple[Violation, ...]

    @property
    def ok(self) -> bool:
        return not self.violations


def check_steps(records: pa.Table | pa.RecordBatch, *, now_ns: int | None,
                max_future_s: float = MAX_FUTURE_S) -> StepChecks:
    """Check every row of `records`. `now_ns` is the reader's wall clock, for the timestamp
    window (`MIN_TS_NS` to `max_future_s` after it); None skips that check (a fit on
    telemetry time has no wall clock to trust)."""
    table = records if isinstance(records, pa.Table) else pa.Table.from_batches([records])
    n = table.num_rows
    valid = np.ones(n, dtype=bool)
    violations = []
    for name, rule, bad, values in _checks(_Columns(table), now_ns, max_future_s):
        charged = bad & valid
        if not charged.any():
            continue
        rows = np.flatnonzero(charged)
        valid &= ~charged
        violations.append(Violation(name, rule, rows, None if values is None else values[rows]))
    return StepChecks(valid, tuple(violations))


class _Columns:
    """numpy views of a table's columns, made once each."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table
        self._names = frozenset(table.column_names)
        self._cache: dict[str, np.ndarray] = {}

    def has(self, *names: str) -> bool:
        return self._names.issuperset(names)

    def __getitem__(self, name: str) -> np.ndarray:
        values = self._cache.get(name)
        if values is None:
            values = self._cache[name] = self.table.column(name).to_numpy()
        return values

    def chars(self, name: str) -> np.ndarray:
        column = self.table.column(name)
        if not pa.types.is_string(column.type):
            column = column.cast(pa.string())
        return pc.utf8_length(column).to_numpy()

    def flat(self, name: str) -> tuple[pa.Array, np.ndarray, np.ndarray]:
        """(the list column's values, each value's row, each row's length)."""
        column = self.table.column(name).combine_chunks()
        if pa.types.is_large_list(column.type) or pa.types.is_list_view(column.type):
            column = column.cast(pa.list_(column.type.value_type))
        return (column.flatten(), pc.list_parent_indices(column).to_numpy(),
                pc.list_value_length(column).to_numpy())


_Check = tuple[str, str, np.ndarray, np.ndarray | None]


def _checks(c: _Columns, now_ns: int | None, max_future_s: float) -> Iterator[_Check]:
    n = c.table.num_rows

    def rows_of(parents: np.ndarray, bad: np.ndarray) -> np.ndarray:
        mask = np.zeros(n, dtype=bool)
        mask[parents[bad]] = True
        return mask

    def ranged(name: str, low: float, high: float | None = None) -> Iterator[_Check]:
        if c.has(name):
            values = c[name]
            bad = values < low if high is None else (values < low) | (values > high)
            rule = f"must be >= {low:g}" if high is None else f"must be within {low:g}..{high:g}"
            yield name, rule, bad, values

    if c.has("schema_version"):
        known = sorted(KNOWN_SCHEMA_VERSIONS)
        yield ("schema_version", f"must be one of {known}", ~np.isin(c["schema_version"], known),
               c["schema_version"])
    for name in ("engine_id", "model", "drafter", "hardware"):
        if c.has(name):
            chars = c.chars(name)
            yield (name, f"must be 1..{MAX_NAME_CHARS} characters",
                   (chars < 1) | (chars > MAX_NAME_CHARS), None)
    if now_ns is not None and c.has("ts_ns"):
        latest = now_ns + int(max_future_s * 1e9)
        ts = c["ts_ns"]
        yield ("ts_ns", f"must be within {MIN_TS_NS} (2020-01-01) and {latest} (the reader's "
               f"clock + {max_future_s:g} s)", (ts < MIN_TS_NS) | (ts > latest), ts)
    yield from ranged("step_seq", 0)
    yield from ranged("batch_size", 0, MAX_BATCH_SIZE)
    for name in ("num_decode_reqs", "num_prefill_reqs", "num_prefill_tokens"):
        yield from ranged(name, 0)
    yield from ranged("k", 0, MAX_K)
    yield from ranged("k_next", 0, MAX_K)
    yield from ranged("table_version", 0)
    yield from ranged("num_drafts", 0)
    yield from ranged("num_draft_tokens", 0)
    if c.has("num_draft_tokens", "num_drafts", "k"):
        drafted = c["num_draft_tokens"].astype(np.int64)
        yield ("num_draft_tokens", "must be <= num_drafts * k",
               drafted > c["num_drafts"].astype(np.int64) * c["k"], drafted)
    yield from ranged("num_accepted_tokens", 0)
    if c.has("num_accepted_tokens", "num_draft_tokens"):
        accepted = c["num_accepted_tokens"]
        yield ("num_accepted_tokens", "must be <= num_draft_tokens",
               accepted > c["num_draft_tokens"], accepted)
    if c.has("accepted_per_pos", "num_drafts"):
        values, parents, lengths = c.flat("accepted_per_pos")
        counts = values.to_numpy(zero_copy_only=False)
        bad = rows_of(parents, (counts < 0) | (counts > c["num_drafts"][parents]))
        yield ("accepted_per_pos", f"must hold at most {MAX_K} counts, each within "
               "0..num_drafts", bad | (lengths > MAX_K), None)
    yield from ranged("kv_tokens", 0)
    yield from _finite("ctx_len_mean", c, lambda v: v >= 0, "must be finite and >= 0")
    yield from ranged("ctx_len_max", 0)
    yield from _finite("step_latency_s", c, lambda v: (v > 0) & (v <= MAX_STEP_LATENCY_S),
                       f"must be finite, > 0 and <= {MAX_STEP_LATENCY_S:g} s")
    yield from _finite("inter_step_s", c, lambda v: v >= 0, "must be finite and >= 0")
    if c.has("finished_requests"):
        segments, parents, _ = c.flat("finished_requests")
        bad = _nulls(segments)
        if len(segments):
            segment = _ints(segments, "segment", bad)
            bad |= (segment < 0) | (segment >= REQUEST_SEGMENTS)
            for name in ("request", "decode_steps", "drafting_steps", "tokens",
                         "context_tokens"):
                bad |= _ints(segments, name, bad) < 0
        yield ("finished_requests", f"must have segments within 0..{REQUEST_SEGMENTS - 1} "
               "and counts >= 0", rows_of(parents, bad), None)
    if c.has("by_match_length", "num_decode_reqs"):
        parts, parents, _ = c.flat("by_match_length")
        decode = c["num_decode_reqs"].astype(np.int64)
        bad = _bad_match_lengths(parts, parents, decode) if len(parts) else np.zeros(0, bool)
        yield ("by_match_length", f"must have match lengths within 0..{MAX_MATCH_LENGTHS}, "
               "requests adding up to at most num_decode_reqs, at most "
               f"{MAX_K} drafts each, and per position at most {MAX_K} counts with "
               "0 <= accepted <= reached <= requests", rows_of(parents, bad), None)


def _nulls(structs: pa.Array) -> np.ndarray:
    """Entries that are null themselves (their fields say nothing)."""
    return structs.is_null().to_numpy(zero_copy_only=False).copy()


def _ints(structs: pa.StructArray, name: str, bad: np.ndarray) -> np.ndarray:
    """A struct field as int64; a null value marks its entry in `bad` (and reads as 0)."""
    column = structs.field(name)
    bad |= column.is_null().to_numpy(zero_copy_only=False)
    return pc.fill_null(column, 0).to_numpy(zero_copy_only=False).astype(np.int64)


def _bad_match_lengths(parts: pa.StructArray, parents: np.ndarray,
                       decode: np.ndarray) -> np.ndarray:
    """Per `by_match_length` entry: whether it breaks a bound (see `_checks`); a step whose
    entries' requests add up to more than its decode requests has all of them charged."""
    bad = _nulls(parts)
    length = _ints(parts, "match_length", bad)
    requests = _ints(parts, "requests", bad)
    drafts = _ints(parts, "draft_tokens", bad)
    bad |= (length < 0) | (length > MAX_MATCH_LENGTHS) | (requests < 0)
    bad |= (drafts < 0) | (drafts > requests * MAX_K)
    total = np.bincount(parents, weights=np.maximum(requests, 0), minlength=len(decode))
    bad |= total[parents] > decode[parents]
    reached, accepted = parts.field("reached_per_pos"), parts.field("accepted_per_pos")
    sizes = []
    for column in (reached, accepted):
        bad |= column.is_null().to_numpy(zero_copy_only=False)
        sizes.append(pc.fill_null(pc.list_value_length(column), 0)
                     .to_numpy(zero_copy_only=False))
    bad |= (sizes[0] != sizes[1]) | (sizes[0] > MAX_K)
    aligned = np.flatnonzero(~bad)  # equal lengths: their values pair up one to one
    if len(aligned):
        index = pa.array(aligned)
        pairs = [pc.fill_null(column.take(index).flatten(), -1).to_numpy(zero_copy_only=False)
                 .astype(np.int64) for column in (reached, accepted)]
        owner = aligned[pc.list_parent_indices(reached.take(index)).to_numpy()]
        wrong = ((pairs[1] < 0) | (pairs[1] > pairs[0])
                 | (pairs[0] > requests[owner]))
        bad[owner[wrong]] = True
    return bad


def _finite(name: str, c: _Columns, within: Callable[[np.ndarray], np.ndarray],
            rule: str) -> Iterator[_Check]:
    if c.has(name):
        values = c[name]
        with np.errstate(invalid="ignore"):
            bad = ~(np.isfinite(values) & within(values))
        yield name, rule, bad, values
