from __future__ import annotations

import pytest

from schemas.settings import ENV_VARS, Settings, SettingsError


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
        "TABLETUNE_SIGNING_SECRET": "s3cret",
        "TABLETUNE_VERIFY_KEYS": "2026-10:old",
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
    assert settings.keyring() == {"2026-11": b"s3cret", "2026-10": b"old"}
    assert "s3cret" not in repr(settings) and "pw" not in repr(settings)


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
        ({"TABLETUNE_VERIFY_KEYS": "k1"}, "'k1' is not id:secret"),
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
