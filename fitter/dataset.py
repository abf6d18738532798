"""The Parquet telemetry dataset the ingest job writes and the fitter reads.

Layout: `DIR/model=M/drafter=D/hardware=H/date=YYYY-MM-DD/hour=HH/<topic>-p<partition>-
<first offset>-<last offset>[-r<n>].parquet`. A file's name says which Kafka offsets it holds,
so a restarted ingest knows which files may already hold a record it reads again (see
ingest.py); it skips a record only when that file does hold it. Offsets are not identities:
a topic deleted and created again restarts at 0 under the same name, and the records it then
carries are new. A name that is taken (same offsets, other records) gets the next `-r<n>`.

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
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

IDENTITY_COLUMNS = ("model", "drafter", "hardware")
PARTITION_COLUMNS = (*IDENTITY_COLUMNS, "date", "hour")
SOURCE_PARTITION = "source_partition"
SOURCE_OFFSET = "source_offset"
_FILE_NAME = re.compile(r"^(?P<topic>.+)-p(?P<partition>\d+)-(?P<first>\d+)-(?P<last>\d+)"
                        r"(?:-r(?P<reuse>\d+))?\.parquet$")
RECORD_IDENTITY = ("engine_id", "step_seq", "ts_ns")
"""What makes a stored record the same record: ingest skips a record read again only if a
file already holds these three values."""


def hive_path(model: str, drafter: str, hardware: str, date: str, hour: int) -> str:
    return "/".join(f"{k}={escape(v)}" for k, v in (
        ("model", model), ("drafter", drafter), ("hardware", hardware), ("date", date),
        ("hour", f"{hour:02d}")))


def file_name(topic: str, partition: int, first_offset: int, last_offset: int,
              reuse: int = 0) -> str:
    """`reuse` > 0 names a second file of the same offsets (the topic's offsets restarted)."""
    suffix = f"-r{reuse}" if reuse else ""
    return f"{topic}-p{partition}-{first_offset:012d}-{last_offset:012d}{suffix}.parquet"


def offset_files(folder: str | os.PathLike[str], topic: str, partition: int
                 ) -> list[tuple[int, int, str]]:
    """(first offset, last offset, file name) of the files in `folder` that ingest wrote from
    `topic`'s `partition`, sorted; empty when the folder does not exist."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        match = _FILE_NAME.match(name)
        if match is not None and match["topic"] == topic \
                and int(match["partition"]) == partition:
            found.append((int(match["first"]), int(match["last"]), name))
    return sorted(found)


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
