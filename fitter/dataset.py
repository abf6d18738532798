"""The Parquet telemetry dataset the ingest job writes and the fitter reads.

Layout: `DIR/model=M/drafter=D/hardware=H/date=YYYY-MM-DD/hour=HH/<topic>-p<partition>-
<first offset>-<last offset>.parquet`. A file's name says which Kafka offsets it holds, so a
restarted ingest can tell exactly which records are already durable (see ingest.py).

Identity is never read back from the folder names: every file keeps its records' `model`,
`drafter` and `hardware` columns byte for byte, and the folders only sort the files. Their
values are percent-encoded (`meta-llama/Llama-3.1-8B` -> `meta-llama%2FLlama-3%2E1-8B`), which
`unescape` reverses; files of an older ingest, which kept identity only in the folder names
(then spelled lossily, `/` and spaces as `_`), get their columns from there.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import urllib.parse
from collections import defaultdict
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

IDENTITY_COLUMNS = ("model", "drafter", "hardware")
PARTITION_COLUMNS = (*IDENTITY_COLUMNS, "date", "hour")
SOURCE_PARTITION = "source_partition"
SOURCE_OFFSET = "source_offset"
_FILE_NAME = re.compile(r"^(?P<topic>.+)-p(?P<partition>\d+)-(?P<first>\d+)-(?P<last>\d+)\.parquet$")


def hive_path(model: str, drafter: str, hardware: str, date: str, hour: int) -> str:
    return "/".join(f"{k}={escape(v)}" for k, v in (
        ("model", model), ("drafter", drafter), ("hardware", hardware), ("date", date),
        ("hour", f"{hour:02d}")))


def file_name(topic: str, partition: int, first_offset: int, last_offset: int) -> str:
    return f"{topic}-p{partition}-{first_offset:012d}-{last_offset:012d}.parquet"


def covered_offsets(root: str | os.PathLike[str], topic: str
                    ) -> dict[tuple[int, str], list[tuple[int, int]]]:
    """Offset ranges already written, per (partition, hive directory), from file names."""
    coverage: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    base = Path(root)
    if not base.exists():
        return coverage
    for path in base.rglob("*.parquet"):
        match = _FILE_NAME.match(path.name)
        if match is None or match["topic"] != topic:
            continue
        directory = path.parent.relative_to(base).as_posix()
        coverage[(int(match["partition"]), directory)].append(
            (int(match["first"]), int(match["last"])))
    for ranges in coverage.values():
        ranges.sort()
    return coverage


def read_dataset(root: str | os.PathLike[str], *, since: dt.timedelta | None = None,
                 now: dt.datetime | None = None) -> pl.DataFrame:
    """All step records under `root`, deduplicated on (engine_id, step_seq).

    Dedupe is the second defence against duplicates (producer retries re-send frames).
    `since` keeps records whose ts_ns is within that window of `now` (UTC).
    """
    files = sorted(Path(root).rglob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"no Parquet telemetry under {root}")
    schemas = {path: tuple(pq.read_schema(path).names) for path in files}
    if len(set(schemas.values())) == 1 and set(IDENTITY_COLUMNS) <= set(schemas[files[0]]):
        frame = pl.scan_parquet([str(path) for path in files], hive_partitioning=False)
    else:  # files of two schema versions (a fleet mid-upgrade): each read alone, the
        # columns a version lacks (version 1: finished_requests) filled with nulls
        frame = pl.concat([_scan_one(path, names) for path, names in schemas.items()],
                          how="diagonal_relaxed")
    if since is not None:
        cutoff = (now or dt.datetime.now(dt.UTC)) - since
        frame = frame.filter(pl.col("ts_ns") >= int(cutoff.timestamp() * 1e9))
    return (frame.unique(subset=["engine_id", "step_seq"], keep="first", maintain_order=True)
            .sort(["engine_id", "step_seq"]).collect())


def escape(value: str) -> str:
    """A folder-safe, reversible spelling of a key field (`unescape` undoes it): percent-
    encoding of every byte but letters, digits and `_-~`, so `/`, spaces, `.` and `=` can
    neither nest folders nor read as another hive field."""
    return urllib.parse.quote(value, safe="").replace(".", "%2E") or "%00"


def unescape(text: str) -> str:
    """The key field `escape` spelled as `text`."""
    return "" if text == "%00" else urllib.parse.unquote(text, errors="strict")


def _scan_one(path: Path, names: tuple[str, ...]) -> pl.LazyFrame:
    """One file, with the identity columns an older ingest left only in its folders."""
    frame = pl.scan_parquet(str(path), hive_partitioning=False)
    folders = dict(part.split("=", 1) for part in path.parent.parts if "=" in part)
    missing = [name for name in IDENTITY_COLUMNS if name not in names]
    if missing and not set(missing) <= set(folders):
        raise ValueError(f"{path}: no {missing} column and no {missing} folder")
    return frame.with_columns(pl.lit(unescape(folders[name])).alias(name) for name in missing)
