"""Measured step latencies as the twin's cost model: a grid read from CSV, interpolated.

Columns `batched_tokens,kv_tokens,k,latency_s`: the whole step (verify, drafting and the
engine's own overhead) that verifies `batched_tokens` tokens over `kv_tokens` of context and
proposes `k` drafts per request. Between grid points the latency is linear in `kv_tokens` and,
in `batched_tokens`, that of the next grid point up: a CUDA-graph step pads its batch to the
next capture size, so a grid that holds the capture sizes reproduces the staircase.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

COLUMNS = ("batched_tokens", "kv_tokens", "k", "latency_s")
MAX_TABLE_BYTES = 8 * 1024 * 1024
"""Read bound: a 4-column grid of a million points is ~30 MB; real grids are a few thousand."""


class LatencyTableError(ValueError):
    """A malformed latency table; the message names the file, the line and the column."""


@dataclass(frozen=True, slots=True)
class LatencyTable:
    """A rectangular grid: every (batched_tokens, kv_tokens) point for every k."""

    batched: tuple[int, ...]
    """Grid points in batched tokens, ascending."""
    kv: tuple[int, ...]
    """Grid points in context tokens, ascending."""
    ks: tuple[int, ...]
    """Draft lengths with rows, ascending from 0 without gaps."""
    latency_s: tuple[tuple[tuple[float, ...], ...], ...]
    """latency_s[k][i][j]: the step at batched[i], kv[j] proposing k drafts."""
    source: str = ""

    @property
    def max_k(self) -> int:
        return self.ks[-1]

    def step_s(self, kv_tokens: float, batched_tokens: float, k_next: int) -> float:
        """Noise-free latency of a step (the grid's k must include `k_next`).

        Past the largest batched point the last two points' slope continues (a step above
        the largest capture size runs eager: give that region its own grid points); past
        the largest context likewise. Below the smallest point of either axis the first
        point's latency holds."""
        batched, plane = self.batched, self.latency_s[k_next]
        last_b = len(batched) - 1
        i = bisect.bisect_left(batched, batched_tokens)
        if i <= last_b:
            return self._along_kv(plane[i], kv_tokens)
        top = self._along_kv(plane[last_b], kv_tokens)
        if last_b == 0:
            return top
        below = self._along_kv(plane[last_b - 1], kv_tokens)
        slope = (top - below) / (batched[last_b] - batched[last_b - 1])
        return top + max(0.0, slope) * (batched_tokens - batched[last_b])

    def _along_kv(self, row: tuple[float, ...], kv_tokens: float) -> float:
        kv = self.kv
        last_kv = len(kv) - 1
        if last_kv == 0 or kv_tokens <= kv[0]:
            return row[0]
        j = min(bisect.bisect_left(kv, kv_tokens), last_kv)
        lo, hi = kv[j - 1], kv[j]
        return row[j - 1] + (row[j] - row[j - 1]) * (kv_tokens - lo) / (hi - lo)

    def step_fn(self) -> Callable[[float, float, int], float]:
        """`step_s`, as the engine takes its cost model's step time."""
        return self.step_s


