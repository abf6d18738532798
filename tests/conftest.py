"""Shared fixtures: a real Kafka-protocol broker for the whole session, uuid-named topics."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A random-weight Llama and tokenizer built offline once per session."""
    from tabletune.tiny_models import build_tiny_llama

    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))
