from __future__ import annotations

import pytest

from schemas.settings import ENV_VARS, Settings, SettingsError
from schemas.signing import (
    generate_private_key,
    load_private_key,
    load_public_key,
    private_key_text,
    public_key_text,
)

SIGNING = generate_private_key()
OLD = generate_private_key()


def test_defaults_and_env():
    settings = Settings.from_env({
        "TABLETUNE_BOOTSTRAP": "k1:9092, k2:9093",
        "TABLETUNE_TOPIC_TABLES": "tt.tables",
        "TABLETUNE_SECURITY_PROTOCOL": "SASL_SSL",
        "TABLETUNE_SASL_MECHANISM": "SCRAM-SHA-512",
        "TABLETUNE_SASL_USERNAME": "svc",
        "TABLETUNE_SASL_PASSWORD": "pw",
        "TABLETUNE_SSL_CAFILE": "/etc/ca.pem",
        "TABLETUNE_SIGNING_KEY_ID": "2026-11",
        "TABLETUNE_SIGNING_KEY": private_key_text(SIGNING),
        "TABLETUNE_VERIFY_KEYS": f"2026-10:{public_key_text(OLD)}",
    })
    assert settings.topics.tables == "tt.tables"
    assert settings.topics.telemetry == "tabletune.telemetry"
    kwargs = settings.consumer_kwargs(group_id="g")
    assert kwargs["bootstrap_servers"] == ["k1:9092", "k2:9093"]
    assert kwargs["security_protocol"] == "SASL_SSL"
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kwargs["sasl_plain_password"] == "pw"
    assert kwargs["ssl_cafile"] == "/etc/ca.pem"
    assert kwargs["session_timeout_ms"] == 6000 and kwargs["group_id"] == "g"
    assert {k: public_key_text(v) for k, v in settings.keyring().items()} == {
        "2026-11": public_key_text(SIGNING), "2026-10": public_key_text(OLD)}
    assert private_key_text(SIGNING) not in repr(settings) and "pw" not in repr(settings)


def test_an_engine_holds_public_keys_only():
    """Engines get TABLETUNE_VERIFY_KEYS alone: they verify, and have nothing to sign with."""
    engine = Settings.from_env({"TABLETUNE_VERIFY_KEYS": f"2026-11:{public_key_text(SIGNING)},"
                                                         f"2026-10:{public_key_text(OLD)}"})
    assert engine.signing_key is None and engine.signing_key_id is None
    assert set(engine.keyring()) == {"2026-11", "2026-10"}
    base64_text = public_key_text(SIGNING)
    raw = load_public_key(base64_text).public_bytes_raw()
    assert public_key_text(load_public_key(raw.hex())) == base64_text  # hex is read too
    assert private_key_text(load_private_key(private_key_text(SIGNING))) == \
        private_key_text(SIGNING)


def test_flag_overrides_env():
    settings = Settings.from_env({"TABLETUNE_BOOTSTRAP": "a:1"}).with_bootstrap("b:2")
    assert settings.bootstrap_servers == ("b:2",)
    assert Settings.from_env({"TABLETUNE_BOOTSTRAP": "a:1"}).with_bootstrap(None) \
        .bootstrap_servers == ("a:1",)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TABLETUNE_SECURITY_PROTOCOL": "TLS"}, "TABLETUNE_SECURITY_PROTOCOL='TLS'"),
        ({"TABLETUNE_SECURITY_PROTOCOL": "SASL_SSL"}, "TABLETUNE_SASL_MECHANISM=None"),
        ({"TABLETUNE_SIGNING_KEY_ID": "k"}, "must be set together"),
        ({"TABLETUNE_BOOTSTRAP": "localhost"}, "'localhost' is not host:port"),
        ({"TABLETUNE_VERIFY_KEYS": "k1"}, "'k1' is not id:public-key"),
        ({"TABLETUNE_TOPIC_TELEMETRY": ""}, "TABLETUNE_TOPIC_TELEMETRY='': a topic name"),
        ({"TABLETUNE_TOPIC_DLQ": " "}, "TABLETUNE_TOPIC_DLQ=' '"),
        ({"TABLETUNE_TOPIC_STATUS": "tabletune.telemetry"},
         "TABLETUNE_TOPIC_TELEMETRY and TABLETUNE_TOPIC_STATUS are both 'tabletune.telemetry'"),
        ({"TABLETUNE_VERIFY_KEYS": "k1:old-hmac-secret"},
         "TABLETUNE_VERIFY_KEYS entry 'k1': not an Ed25519 public key"),
        ({"TABLETUNE_SIGNING_KEY_ID": "k", "TABLETUNE_SIGNING_KEY": "c2VjcmV0"},
         "TABLETUNE_SIGNING_KEY: not an Ed25519 private key"),
        ({"TABLETUNE_SIGNING_KEY_ID": "k", "TABLETUNE_SIGNING_SECRET": "s3cret"},
         "TABLETUNE_SIGNING_SECRET is an HMAC secret, no longer read: .* set "
         "TABLETUNE_SIGNING_KEY"),
    ],
)
def test_bad_settings_name_the_variable(env, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(env)


def test_missing_bootstrap_says_how_to_set_it():
    with pytest.raises(SettingsError, match="--bootstrap or set TABLETUNE_BOOTSTRAP"):
        Settings.from_env({}).client_kwargs()


def test_unknown_variable_is_warned(caplog):
    Settings.from_env({"TABLETUNE_BOOTSTRAPP": "a:1"})
    assert "TABLETUNE_BOOTSTRAPP" in caplog.text
    assert "TABLETUNE_SINK" in ENV_VARS


@pytest.mark.parametrize("name", ["TABLETUNE_SIGNING_KEY", "TABLETUNE_VERIFY_KEYS",
                                  "TABLETUNE_SASL_PASSWORD", "TABLETUNE_SSL_PASSWORD"])
def test_a_placeholder_secret_is_refused_naming_the_variable(name):
    """deploy/k8s/secret.yaml and deploy/compose/.env.example hold `change-me...`: a process
    started with one refuses to start instead of signing with (or trusting) it."""
    value = {"TABLETUNE_VERIFY_KEYS": f"2026-11:{public_key_text(SIGNING)},2026-12:change-me"}
    env = {"TABLETUNE_SIGNING_KEY_ID": "k", "TABLETUNE_SIGNING_KEY": private_key_text(SIGNING),
           name: value.get(name, "change-me-to-32-random-bytes")}
    with pytest.raises(SettingsError, match=f"^{name} holds a placeholder") as refused:
        Settings.from_env(env)
    assert "\n" not in str(refused.value)
