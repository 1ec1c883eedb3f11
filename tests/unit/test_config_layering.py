"""A dataset section inherits every key it does not set from [defaults], table by table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from services.cli import app
from services.common.config import AuditThresholds, ConfigError, DatasetSettings, load_settings

# The new user's file of the issue: defaults for everything, a dataset that names one key.
NEW_USER = """
[provider]
mode = "chat"

[defaults]
profile = "deepseek-r1"
max_tokens = 64
mode = "completions"
cap_completion_tokens = 5000
cap_usd = 2.5

[defaults.audit]
require_reasoning = false
usage_offset = 1

[datasets.mt]
turns = "all"

[datasets.code]
max_tokens = 128

[datasets.code.audit]
usage_tolerance = 2
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "draftstream.toml"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("DRAFTSTREAM_"):
            monkeypatch.delenv(name)


@pytest.mark.usefixtures("no_env")
def test_a_dataset_naming_one_key_has_every_other_default(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, NEW_USER))
    mt = settings.dataset("mt")
    assert mt.turns == "all"
    assert mt.profile == "deepseek-r1"
    assert mt.max_tokens == 64
    assert mt.mode == "completions"
    assert settings.mode_of(mt) == "completions"
    assert mt.cap_completion_tokens == 5000
    assert mt.cap_usd == 2.5
    assert mt.audit.require_reasoning is False
    assert mt.audit.usage_offset == 1
    # Keys set nowhere keep the built-in default.
    assert mt.send_tools is DatasetSettings().send_tools
    assert mt.audit.require_stop is AuditThresholds().require_stop
    # The mapping itself holds effective settings (services read settings.datasets[name] too).
    assert settings.datasets["mt"] == mt


@pytest.mark.usefixtures("no_env")
def test_a_sub_table_overrides_key_by_key(tmp_path: Path) -> None:
    code = load_settings(write(tmp_path, NEW_USER)).dataset("code")
    assert code.max_tokens == 128
    assert code.profile == "deepseek-r1"
    assert code.audit.usage_tolerance == 2
    assert code.audit.require_reasoning is False  # [defaults.audit] under [datasets.code.audit]
    assert code.audit.usage_offset == 1


@pytest.mark.usefixtures("no_env")
def test_a_dataset_not_in_the_file_is_the_defaults(tmp_path: Path) -> None:
    settings = load_settings(write(tmp_path, NEW_USER))
    assert settings.dataset("elsewhere") == settings.defaults
    assert settings.dataset("elsewhere").max_tokens == 64


@pytest.mark.usefixtures("no_env")
def test_a_config_written_for_section_or_defaults_still_loads_with_its_values(tmp_path: Path) -> None:
    """A file whose dataset sections spell out what they need (no [defaults]) means what it meant."""
    old = '[datasets.math]\nprofile = "qwen3"\nmax_tokens = 2048\n[datasets.math.audit]\nusage_offset = 0\n'
    math = load_settings(write(tmp_path, old)).dataset("math")
    assert (math.profile, math.max_tokens, math.audit.usage_offset) == ("qwen3", 2048, 0)
    assert math.cap_completion_tokens == DatasetSettings().cap_completion_tokens


@pytest.mark.usefixtures("no_env")
def test_origins_name_dataset_defaults_env_provider_and_built_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRAFTSTREAM_DEFAULTS__SEND_TOOLS", "true")
    text = NEW_USER.replace('mode = "completions"\n', "")
    origins = load_settings(write(tmp_path, text)).dataset_origins("code")
    assert origins["max_tokens"] == (128, "dataset")
    assert origins["profile"] == ("deepseek-r1", "defaults")
    assert origins["audit.usage_tolerance"] == (2, "dataset")
    assert origins["audit.require_reasoning"] == (False, "defaults")
    assert origins["send_tools"] == (True, "env")
    assert origins["mode"] == ("chat", "provider")
    assert origins["audit.require_stop"] == (True, "built-in")


@pytest.mark.usefixtures("no_env")
def test_a_dataset_key_in_the_file_wins_over_a_defaults_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DRAFTSTREAM_DEFAULTS__MAX_TOKENS", "999")
    settings = load_settings(write(tmp_path, NEW_USER))
    assert settings.dataset("code").max_tokens == 128
    assert settings.dataset("mt").max_tokens == 999
    assert settings.dataset_origins("mt")["max_tokens"] == (999, "env")


@pytest.mark.parametrize(
    ("text", "section", "key"),
    [
        ("[defaults]\nmax_tokenz = 5\n[datasets.a]\n", "[defaults]", "max_tokenz"),
        ("[datasets.a]\nprofil = 'qwen3'\n", "[datasets.a]", "profil"),
        ("[defaults.audit]\nrequire_reasonin = false\n", "[defaults.audit]", "require_reasonin"),
        ("[datasets.a.audit]\nusage_ofset = 0\n", "[datasets.a.audit]", "usage_ofset"),
    ],
)
@pytest.mark.usefixtures("no_env")
def test_an_unknown_key_is_an_error_naming_key_and_section(tmp_path: Path, text: str, section: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, text))
    lines = [line for line in str(caught.value).splitlines() if key in line]
    assert lines == [f"{section} {key}: unknown key (not a setting of {section})"]


@pytest.mark.usefixtures("no_env")
def test_config_show_prints_effective_settings_with_origins(tmp_path: Path) -> None:
    path = write(tmp_path, NEW_USER)
    shown = CliRunner().invoke(app, ["config", "show", "-c", str(path)])
    assert shown.exit_code == 0, shown.output
    data = json.loads(shown.stdout)
    assert data["datasets"]["mt"]["max_tokens"] == 64
    assert data["datasets"]["mt"]["audit"]["require_reasoning"] is False
    assert data["origins"]["mt"]["max_tokens"] == "defaults"
    assert data["origins"]["mt"]["turns"] == "dataset"
    one = CliRunner().invoke(app, ["config", "show", "-c", str(path), "--dataset", "mt"])
    assert one.exit_code == 0, one.output
    lines = one.stdout.splitlines()
    assert lines[0] == "[datasets.mt]"
    assert 'profile = "deepseek-r1"  # defaults' in lines
    assert "max_tokens = 64  # defaults" in lines
    assert 'turns = "all"  # dataset' in lines
    assert "audit.require_reasoning = false  # defaults" in lines
    assert "audit.require_stop = true  # built-in" in lines
