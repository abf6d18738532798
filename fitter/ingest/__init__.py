"""Ingest: the telemetry topic into hive-partitioned Parquet, exactly-once in effect.

`ingestor.Ingestor` is the facade `tabletune ingest` runs; beside it its roles: the partition
store, the dead-letter writer, the rebalance listener and the batch-mode catch-up checks.
"""

from fitter.ingest.catch_up import IngestIncomplete, partition_bounds
from fitter.ingest.config import IngestConfig
from fitter.ingest.counters import IngestCounters
from fitter.ingest.ingestor import Ingestor, Stage

__all__ = ["IngestConfig", "IngestCounters", "IngestIncomplete", "Ingestor", "Stage",
           "partition_bounds"]
