"""Settings layering, validation messages and secret handling."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from services.common.config import ConfigError, check_dataset_name, load_settings
from services.common.logs import RedactingFilter, secrets_of


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "draftstream.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_toml_environment_and_overrides_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path, '[kafka]\ntopic_prefix = "x."\n[datasets.math]\nmax_tokens = 100\n')
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", "10.0.0.1:9092")
    monkeypatch.setenv("DRAFTSTREAM_PROVIDER__CONCURRENCY", "7")
    settings = load_settings(path, stage={"batch_max": 3})
    assert settings.kafka.bootstrap_servers == "10.0.0.1:9092"
    assert settings.kafka.topic("responses") == "x.responses"
    assert settings.kafka.prompts_topic("math") == "x.prompts.math"
    assert settings.provider.concurrency == 7
    assert settings.dataset("math").max_tokens == 100
    assert settings.dataset("other").max_tokens == settings.defaults.max_tokens
    assert settings.stage.batch_max == 3


def test_a_cap_that_is_not_positive_is_refused_naming_the_setting(tmp_path: Path) -> None:
    path = write(tmp_path, "[datasets.math]\ncap_completion_tokens = -5\n")
    with pytest.raises(ConfigError, match=r"datasets\.math\.cap_completion_tokens"):
        load_settings(path)


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(tmp_path / "nope.toml")


def test_secrets_in_the_file_are_refused(tmp_path: Path) -> None:
    path = write(tmp_path, '[provider]\napi_key = "sk-or-123"\n')
    with pytest.raises(ConfigError, match="DRAFTSTREAM_PROVIDER__API_KEY"):
        load_settings(path)


def test_secrets_from_the_environment_are_masked_when_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-v1-SECRETSECRET")
    settings = load_settings(None)
    assert settings.provider.api_key is not None
    assert settings.provider.api_key.get_secret_value() == "sk-or-v1-SECRETSECRET"
    assert "SECRETSECRET" not in repr(settings)
    assert "SECRETSECRET" not in str(settings.redacted())


def test_log_lines_never_carry_a_secret(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("OPENROUTER_API_KEY", "sk-or-v1-SECRETSECRET")
    settings = load_settings(None)
    logger = logging.getLogger("test.redaction")
    logger.addFilter(RedactingFilter(secrets_of(settings)))
    with caplog.at_level(logging.INFO, logger="test.redaction"):
        logger.info("calling with key %s", "sk-or-v1-SECRETSECRET")
    assert caplog.records
    assert "SECRETSECRET" not in caplog.text
    assert "**********" in caplog.text


@pytest.mark.parametrize("name", ["math", "tool-use_v2.1"])
def test_valid_dataset_names(name: str) -> None:
    assert check_dataset_name(name) == name


@pytest.mark.parametrize("name", ["", "has space", "a/b", "..", "x" * 201, "ünï"])
def test_dataset_names_that_cannot_be_topics_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="cannot be a topic name"):
        check_dataset_name(name)


def test_the_global_scope_cannot_be_a_dataset_name() -> None:
    with pytest.raises(ConfigError, match="reserved"):
        check_dataset_name("global")
