"""Hypothesis strategies for the schema types."""

from __future__ import annotations

from hypothesis import strategies as st

from schemas import DraftTable, StepRecord

_int32 = st.integers(min_value=0, max_value=2**31 - 1)
_text = st.text(min_size=1, max_size=20)


@st.composite
def finished_requests(draw: st.DrawFn) -> tuple[dict[str, object], ...]:
    """`REQUEST_SEGMENT_TYPE` rows of 0-3 requests."""
    rows = []
    for request in range(draw(st.integers(min_value=0, max_value=3))):
        positions = draw(st.integers(min_value=1, max_value=7))
        for segment in sorted(draw(st.sets(st.integers(min_value=0, max_value=12),
                                           min_size=1, max_size=3))):
            rows.append({
                "request": request, "segment": segment,
                "decode_steps": draw(_int32), "drafting_steps": draw(_int32),
                "tokens": draw(_int32), "context_tokens": draw(st.integers(0, 2**50)),
                "reached_per_pos": draw(st.lists(_int32, min_size=positions,
                                                 max_size=positions)),
                "accepted_per_pos": draw(st.lists(_int32, min_size=positions,
                                                  max_size=positions)),
            })
    return tuple(rows)


@st.composite
def step_records(draw: st.DrawFn, engine_id: str | None = None, n: int | None = None,
                 ) -> list[StepRecord]:
    count = n if n is not None else draw(st.integers(min_value=1, max_value=30))
    engine = engine_id or draw(_text)
    model, drafter, hardware = draw(_text), draw(_text), draw(_text)
    first_seq = draw(st.integers(min_value=0, max_value=2**40))
    records = []
    for i in range(count):
        k = draw(st.integers(min_value=0, max_value=7))
        accepted = draw(st.lists(st.integers(min_value=0, max_value=512), min_size=k, max_size=k))
        records.append(StepRecord(
            engine_id=engine, model=model, drafter=drafter, hardware=hardware,
            ts_ns=draw(st.integers(min_value=0, max_value=2**62)),
            step_seq=first_seq + i,
            batch_size=draw(st.integers(min_value=1, max_value=1024)),
            num_decode_reqs=draw(_int32), num_prefill_reqs=draw(_int32),
            num_prefill_tokens=draw(_int32), k=k,
            k_next=draw(st.integers(min_value=0, max_value=7)),
            table_version=draw(st.integers(min_value=0, max_value=2**40)),
            num_drafts=draw(_int32), num_draft_tokens=draw(_int32),
            num_accepted_tokens=draw(_int32), accepted_per_pos=tuple(accepted),
            kv_tokens=draw(st.integers(min_value=0, max_value=2**40)),
            ctx_len_mean=draw(st.floats(min_value=0, max_value=1e6, allow_nan=False)),
            ctx_len_max=draw(_int32),
            step_latency_s=draw(st.floats(min_value=0, max_value=10, allow_nan=False)),
            inter_step_s=draw(st.floats(min_value=0, max_value=10, allow_nan=False)),
            forced=draw(st.booleans()),
            finished_requests=draw(finished_requests()),
        ))
    return records


@st.composite
def draft_tables(draw: st.DrawFn, max_k: int = 7, max_batch: int | None = None) -> DraftTable:
    """Valid gap-free tables covering 1..max_batch."""
    last = max_batch or draw(st.integers(min_value=1, max_value=512))
    cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=max(1, last - 1)),
                               max_size=min(8, last - 1))) if last > 1 else [])
    bounds = [0, *[c for c in cuts if c < last], last]
    ranges = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        if hi > lo:
            ranges.append((lo + 1, hi, draw(st.integers(min_value=0, max_value=max_k))))
    return DraftTable(tuple(ranges))


def sample_records(n: int, engine_id: str = "e1", first_seq: int = 0) -> list[StepRecord]:
    """Deterministic records for tests that need data, not search."""
    return [
        StepRecord(
            engine_id=engine_id, model="m", drafter="ngram", hardware="cpu",
            ts_ns=1_700_000_000_000_000_000 + i * 1000, step_seq=first_seq + i,
            batch_size=1 + i % 64, num_decode_reqs=1 + i % 60, num_prefill_reqs=i % 4,
            num_prefill_tokens=(i % 4) * 100, k=i % 6, k_next=(i + 1) % 6, table_version=0,
            num_drafts=i % 60, num_draft_tokens=(i % 60) * (i % 6),
            num_accepted_tokens=(i % 60) * (i % 6) // 2,
            accepted_per_pos=tuple(range(i % 6, 0, -1)), kv_tokens=1000 + 37 * i,
            ctx_len_mean=100.0 + i, ctx_len_max=200 + i, step_latency_s=0.01 + i * 1e-5,
            inter_step_s=0.011, forced=i % 50 == 0,
        )
        for i in range(n)
    ]
