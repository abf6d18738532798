"""Shared fixtures: a real Kafka-protocol broker for the whole session, uuid-named topics."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from schemas.settings import Settings, TopicNames
from tabletune.broker import EmbeddedBroker

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


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
    """Settings for the session's broker with this test's own four topics, created."""
    names = TopicNames(telemetry=f"{unique_name}.telemetry", tables=f"{unique_name}.tables",
                       status=f"{unique_name}.status", dlq=f"{unique_name}.dlq")
    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
    admin.create_topics([NewTopic(names.telemetry, 4, 1), NewTopic(names.tables, 1, 1),
                         NewTopic(names.status, 1, 1), NewTopic(names.dlq, 1, 1)])
    admin.close()
    return Settings(bootstrap_servers=(broker.bootstrap,), topics=names)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random-weight Llama and tokenizer built offline once per session."""
    from tabletune.tiny_models import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
