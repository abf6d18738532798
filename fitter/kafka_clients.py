"""A bounded close of a kafka-python producer, which every producer of ours uses.

kafka-python (2.2 and 3.x alike) flushes inside `KafkaProducer.close(timeout)` and, when
records are still pending at the timeout (the broker is down), raises KafkaTimeoutError
before it stops its I/O thread. The thread then goes on reconnecting, and the garbage
collector's `__del__` tries the close again and prints `Exception ignored in ...
KafkaProducer.__del__ ... KafkaTimeoutError` to stderr: one traceback in an engine's log per
broker outage, and one leaked thread. `close_producer` fails what is pending instead, and
always stops the thread.
"""

from __future__ import annotations

import logging

from kafka import KafkaProducer
from kafka.errors import KafkaError

log = logging.getLogger(__name__)

NEVER_BLOCK_BOOTSTRAP_MS = 2000
"""`bootstrap_timeout_ms` of the producers that must not hold their caller (the telemetry
sink, the status publisher, the control service's tables channel): kafka-python's 30 s
default made creating one stall 30 s per try while the broker was down."""

FORCED_CLOSE_S = 2.0
"""How long a forced close waits for the I/O thread to fail what is pending and exit; it is
woken at once, so this bounds a stuck thread, it is not a wait."""


def close_producer(producer: KafkaProducer, timeout_s: float) -> bool:
    """Close `producer`, delivering what is pending within `timeout_s`; past that, fail the
    rest (their errbacks run, so callers can keep the messages) and stop its I/O thread.
    True when nothing had to be failed. Never raises for a broker problem."""
    try:
        producer.close(timeout=timeout_s)
        return True
    except KafkaError as exc:
        log.debug("producer close within %.1f s failed (%s): failing what is pending",
                  timeout_s, exc)
    # No public call closes without the flush; forcing the sender is what close() itself
    # does once a graceful close has run out of time. Its records fail, so the second
    # close's flush finds nothing pending and marks the producer closed (no __del__ retry).
    sender = producer._sender
    sender.force_close()
    sender.join(FORCED_CLOSE_S)
    try:
        producer.close(timeout=0)
    except KafkaError:
        log.warning("producer I/O thread did not stop within %.1f s", FORCED_CLOSE_S)
    return False
