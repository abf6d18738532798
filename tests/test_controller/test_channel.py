"""What the control service sends reaches the tables topic, in order, across an outage."""

from __future__ import annotations

import dataclasses
import time

from controller.fleet import channel as channel_module
from controller.fleet.channel import KafkaChannel
from controller.fleet.table_log import read_topic
from schemas import DraftTable, TableControl, TableKey, parse_table_message
from schemas.control import new_control_id
from tabletune.broker import free_port

KEY = TableKey("meta-llama/Llama-3.1-8B-Instruct", "eagle", "NVIDIA H100 80GB HBM3")


def control(action: str, k: int | None = None) -> TableControl:
    return TableControl(key=KEY, action=action, version=None,
                        issued_at="2098-12-31T23:30:00+00:00", control_id=new_control_id(),
                        table=None if k is None else DraftTable.from_vllm([[1, 64, k]]),
                        expires_at=None if k is None else "2099-01-01T00:00:00+00:00",
                        targets=("canary-1",))


def test_messages_sent_while_the_broker_is_down_arrive_in_order_later(topic_settings,
                                                                      monkeypatch):
    monkeypatch.setattr(channel_module, "RETRY_S", 0.0)
    down = dataclasses.replace(topic_settings, bootstrap_servers=(f"127.0.0.1:{free_port()}",))
    channel = KafkaChannel(down)
    started = time.monotonic()
    channel.send(control("force", 3))
    channel.send(control("force", 5))
    assert channel.unsent == 2 and channel.errors >= 1
    # each try gives up within seconds (kafka-python's own bootstrap wait was 30 s a try)
    assert time.monotonic() - started < 20.0
    channel.settings = topic_settings  # the broker is back
    channel.send(control("release"))
    assert channel.unsent == 0
    channel.close()
    sent = [parse_table_message(m.value) for m in read_topic(
        topic_settings, topic_settings.topics.tables, idle_polls=2, timeout_s=10)]
    assert [(m.action, m.table.to_vllm() if m.table else None) for m in sent] == [
        ("force", [[1, 64, 3]]), ("force", [[1, 64, 5]]), ("release", None)]
    assert all(m.key == KEY and m.targets == ("canary-1",) for m in sent)
