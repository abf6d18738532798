"""Is a Kafka bootstrap server there at all? A TCP check for command lines, before any
kafka-python client (whose own bootstrap retries take 30 s and end in a traceback). Plain
sockets: a command that only checks does not import kafka-python."""

from __future__ import annotations

import socket
from collections.abc import Sequence

CONNECT_TIMEOUT_S = 5.0
"""A command line's TCP check of one bootstrap server: a firewalled host fails in this long
instead of kafka-python's 30 s bootstrap retries."""


class KafkaUnreachable(ConnectionError):
    """No bootstrap server accepted a connection; the message names each and why."""


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
