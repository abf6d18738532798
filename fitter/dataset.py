"""The Parquet telemetry dataset the ingest job writes and the fitter reads.

Layout: `DIR/model=M/drafter=D/hardware=H/date=YYYY-MM-DD/hour=HH/<topic>-p<partition>-
<first offset>-<last offset>[-r<n>].parquet`. A file's name says which Kafka offsets it holds,
so a restarted ingest knows which files may already hold a record it reads again (see
partition_store.py); it skips a record only when that file does hold it. Offsets are not
identities: a topic deleted and created again restarts at 0 under the same name, and the
records it then carries are new. A name that is taken (same offsets, other records) gets
the next `-r<n>`.

Identity is never read back from the folder names: every file keeps its records' `model`,
`drafter` and `hardware` columns byte for byte, and the folders only sort the files. Their
values are percent-encoded (`meta-llama/Llama-3.1-8B` -> `meta-llama%2FLlama-3%2E1-8B`), which
`unescape` reverses; files of an older ingest, which kept identity only in the folder names
(then spelled lossily, `/` and spaces as `_`), get their columns from there.

A file that is not readable Parquet, or not step records (a column missing or of another
kind), is skipped with a warning and listed (`Dataset.skipped`), or refused by name with
`strict`: one corrupt or foreign file must neither stop a fit of all the others nor feed it
nulls ("cannot convert float NaN to integer").

Copies of one step (engine_id, step_seq) are read as `fitter.step_conflicts` says: identical
ones once, differing ones not at all, counted (`Dataset.conflicts`) and logged. Which file
sorts first then decides nothing.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from fitter.step_conflicts import StepConflicts, drop_conflicts
from schemas import STEP_RECORD_SCHEMA

log = logging.getLogger(__name__)

IDENTITY_COLUMNS = ("model", "drafter", "hardware")
SOURCE_PARTITION = "source_partition"
SOURCE_OFFSET = "source_offset"
_FILE_NAME = re.compile(r"^(?P<topic>.+)-p(?P<partition>\d+)-(?P<first>\d+)-(?P<last>\d+)"
                        r"(?:-r(?P<reuse>\d+))?\.parquet$")
RECORD_IDENTITY = ("engine_id", "step_seq", "ts_ns")
"""What makes a stored record the same record: ingest skips a record read again only if a
file already holds these three values."""
OPTIONAL_COLUMNS = ("finished_requests", "by_match_length")
"""Step-record columns a file may lack: earlier schema versions predate them."""


class DatasetError(ValueError):
    """A Parquet file the fit cannot use, refused under `strict`; or no usable file at all."""


@dataclass(frozen=True, slots=True)
class SkippedFile:
    path: Path
    reason: str

    def to_dict(self) -> dict[str, str]:
        return {"path": str(self.path), "reason": self.reason}


@dataclass(frozen=True, slots=True)
class Dataset:
    records: pl.DataFrame
    skipped: tuple[SkippedFile, ...] = ()
    """Files left out, each with why (not Parquet, not step records)."""
    conflicts: StepConflicts = field(default_factory=StepConflicts)
    """Steps stored in two or more different records: every copy left out."""


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
    """All step records under `root`, one per (engine_id, step_seq), none of a step stored
    in two different records; files that are not telemetry are skipped with a warning
    (`load_dataset` lists them, and the conflicting steps)."""
    return load_dataset(root, since=since, now=now).records


def load_dataset(root: str | os.PathLike[str], *, since: dt.timedelta | None = None,
                 now: dt.datetime | None = None, strict: bool = False) -> Dataset:
    """All step records under `root`, one per (engine_id, step_seq), and what was left out:
    files, and steps stored in two different records (`fitter.step_conflicts`); with
    `strict`, DatasetError names the first file that is not telemetry.

    Dropping exact copies is the second defence against duplicates (producer retries re-send
    frames). `since` keeps records whose ts_ns is within that window of `now` (UTC);
    conflicts are found among those.
    """
    files = sorted(Path(root).rglob("*.parquet"))
    if not files:
        raise FileNotFoundError(f"no Parquet telemetry under {root}")
    columns: dict[Path, tuple[str, ...]] = {}
    skipped: list[SkippedFile] = []
    for path in files:
        names, problem = _check_file(path)
        if problem is None:
            columns[path] = names
        else:
            skipped.append(_skip(path, problem, strict=strict))
    try:
        records = _read(columns, since, now, root, skipped)
    except (pl.exceptions.PolarsError, OSError) as exc:
        # a footer that reads over pages that do not: find those files by reading each alone
        broken = [(path, problem) for path in columns
                  if (problem := _unreadable(path)) is not None]
        if not broken:
            raise DatasetError(f"cannot read the telemetry under {root}: {exc}") from None
        for path, problem in broken:
            skipped.append(_skip(path, problem, strict=strict))
            del columns[path]
        records = _read(columns, since, now, root, skipped)
    for file in skipped:
        log.warning("skipped %s: %s", file.path, file.reason)
    records, conflicts = drop_conflicts(records)
    if len(conflicts):
        log.warning("left out %d steps stored in two or more different records (%d rows), "
                    "by engine id: %s", len(conflicts), conflicts.records,
                    conflicts.to_dict()["engines"])
    return Dataset(records.sort(["engine_id", "step_seq"]), tuple(skipped), conflicts)


def _check_file(path: Path) -> tuple[tuple[str, ...], str | None]:
    """(its column names, None) for a Parquet file of step records, else ((), why not)."""
    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as exc:
        return (), f"not a readable Parquet file ({exc})"
    folders = _folders(path)
    missing = [field.name for field in STEP_RECORD_SCHEMA
               if field.name not in schema.names and field.name not in OPTIONAL_COLUMNS
               and not (field.name in IDENTITY_COLUMNS and field.name in folders)]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        plural = "s" if len(missing) > 1 else ""
        return (), f"not step records: no {', '.join(missing[:3])}{more} column{plural}"
    wrong = [f"{field.name} is {schema.field(field.name).type}, not {field.type}"
             for field in STEP_RECORD_SCHEMA
             if field.name in schema.names
             and _kind(schema.field(field.name).type) != _kind(field.type)]
    if wrong:
        return (), f"not step records: {'; '.join(wrong)}"
    return tuple(schema.names), None


def _kind(type_: pa.DataType) -> str:
    """What a column holds, loosely: a wider integer or a large string is the same kind."""
    for kind, test in (("integer", pa.types.is_integer), ("float", pa.types.is_floating),
                       ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
                       ("boolean", pa.types.is_boolean),
                       ("list", lambda t: pa.types.is_list(t) or pa.types.is_large_list(t))):
        if test(type_):
            return kind
    return str(type_)


def _unreadable(path: Path) -> str | None:
    """Why `path` cannot be read whole, or None when it can."""
    try:
        pl.read_parquet(path, hive_partitioning=False)
    except (pl.exceptions.PolarsError, OSError) as exc:
        return f"not a readable Parquet file ({' '.join(str(exc).split())})"
    return None


def _skip(path: Path, problem: str, *, strict: bool) -> SkippedFile:
    if strict:
        raise DatasetError(f"{path}: {problem}")
    return SkippedFile(path, problem)


def _read(columns: dict[Path, tuple[str, ...]], since: dt.timedelta | None,
          now: dt.datetime | None, root: str | os.PathLike[str],
          skipped: list[SkippedFile]) -> pl.DataFrame:
    files = list(columns)
    if not files:
        raise DatasetError(f"no telemetry under {root}: every Parquet file was skipped "
                           f"({len(skipped)}; {skipped[0].path}: {skipped[0].reason})")
    if len(set(columns.values())) == 1 and set(IDENTITY_COLUMNS) <= set(columns[files[0]]):
        frame = pl.scan_parquet([str(path) for path in files], hive_partitioning=False)
    else:  # files of two schema versions (a fleet mid-upgrade): each read alone, the
        # columns a version lacks (version 1: finished_requests) filled with nulls
        frame = pl.concat([_scan_one(path, names) for path, names in columns.items()],
                          how="diagonal_relaxed")
    if since is not None:
        cutoff = (now or dt.datetime.now(dt.UTC)) - since
        frame = frame.filter(pl.col("ts_ns") >= int(cutoff.timestamp() * 1e9))
    return frame.collect()


def escape(value: str) -> str:
    """A folder-safe, reversible spelling of a key field (`unescape` undoes it): percent-
    encoding of every byte but letters, digits and `_-~`, so `/`, spaces, `.` and `=` can
    neither nest folders nor read as another hive field."""
    return urllib.parse.quote(value, safe="").replace(".", "%2E") or "%00"


def unescape(text: str) -> str:
    """The key field `escape` spelled as `text`."""
    return "" if text == "%00" else urllib.parse.unquote(text, errors="strict")


def _scan_one(path: Path, names: tuple[str, ...]) -> pl.LazyFrame:
    """One file, with the identity columns an older ingest left only in its folders
    (`_check_file` made sure they are there)."""
    frame = pl.scan_parquet(str(path), hive_partitioning=False)
    folders = _folders(path)
    missing = [name for name in IDENTITY_COLUMNS if name not in names]
    return frame.with_columns(pl.lit(unescape(folders[name])).alias(name) for name in missing)


def _folders(path: Path) -> dict[str, str]:
    """The hive fields of `path`'s folders (`model=...`), as spelled on disk."""
    return dict(part.split("=", 1) for part in path.parent.parts if "=" in part)
