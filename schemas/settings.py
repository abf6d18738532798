"""One settings object for every TableTune process, from `TABLETUNE_*` variables and flags.

Engine processes are constructed by vLLM, so they can only be configured through the
environment; command-line tools read the same variables and let flags override them.
Every variable TableTune reads is named in `ENV_VARS`, so docs and manifests can be checked
against it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from schemas.signing import KeyFormatError, is_placeholder, load_private_key, load_public_key

log = logging.getLogger(__name__)

ENV_VARS: dict[str, str] = {
    "TABLETUNE_BOOTSTRAP": "Kafka bootstrap servers, comma-separated host:port",
    "TABLETUNE_TOPIC_TELEMETRY": "telemetry topic (default tabletune.telemetry)",
    "TABLETUNE_TOPIC_TABLES": "tables topic (default tabletune.tables)",
    "TABLETUNE_TOPIC_STATUS": "controller status topic (default tabletune.status)",
    "TABLETUNE_TOPIC_DLQ": "dead-letter topic (default tabletune.dlq)",
    "TABLETUNE_TOPIC_OWNERSHIP": "control replicas' ownership topic, whose partitions share "
                                 "out the table keys (default tabletune.ownership)",
    "TABLETUNE_SECURITY_PROTOCOL": "PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL",
    "TABLETUNE_SASL_MECHANISM": "PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512 | OAUTHBEARER | GSSAPI",
    "TABLETUNE_SASL_USERNAME": "SASL username",
    "TABLETUNE_SASL_PASSWORD": "SASL password",
    "TABLETUNE_SSL_CAFILE": "CA bundle to verify the brokers",
    "TABLETUNE_SSL_CERTFILE": "client certificate (mutual TLS)",
    "TABLETUNE_SSL_KEYFILE": "client private key (mutual TLS)",
    "TABLETUNE_SSL_PASSWORD": "password of the client private key",
    "TABLETUNE_SIGNING_KEY_ID": "key id of TABLETUNE_SIGNING_KEY (control service, operators)",
    "TABLETUNE_SIGNING_KEY": "Ed25519 private key that signs tables and controls, base64 "
                             "(control service and operators only; `tabletune keygen`)",
    "TABLETUNE_VERIFY_KEYS": "Ed25519 public keys engines accept, id:base64[,id:base64] "
                             "(rotation: old and new)",
    "TABLETUNE_SINK": "engine telemetry sink: kafka://host:port[,host:port] or file:///dir",
    "TABLETUNE_ENGINE_ID": "engine identity in telemetry (default hostname-pid)",
    "TABLETUNE_HARDWARE": "hardware name in the table key (default: the device name)",
    "TABLETUNE_TABLE_KEY": "table key an engine follows (default model|drafter|hardware)",
    "TABLETUNE_EXPLORE_SHARE": "share of engine steps run at another K to learn, 0 to 0.5 "
                               "(default 0.02; 0: off)",
    "TABLETUNE_PROMPT_LOOKUP_MIN": "TableTune's n-gram proposer: shortest n-gram it matches "
                                   "(vLLM's prompt_lookup_min; default: the max, else 5)",
    "TABLETUNE_PROMPT_LOOKUP_MAX": "TableTune's n-gram proposer: longest n-gram it matches "
                                   "(vLLM's prompt_lookup_max; default: the min, else 5)",
    "TABLETUNE_METRICS_PORT": "serve Prometheus metrics on this port (engine and jobs)",
    "TABLETUNE_METRICS_ADDR": "address of the metrics endpoint, which has no authentication "
                              "(default 127.0.0.1; 0.0.0.0 where Prometheus scrapes the pod)",
}

SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")

CONSUMER_DEFAULTS: dict[str, Any] = {
    # Tansu makes a group join wait half the session timeout; 6 s is also valid on Kafka.
    "session_timeout_ms": 6000,
    "heartbeat_interval_ms": 1000,
}


RETIRED_VARS = {
    "TABLETUNE_SIGNING_SECRET": "an HMAC secret, no longer read: tables and controls are "
                                "signed with Ed25519; set TABLETUNE_SIGNING_KEY (a private key "
                                "from `tabletune keygen`) where tables are signed, and its "
                                "public key in the engines' TABLETUNE_VERIFY_KEYS",
}
"""Variables of earlier releases that would now be ignored: refused, saying what replaces
them, so that an upgrade cannot silently turn signing off."""


class SettingsError(ValueError):
    """A setting with a value TableTune cannot use; the message names the variable."""


@dataclass(frozen=True, slots=True)
class TopicNames:
    telemetry: str = "tabletune.telemetry"
    tables: str = "tabletune.tables"
    status: str = "tabletune.status"
    dlq: str = "tabletune.dlq"
    ownership: str = "tabletune.ownership"
    """No records: its partitions are the slots a control group shares out
    (`controller.fleet.ownership`)."""

    def __post_init__(self) -> None:
        for name in ("telemetry", "tables", "status", "dlq", "ownership"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise SettingsError(f"TABLETUNE_TOPIC_{name.upper()}={value!r}: a topic name "
                                    "must be a non-empty string")
        names = ("telemetry", "tables", "status", "dlq", "ownership")
        for i, name in enumerate(names):
            for other in names[i + 1:]:
                if getattr(self, name) == getattr(self, other):
                    raise SettingsError(
                        f"TABLETUNE_TOPIC_{name.upper()} and TABLETUNE_TOPIC_{other.upper()} "
                        f"are both {getattr(self, name)!r}: each topic needs its own name")


@dataclass(frozen=True, slots=True)
class KafkaSecurity:
    """Passed through to kafka-python as its own keyword arguments."""

    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_plain_username: str | None = None
    sasl_plain_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.security_protocol not in SECURITY_PROTOCOLS:
            raise SettingsError(
                f"TABLETUNE_SECURITY_PROTOCOL={self.security_protocol!r}: "
                f"expected one of {', '.join(SECURITY_PROTOCOLS)}"
            )
        uses_sasl = self.security_protocol.startswith("SASL")
        if uses_sasl and self.sasl_mechanism not in SASL_MECHANISMS:
            raise SettingsError(
                f"TABLETUNE_SASL_MECHANISM={self.sasl_mechanism!r} with "
                f"{self.security_protocol}: expected one of {', '.join(SASL_MECHANISMS)}"
            )

    def client_kwargs(self) -> dict[str, Any]:
        kwargs = {"security_protocol": self.security_protocol}
        for name in ("sasl_mechanism", "sasl_plain_username", "sasl_plain_password",
                     "ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_password"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs


@dataclass(frozen=True, slots=True)
class Settings:
    bootstrap_servers: tuple[str, ...] = ()
    topics: TopicNames = TopicNames()
    security: KafkaSecurity = KafkaSecurity()
    signing_key_id: str | None = None
    signing_key: Ed25519PrivateKey | None = field(default=None, repr=False)
    """Signs what this process publishes: the control service's and operators' only."""
    verify_keys: Mapping[str, Ed25519PublicKey] = field(default_factory=dict, repr=False)
    """Public keys accepted on incoming tables; the signing key's is always among them."""

    def __post_init__(self) -> None:
        if (self.signing_key_id is None) != (self.signing_key is None):
            raise SettingsError(
                "TABLETUNE_SIGNING_KEY_ID and TABLETUNE_SIGNING_KEY must be set together"
            )
        for server in self.bootstrap_servers:
            host, _, port = server.rpartition(":")
            if not host or not port.isdigit():
                raise SettingsError(f"bootstrap server {server!r} is not host:port")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        refuse_unusable(env)
        unknown = sorted(k for k in env if k.startswith("TABLETUNE_") and k not in ENV_VARS)
        if unknown:
            log.warning("ignoring unknown settings %s (known: see schemas.settings.ENV_VARS)",
                        ", ".join(unknown))
        default_topics = TopicNames()
        topics = TopicNames(
            telemetry=env.get("TABLETUNE_TOPIC_TELEMETRY", default_topics.telemetry),
            tables=env.get("TABLETUNE_TOPIC_TABLES", default_topics.tables),
            status=env.get("TABLETUNE_TOPIC_STATUS", default_topics.status),
            dlq=env.get("TABLETUNE_TOPIC_DLQ", default_topics.dlq),
            ownership=env.get("TABLETUNE_TOPIC_OWNERSHIP", default_topics.ownership),
        )
        security = KafkaSecurity(
            security_protocol=env.get("TABLETUNE_SECURITY_PROTOCOL", "PLAINTEXT"),
            sasl_mechanism=env.get("TABLETUNE_SASL_MECHANISM"),
            sasl_plain_username=env.get("TABLETUNE_SASL_USERNAME"),
            sasl_plain_password=env.get("TABLETUNE_SASL_PASSWORD"),
            ssl_cafile=env.get("TABLETUNE_SSL_CAFILE"),
            ssl_certfile=env.get("TABLETUNE_SSL_CERTFILE"),
            ssl_keyfile=env.get("TABLETUNE_SSL_KEYFILE"),
            ssl_password=env.get("TABLETUNE_SSL_PASSWORD"),
        )
        signing_key = env.get("TABLETUNE_SIGNING_KEY")
        return cls(
            bootstrap_servers=parse_bootstrap(env.get("TABLETUNE_BOOTSTRAP", "")),
            topics=topics,
            security=security,
            signing_key_id=env.get("TABLETUNE_SIGNING_KEY_ID"),
            signing_key=None if signing_key is None else _private_key(signing_key),
            verify_keys=parse_keyring(env.get("TABLETUNE_VERIFY_KEYS", "")),
        )

    def with_bootstrap(self, bootstrap: str | None) -> Settings:
        """A flag overrides the environment; None keeps what the environment said."""
        if bootstrap is None:
            return self
        return replace(self, bootstrap_servers=parse_bootstrap(bootstrap))

    def keyring(self) -> dict[str, Ed25519PublicKey]:
        """The public keys this process verifies with (its own signing key's included)."""
        ring = dict(self.verify_keys)
        if self.signing_key_id is not None and self.signing_key is not None:
            ring[self.signing_key_id] = self.signing_key.public_key()
        return ring

    def require_bootstrap(self) -> list[str]:
        if not self.bootstrap_servers:
            raise SettingsError("no Kafka brokers: pass --bootstrap or set TABLETUNE_BOOTSTRAP")
        return list(self.bootstrap_servers)

    def client_kwargs(self) -> dict[str, Any]:
        """Arguments shared by every kafka-python client."""
        return {"bootstrap_servers": self.require_bootstrap(), **self.security.client_kwargs()}

    def consumer_kwargs(self, **overrides: Any) -> dict[str, Any]:
        return {**self.client_kwargs(), **CONSUMER_DEFAULTS, **overrides}


