"""What every Kafka client of ours shares: a bounded close of a producer, and a reachability
check for command lines.

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
import socket
from collections.abc import Sequence

from kafka import KafkaProducer
from kafka.errors import KafkaError

log = logging.getLogger(__name__)

FORCED_CLOSE_S = 2.0
"""How long a forced close waits for the I/O thread to fail what is pending and exit; it is
woken at once, so this bounds a stuck thread, it is not a wait."""
CONNECT_TIMEOUT_S = 5.0
"""A command line's TCP check of one bootstrap server: a firewalled host fails in this long
instead of kafka-python's 30 s bootstrap retries."""


class KafkaUnreachable(ConnectionError):
    """No bootstrap server accepted a connection; the message names each and why."""


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


def check_reachable(servers: Sequence[str], timeout_s: float = CONNECT_TIMEOUT_S) -> str:
    """The first of `servers` (host:port) that accepts a TCP connection.

    For command lines, before any kafka-python client: a dead bootstrap then fails at once
    (refused) or within `timeout_s` per server, naming each, instead of after 30 s of
    retries with a traceback. KafkaUnreachable when none answers."""
    problems = []
    for server in servers:
        host, _, port = server.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return server
        except TimeoutError:
            problems.append(f"{server} (no answer within {timeout_s:g} s)")
        except socket.gaierror as exc:
            problems.append(f"{server} (cannot resolve {host}: {exc.strerror})")
        except OSError as exc:
            problems.append(f"{server} ({exc.strerror or exc})")
    raise KafkaUnreachable("cannot reach Kafka at " + ", ".join(problems)
                           + ": check --bootstrap or TABLETUNE_BOOTSTRAP")
