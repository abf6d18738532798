"""Shared fixtures: a real Kafka-protocol broker for the whole session, uuid-named topics,
and SpecDecode-Bench-shaped traces."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from controller.fleet.ownership_config import SLOTS
from controller.fleet.table_log import TABLES_TOPIC_CONFIG
from schemas.settings import Settings, TopicNames
from tabletune.broker import EmbeddedBroker
from tests.synthetic_traces import PROFILES, write_traces

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "specdecode-bench"
"""The benchmark's own traces, beside the repository on some machines only."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "shared_traces: runs on ../shared's SpecDecode-Bench "
                                       "traces when they are there, else on generated ones")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the markers added here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that starts a vLLM engine is marked `vllm` and `alone`: `make test` runs
    those alone, after the rest, since a real engine's timing is part of what they check (a
    second test on the two cores slowed a cold profile past its phase). The rest run on
    several workers (`--dist loadgroup`), a module's tests on one, so that its module
    fixtures start once."""
    for item in items:
        if "tiny_model_dir" in item.fixturenames:
            for marker in ("vllm", "alone"):
                if item.get_closest_marker(marker) is None:
                    item.add_marker(marker)
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    """One Tansu broker per test session with TableTune's topics; stopped by PID at the end."""
    embedded = EmbeddedBroker()
    embedded.start()
    try:
        yield embedded
    finally:
        embedded.stop()


@pytest.fixture
def unique_name() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def topic_settings(broker: EmbeddedBroker, unique_name: str) -> Settings:
    """Settings for the session's broker with this test's own five topics, created."""
    names = TopicNames(telemetry=f"{unique_name}.telemetry", tables=f"{unique_name}.tables",
                       status=f"{unique_name}.status", dlq=f"{unique_name}.dlq",
                       ownership=f"{unique_name}.ownership")
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(names.telemetry, 4, 1), NewTopic(names.ownership, SLOTS, 1),
                         NewTopic(names.tables, 1, 1, topic_configs=dict(TABLES_TOPIC_CONFIG)),
                         NewTopic(names.status, 1, 1), NewTopic(names.dlq, 1, 1)])
    admin.close()
    return Settings(bootstrap_servers=(broker.bootstrap,), topics=names)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random-weight Llama and tokenizer built offline once per session."""
    from tabletune.tiny_models import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def generated_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sharegpt/gsm8k/instructcoder.jsonl shaped like SpecDecode-Bench's, from a fixed seed:
    what a test needing trace data reads, with or without ../shared."""
    return write_traces(tmp_path_factory.mktemp("specdecode-bench"), seed=0)


@pytest.fixture
def shared_or_generated_traces(request: pytest.FixtureRequest, generated_traces: Path) -> Path:
    """The shared traces when all are there, else the generated ones; only for tests marked
    `shared_traces`, so a reader knows which tests see other data on other machines."""
    if request.node.get_closest_marker("shared_traces") is None:
        pytest.fail("a test that reads the shared traces must be marked shared_traces")
    if all((SHARED_TRACES / f"{name}.jsonl").is_file() for name in PROFILES):
        return SHARED_TRACES
    return generated_traces