def load_latency_table(path: str | Path) -> LatencyTable:
    """Read and check a latency CSV; every error names the line and, where one, the column."""
    source = Path(path)
    try:
        size = source.stat().st_size
        if size > MAX_TABLE_BYTES:
            raise LatencyTableError(f"{source}: {size} bytes, more than the "
                                    f"{MAX_TABLE_BYTES} a latency table may have")
        raw = source.read_bytes()
    except OSError as exc:
        raise LatencyTableError(f"cannot read latency table {source}: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise LatencyTableError(f"{source}: not a UTF-8 text file (byte {exc.start})") from None
    return parse_latency_table(text, source=str(source))


def parse_latency_table(text: str, *, source: str = "<table>") -> LatencyTable:
    lines = text.splitlines()
    rows = [(number, line) for number, line in enumerate(lines, start=1)
            if line.strip() and not line.lstrip().startswith("#")]
    if not rows:
        raise LatencyTableError(f"{source}: empty (header {','.join(COLUMNS)} and rows needed)")
    header_line, header = rows[0]
    names = [name.strip() for name in header.split(",")]
    if sorted(names) != sorted(COLUMNS) or len(names) != len(COLUMNS):
        raise LatencyTableError(f"{source} line {header_line}: header must name the columns "
                                f"{','.join(COLUMNS)} (any order), got {header.strip()!r}")
    position = {name: names.index(name) for name in COLUMNS}
    points: dict[tuple[int, int, int], tuple[float, int]] = {}
    for number, line in rows[1:]:
        fields = [value.strip() for value in line.split(",")]
        if len(fields) != len(COLUMNS):
            raise LatencyTableError(f"{source} line {number}: {len(fields)} fields, the header "
                                    f"has {len(COLUMNS)}")
        batched = _whole(fields[position["batched_tokens"]], source, number, "batched_tokens", 1)
        kv = _whole(fields[position["kv_tokens"]], source, number, "kv_tokens", 0)
        k = _whole(fields[position["k"]], source, number, "k", 0)
        latency = _seconds(fields[position["latency_s"]], source, number)
        key = (k, batched, kv)
        if key in points:
            raise LatencyTableError(f"{source} line {number}: batched_tokens={batched}, "
                                    f"kv_tokens={kv}, k={k} is already on line {points[key][1]}")
        points[key] = (latency, number)
    if not points:
        raise LatencyTableError(f"{source}: a header but no rows")
    return _grid(points, source)


def _grid(points: dict[tuple[int, int, int], tuple[float, int]], source: str) -> LatencyTable:
    ks = sorted({k for k, _, _ in points})
    batched = sorted({b for _, b, _ in points})
    kv = sorted({c for _, _, c in points})
    missing_k = [k for k in range(ks[-1] + 1) if k not in ks]
    if missing_k:
        raise LatencyTableError(f"{source}: no rows for k={missing_k[0]} (every k from 0 to the "
                                f"largest, {ks[-1]}, needs the full grid)")
    planes = []
    for k in ks:
        plane = []
        for b in batched:
            row = []
            for c in kv:
                if (k, b, c) not in points:
                    raise LatencyTableError(
                        f"{source}: no row for batched_tokens={b}, kv_tokens={c}, k={k} (the "
                        f"grid must hold every batched_tokens x kv_tokens point for each k)")
                row.append(points[(k, b, c)][0])
            plane.append(tuple(row))
        planes.append(tuple(plane))
    return LatencyTable(batched=tuple(batched), kv=tuple(kv), ks=tuple(ks),
                        latency_s=tuple(planes), source=source)


def _whole(text: str, source: str, line: int, column: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise LatencyTableError(f"{source} line {line}, column {column}: {text!r} is not a "
                                "whole number") from None
    if value < minimum:
        raise LatencyTableError(f"{source} line {line}, column {column}: must be >= {minimum}, "
                                f"got {value}")
    return value


def _seconds(text: str, source: str, line: int) -> float:
    try:
        value = float(text)
    except ValueError:
        raise LatencyTableError(f"{source} line {line}, column latency_s: {text!r} is not a "
                                "number") from None
    if not math.isfinite(value) or value <= 0.0 or value > 60.0:
        raise LatencyTableError(f"{source} line {line}, column latency_s: must be a step time "
                                f"in seconds, > 0 and <= 60, got {text!r}")
    return value


def write_latency_table(table: LatencyTable, path: str | Path) -> None:
    """The CSV `load_latency_table` reads back (for generated and measured grids)."""
    lines = [",".join(COLUMNS)]
    for k, plane in zip(table.ks, table.latency_s, strict=True):
        for b, row in zip(table.batched, plane, strict=True):
            lines.extend(f"{b},{c},{k},{latency:.9g}" for c, latency in zip(table.kv, row,
                                                                             strict=True))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