def parse_bootstrap(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_keyring(text: str) -> dict[str, Ed25519PublicKey]:
    """TABLETUNE_VERIFY_KEYS: `id:public key[,id:public key]`, keys in base64 or hex."""
    ring: dict[str, Ed25519PublicKey] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key_id, sep, public = item.partition(":")
        if not sep or not key_id or not public:
            raise SettingsError(f"TABLETUNE_VERIFY_KEYS entry {key_id!r} is not id:public-key")
        try:
            ring[key_id] = load_public_key(public)
        except KeyFormatError as exc:
            raise SettingsError(f"TABLETUNE_VERIFY_KEYS entry {key_id!r}: {exc}") from None
    return ring


def refuse_unusable(env: Mapping[str, str]) -> None:
    """Raise SettingsError, naming the variable, for a retired one (RETIRED_VARS) or one that
    still holds an example manifest's `change-me...` placeholder (a password, a key)."""
    for name in sorted(env):
        if name in RETIRED_VARS:
            raise SettingsError(f"{name} is {RETIRED_VARS[name]}")
        if name.startswith("TABLETUNE_") and is_placeholder(env[name]):
            raise SettingsError(f"{name} holds a placeholder ('change-me...') from an example "
                                "manifest: set the real value")


def _private_key(text: str) -> Ed25519PrivateKey:
    try:
        return load_private_key(text)
    except KeyFormatError as exc:
        raise SettingsError(f"TABLETUNE_SIGNING_KEY: {exc}") from None
