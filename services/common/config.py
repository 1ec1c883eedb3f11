"""Settings: one TOML file layered under the environment, read in one place.

Precedence, highest first: constructor arguments, environment variables
(``DRAFTSTREAM_<SECTION>__<FIELD>``, plus the conventional ``KAFKA_BOOTSTRAP_SERVERS``
and ``OPENROUTER_API_KEY``), the TOML file (``--config``, else ``draftstream.toml`` when
present), then the defaults below. A ``[datasets.NAME]`` section inherits every key it does
not set from ``[defaults]``, table by table (services/common/layering.py). Secrets are
``SecretStr``: they print as ``**********`` and can only come from the environment (a
secret in the TOML file is refused).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from schemas import GLOBAL_SCOPE, topology
from services.common.layering import Origin, inherit, leaf_keys, origin_of

DEFAULT_CONFIG_FILE = "draftstream.toml"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

_frozen = ConfigDict(frozen=True, extra="forbid")


class ConfigError(ValueError):
    """The configuration is unusable; the message names the setting."""


class KafkaSettings(BaseModel):
    """How every service and the CLI reach Kafka (plaintext, SASL and/or TLS)."""

    model_config = _frozen

    bootstrap_servers: str = "127.0.0.1:9092"
    topic_prefix: str = ""
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_check_hostname: bool = True
    # A 200k-token sample with its prompt and response is several MiB of JSON.
    max_message_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    # zstd: a smaller batch than gzip at a fraction of its CPU in every producer (aiokafka
    # compresses through cramjam; the broker keeps the producer's codec).
    compression_type: Literal["gzip", "lz4", "zstd", "snappy"] | None = "zstd"
    partitions: int = Field(default=3, gt=0)
    # Unset, topics are created with the replication the cluster affords (3 on three or more
    # brokers, else one per broker; see cluster_replication_factor); set, it is an override.
    replication_factor: int = Field(default=1, gt=0)
    # A consumer that stops heartbeating (a SIGKILLed worker) keeps its partitions this long
    # before the group hands them to the others. The broker refuses a value below its
    # group.min.session.timeout.ms (6 s by default).
    session_timeout_s: float = Field(default=10.0, ge=1.0)

    @property
    def explicit_replication_factor(self) -> int | None:
        """``replication_factor`` when the configuration sets it, else None (ask the cluster)."""
        return self.replication_factor if "replication_factor" in self.model_fields_set else None

    def topic(self, name: str) -> str:
        """The physical name of a logical topic (see schemas.topology)."""
        return f"{self.topic_prefix}{name}"

    def group(self, name: str) -> str:
        """The physical id of a logical consumer group: the prefix namespaces a deployment's groups too."""
        return f"{self.topic_prefix}{name}"

    def prompts_topic(self, dataset: str) -> str:
        """The physical topic of one dataset's prompts."""
        return self.topic(topology.prompts_topic(dataset))

    @property
    def topics(self) -> dict[str, str]:
        """Logical to physical names of the fixed topics."""
        return {n: self.topic(n) for n in topology.fixed_topics()}


class ProviderSettings(BaseModel):
    """The inference provider and how hard to drive it."""

    model_config = _frozen

    kind: Literal["simulator", "openrouter", "openai", "sglang"] = "simulator"
    # What this provider is called in halts (scope ``provider:<name>``), budget and status
    # figures and rows' ``provider_name``. A ``[providers.NAME]`` section is named NAME; "":
    # the kind (a single ``[provider]``).
    name: str = ""
    # "completions": the prompt is rendered with the dataset profile's template (tools in the
    # model's native format) and sent as text to POST <base_url>/completions; the answer is the
    # model's raw text, with no reasoning or tool parser in between. A dataset may override it.
    mode: Literal["chat", "completions"] = "chat"
    base_url: str = "http://127.0.0.1:8099/api/v1"  # where `draftstream simulate-provider` answers
    model: str = "qwen/qwen3-8b"
    api_key: SecretStr | None = None
    concurrency: int = Field(default=256, gt=0, le=20_000)
    timeout_s: float = Field(default=120.0, gt=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    max_attempts: int = Field(default=4, ge=1, le=50)
    backoff_initial_s: float = Field(default=0.5, ge=0)
    backoff_max_s: float = Field(default=30.0, ge=0)
    max_prompt_chars: int = Field(default=2_000_000, gt=0)
    # Passed through verbatim in the request body (e.g. {"reasoning": {"effort": "high"},
    # "provider": {"order": ["x"], "require_parameters": true}}).
    extra_body: dict[str, Any] = Field(default_factory=dict)
    request_logprobs: bool = False
    # What the provider's text loses (services/profiles/conventions.py); None: by kind.
    convention: Literal["vllm", "sglang", "sglang-legacy", "openrouter"] | None = None
    # Consecutive connection errors, timeouts, 5xx or 404s (no success between them) that
    # make an outage: this provider's workers halt (scope provider:<name>) and hand their
    # partitions to the others instead of dead-lettering prompts.
    outage_after: int = Field(default=8, ge=1, le=100_000)
    # While an outage halt stands, the provider is checked this often; it resumes itself.
    probe_interval_s: float = Field(default=5.0, gt=0)
    # A 429 storm in which nothing gets through for this long halts this provider's workers
    # (scope provider:<name>, a reason naming the rate limit); the probe resumes once admitted.
    rate_limit_stall_s: float = Field(default=60.0, gt=0)
    # Optional ceilings below the provider's own limits (aiolimiter leaky buckets, per worker).
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    # The metrics port of this provider's worker (``run inference --provider NAME``), so that two
    # workers on one host do not share one; ``status`` reads each. None: [metrics] inference_port.
    metrics_port: int | None = Field(default=None, ge=0, le=65535)

    @property
    def label(self) -> str:
        """The provider's name: ``name``, else its kind."""
        return self.name or self.kind


class InferenceSettings(BaseModel):
    """How the inference worker stops, reports and reuses what was paid for."""

    model_config = _frozen

    # On SIGINT/SIGTERM, requests in flight get this long to finish and be published.
    drain_timeout_s: float = Field(default=60.0, ge=0)
    # In a rebalance, a worker giving up partitions waits this long for their requests at
    # the provider to be answered and committed, so that the next owner does not pay again.
    handover_timeout_s: float = Field(default=30.0, ge=0)
    # A progress line (rate, in flight, lag) at INFO this often; 0 turns it off.
    progress_interval_s: float = Field(default=30.0, ge=0)
    # Answer a request seen before from the response store instead of paying again.
    reuse_responses: bool = True
    # How long a worker may take to read the response store to its end at start.
    store_load_timeout_s: float = Field(default=300.0, gt=0)
    # Before its first prompt, a worker probes each configured dataset with this many answers
    # (services/probe: the first N prompts, paid once, reused by the run) and halts a dataset
    # whose accepted share is below [budget] min_yield. 0: no probe.
    probe_first: int = Field(default=0, ge=0, le=10_000)
    # Read the small ``response-index`` topic at start and the store only past its checkpoints
    # (False: read every stored value at each start; for measuring).
    store_index: bool = True


class AuditThresholds(BaseModel):
    """Per-dataset audit switches and tolerances."""

    model_config = _frozen

    disabled_checks: tuple[str, ...] = ()
    roundtrip_tolerance: float = Field(default=0.05, ge=0, le=1)
    # The provider's counting convention: usage.completion_tokens - len(output_ids) and
    # usage.prompt_tokens - len(prompt_ids). None: the provider convention's (0). Never
    # learned from the data: a learned offset absorbs any constant reconstruction error.
    usage_offset: int | None = None
    prompt_usage_offset: int | None = None
    usage_tolerance: int = Field(default=0, ge=0)
    require_reasoning: bool = True
    require_stop: bool = True
    # An answer cut at max_tokens (finish_reason "length") has exact ids up to the cut: with
    # this on it is accepted, flagged metadata.truncated in every export, instead of paid for
    # and dead-lettered finish_stop (speculators and ModelOpt keep such rows flagged).
    accept_truncated: bool = False


class DatasetSettings(BaseModel):
    """What differs between datasets: profile, request shape, caps and audit."""

    model_config = _frozen

    profile: str = "qwen3"
    # How a row's tools reach the model in chat mode (completions mode and the sglang provider
    # always render them with the template): "prompt" writes them into the prompt text as the
    # template writes them, with no `tools` request parameter (raw tool text: no parser, the
    # calls come back as the model wrote them); "parameter" sends the `tools` parameter and the
    # server's tool parser answers (calls that cannot be proven: docs/fidelity.md).
    tool_route: Literal["prompt", "parameter"] = "prompt"
    # Before 2026-12: true sent the `tools` parameter, false (the default) left a row's tools
    # out. A row's tools now always reach the model: true is read as tool_route = "parameter"
    # (where tool_route is not written), false changes nothing; the plan line says so.
    send_tools: bool | None = None
    # None: [provider] mode.
    mode: Literal["chat", "completions"] | None = None
    max_tokens: int = Field(default=4096, gt=0)
    cap_completion_tokens: int | None = Field(default=10_000_000, gt=0)
    cap_usd: float | None = Field(default=None, gt=0)
    expected_prompts: int | None = Field(default=None, ge=0)
    audit: AuditThresholds = Field(default_factory=AuditThresholds)
    # Multi-turn regeneration: "last" regenerates the final assistant turn on the
    # dataset's history; "all" regenerates every assistant turn on the regenerated history
    # (publish sends the first turn, the continuation stage the next ones).
    turns: Literal["last", "all"] = "last"

    @model_validator(mode="before")
    @classmethod
    def _send_tools_was_the_parameter(cls, data: Any) -> Any:
        """An old ``send_tools = true`` keeps sending the ``tools`` parameter (unless ``tool_route`` is written)."""
        if isinstance(data, dict) and data.get("send_tools") is True and "tool_route" not in data:
            return {**data, "tool_route": "parameter"}
        return data


class BudgetSettings(BaseModel):
    """Global caps, the soft threshold and prices for providers that report no cost."""

    model_config = _frozen

    global_cap_completion_tokens: int | None = Field(default=None, gt=0)
    global_cap_usd: float | None = Field(default=None, gt=0)
    soft_threshold: float = Field(default=0.8, gt=0, le=1)
    # USD per million tokens, by model: {"deepseek/deepseek-v3": {"prompt": 0.3, "completion": 1.0}}
    prices: dict[str, dict[str, float]] = Field(default_factory=dict)
    rate_window_s: float = Field(default=60.0, gt=0)
    include_inflight: bool = True
    # The quality halt (services/budget/quality.py): a dataset, or one OpenRouter upstream of
    # it, whose accepted share over its last quality_window audit verdicts is below min_yield
    # is halted on control with the top dead-letter reasons. 0 turns it off.
    min_yield: float = Field(default=0.9, ge=0, le=1)
    quality_window: int = Field(default=200, ge=1, le=1_000_000)
    # Admission by headroom: the budget hands out leases (docs/leases-and-rate-limits.md) and a
    # request waits for room under the caps instead of the scope being halted early.
    leases: bool = True
    # A lease not renewed for this long (plus the grace) is taken back from its worker.
    lease_ttl_s: float = Field(default=10.0, gt=0)
    lease_grace_s: float = Field(default=2.0, ge=0)
    # How often the provider key's usage is read to release lost attempts' worst case down to
    # what the key was charged (docs/money-safety.md); 0: never (the worst case stands).
    key_usage_interval_s: float = Field(default=5.0, ge=0)


class ProfileSettings(BaseModel):
    """A user-defined model profile, or a refinement of a built-in one (see services.profiles).

    Under a built-in name (``[profiles.kimi-k2]``) or with ``base`` set, only the fields
    written override the built-in; a new profile must give ``end_of_turn`` and its id.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    # A tokenizer.json, tiktoken.model or a local model folder; optional for a built-in
    # whose vocabulary is bundled or fetched at setup.
    tokenizer: str | None = None
    kind: Literal["hf", "tiktoken"] = "hf"
    end_of_turn: str = ""
    end_of_turn_id: int = -1
    bos_token: str = ""
    think_start: str | None = None
    think_start_id: int | None = None
    think_end: str | None = None
    think_end_id: int | None = None
    # Where the think-start lives: "prompt" (the generation prompt opens the block) or
    # "model" (the model emits it); unset for a model that never thinks.
    think_location: Literal["prompt", "model"] | None = None
    thinking: bool = True
    thinking_kwarg: str | None = None
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tool_tokens: dict[str, int] = Field(default_factory=dict)
    tool_format: Literal["kimi", "deepseek-r1", "deepseek-v3.1", "qwen", "dsml", "none"] = "none"
    # How the server passes earlier tool calls' arguments to the template (vLLM: dict).
    tool_arguments: Literal["dict", "string"] = "dict"
    template_tokens: list[str] = Field(default_factory=list)
    control_tokens: list[str] = Field(default_factory=list)
    chat_template: str | None = None
    chat_template_file: str | None = None
    trust_remote_code: bool = False
    base: str | None = None
    # tiktoken only: the pre-tokenizer regex (default: Kimi's for kimi profiles, else Qwen's).
    pat_str: str | None = None


class MetricsSettings(BaseModel):
    """Prometheus exposition: one port per service (0 disables)."""

    model_config = _frozen

    host: str = "127.0.0.1"
    inference_port: int = 9401
    reconstruct_port: int = 9402
    audit_port: int = 9403
    budget_port: int = 9404
    sink_port: int = 9405
    simulator_port: int = 9406
    publish_port: int = 0
    # Multi-turn regeneration.
    continuation_port: int = 9407


class SinkSettings(BaseModel):
    """Where training shards go and how they rotate."""

    model_config = _frozen

    out_dir: str = "out"
    rotate_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    format: Literal["jsonl", "parquet"] = "jsonl"


class StageSettings(BaseModel):
    """Batching of the stream stages."""

    model_config = _frozen

    batch_max: int = Field(default=64, gt=0)
    batch_timeout_ms: int = Field(default=200, ge=0)
    # How long the broker may hold a stage's fetch for 1 MiB (services/common/kafka.py,
    # STREAM_FETCH): shorter is less latency per hop, longer fewer and larger batches.
    fetch_wait_ms: int = Field(default=50, ge=0, le=1000)
    # How often a stage and an inference worker commit their consumed offsets (0: after every
    # batch). Outputs are acknowledged before any commit; a crash reads this much again.
    commit_interval_ms: int = Field(default=1000, ge=0, le=60_000)


class Settings(BaseSettings):
    """The whole configuration; every service reads the sections it needs."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        env_prefix="DRAFTSTREAM_",
        env_nested_delimiter="__",
        nested_model_default_partial_update=True,
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    provider: ProviderSettings = Field(default_factory=ProviderSettings)
    # Several providers in one run (docs/providers.md): one worker per provider, chosen with
    # ``draftstream run inference --provider NAME``; the budget reads every one's key.
    providers: dict[str, ProviderSettings] = Field(default_factory=dict)
    inference: InferenceSettings = Field(default_factory=InferenceSettings)
    budget: BudgetSettings = Field(default_factory=BudgetSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    sink: SinkSettings = Field(default_factory=SinkSettings)
    stage: StageSettings = Field(default_factory=StageSettings)
    defaults: DatasetSettings = Field(default_factory=DatasetSettings)
    datasets: dict[str, DatasetSettings] = Field(default_factory=dict)
    profiles: dict[str, ProfileSettings] = Field(default_factory=dict)
    # Log level of every service (DRAFTSTREAM_LOG_LEVEL); a command's --log-level wins.
    log_level: str = "INFO"
    # Where deploy/tokenizers/fetch.sh puts the tokenizers no package serves (R1/V3).
    tokenizers_dir: str = str(Path(__file__).resolve().parents[2] / ".run" / "tokenizers")
    # The raw layers this object was built from (by load_settings), for :meth:`dataset_origins`.
    _layers: dict[str, Any] = PrivateAttr(default_factory=dict)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Constructor, environment, then the TOML file chosen by :func:`load_settings`."""
        toml_file = _CURRENT_TOML[0]
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml_file is not None:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=toml_file))
        return tuple(sources)

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        return check_log_level(value)

    @model_validator(mode="wrap")
    @classmethod
    def _datasets_inherit_defaults(cls, data: Any, handler: ModelWrapValidatorHandler[Settings]) -> Settings:
        """Each ``[datasets.NAME]`` section over ``[defaults]``, key by key (``[...audit]`` too)."""
        merged = data
        if isinstance(data, dict) and isinstance(data.get("datasets"), dict):
            base = data.get("defaults") or {}
            datasets = {name: inherit(base, section, DatasetSettings) for name, section in data["datasets"].items()}
            merged = {**data, "datasets": datasets}
        settings = handler(merged)
        if isinstance(data, dict):  # built in code: what it was given (load_settings records its layers)
            settings._layers = {"override": data}
        return settings

    @field_validator("datasets")
    @classmethod
    def _dataset_names(cls, value: dict[str, DatasetSettings]) -> dict[str, DatasetSettings]:
        for name in value:
            check_dataset_name(name)
        return value

    @field_validator("providers")
    @classmethod
    def _provider_names(cls, value: dict[str, ProviderSettings]) -> dict[str, ProviderSettings]:
        named = {}
        for name, section in value.items():
            if not name or not set(name) <= _VALID_TOPIC_CHARS:
                raise ConfigError(f"provider name {name!r}: use 1-200 of [a-zA-Z0-9._-]")
            if section.name and section.name != name:
                raise ConfigError(f"[providers.{name}] name = {section.name!r}: the section's name is its name")
            named[name] = section.model_copy(update={"name": name})
        return named

    def all_providers(self) -> dict[str, ProviderSettings]:
        """Every configured provider by name: the ``[providers.NAME]`` sections, else ``[provider]``."""
        return dict(self.providers) if self.providers else {self.provider.label: self.provider}

    def for_provider(self, name: str | None) -> Settings:
        """These settings with ``[provider]`` being provider ``name`` (what one worker runs).

        ``None`` keeps ``[provider]`` when no ``[providers.NAME]`` is configured, or takes the
        only one; with several, the choice is the caller's (:class:`ConfigError` names them).
        """
        if name is None:
            if len(self.providers) <= 1:
                name = next(iter(self.providers), None)
                if name is None:
                    return self
            else:
                names = ", ".join(sorted(self.providers))
                raise ConfigError(f"several providers are configured ({names}): choose one with --provider NAME")
        if name not in self.providers:
            if not self.providers and name == self.provider.label:
                return self
            known = ", ".join(sorted(self.all_providers())) or "none"
            raise ConfigError(f"no provider {name!r} in the configuration ([providers.NAME] sections: {known})")
        provider = self.providers[name]
        update: dict[str, Any] = {"provider": provider}
        if provider.metrics_port is not None:
            update["metrics"] = self.metrics.model_copy(update={"inference_port": provider.metrics_port})
        chosen = self.model_copy(update=update)
        chosen._layers = self._layers
        return chosen

    def dataset(self, name: str) -> DatasetSettings:
        """The effective settings of one dataset: its own section over ``[defaults]``, else ``[defaults]``."""
        return self.datasets.get(name, self.defaults)

    def dataset_origins(self, name: str) -> dict[str, tuple[Any, Origin]]:
        """Every effective setting of dataset ``name`` (dotted key) with where it came from.

        Origins: ``dataset`` / ``defaults`` (that section of the file), ``env`` (a
        ``DRAFTSTREAM_...`` variable), ``override`` (given in code), ``provider`` (``mode``
        left to ``[provider] mode``), ``built-in``.
        """
        effective = self.dataset(name).model_dump(mode="json")
        shown: dict[str, tuple[Any, Origin]] = {}
        for path in leaf_keys(DatasetSettings):
            value: Any = effective
            for part in path:
                value = value[part]
            origin = origin_of(name, path, self._layers)
            if path == ("mode",) and value is None:
                value, origin = self.provider.mode, "provider"
            if path == ("tool_route",) and origin == "built-in" and value == "parameter":
                origin = origin_of(name, ("send_tools",), self._layers)  # an old send_tools = true
            shown[".".join(path)] = (value, origin)
        return shown

    def mode_of(self, dataset: DatasetSettings) -> Literal["chat", "completions"]:
        """How a dataset's requests are sent: its own ``mode``, else ``[provider] mode``."""
        return dataset.mode or self.provider.mode

    def redacted(self) -> dict[str, Any]:
        """The settings as plain data with every secret masked (for printing)."""
        return self.model_dump(mode="json")

    def origins(self) -> dict[str, dict[str, Origin]]:
        """Per configured dataset, where each of its effective settings came from (dotted keys)."""
        return {
            name: {key: origin for key, (_, origin) in self.dataset_origins(name).items()}
            for name in sorted(self.datasets)
        }


_CURRENT_TOML: list[Path | None] = [None]

_VALID_TOPIC_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def check_dataset_name(name: str) -> str:
    """Refuse a dataset name that cannot be part of a Kafka topic name or a key."""
    if not name or len(name) > 200 or not set(name) <= _VALID_TOPIC_CHARS or name in {".", ".."}:
        raise ConfigError(f"dataset name {name!r} cannot be a topic name: use 1-200 of [a-zA-Z0-9._-]")
    if name == GLOBAL_SCOPE:
        raise ConfigError(f"dataset name {name!r} is reserved for the scope of global halts and caps")
    return name


def check_log_level(name: str) -> str:
    """The canonical name of a log level (case-insensitive); :class:`ConfigError` otherwise."""
    upper = name.strip().upper()
    if upper == "WARN":
        upper = "WARNING"
    if upper not in LOG_LEVELS:
        raise ConfigError(f"unknown log level {name!r}: use one of {', '.join(LOG_LEVELS)}")
    return upper


def _refuse_secrets_in_file(path: Path) -> None:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    for section, key in (("provider", "api_key"), ("kafka", "sasl_password")):
        if isinstance(data.get(section), dict) and key in data[section]:
            raise ConfigError(
                f"{path}: [{section}] {key} must not be written in a file; "
                f"set DRAFTSTREAM_{section.upper()}__{key.upper()} in the environment"
            )
    providers = data.get("providers")
    for name, section in (providers.items() if isinstance(providers, dict) else ()):
        if isinstance(section, dict) and "api_key" in section:
            raise ConfigError(
                f"{path}: [providers.{name}] api_key must not be written in a file; "
                f"set DRAFTSTREAM_PROVIDERS__{name.upper()}__API_KEY in the environment"
            )


def _file_sets(path: Path | None, section: str, key: str) -> bool:
    """Whether the TOML file writes ``[section] key``."""
    if path is None:
        return False
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return isinstance(data.get(section), dict) and key in data[section]


def _port(text: str, name: str) -> int:
    """A TCP port from an environment variable, or a :class:`ConfigError` naming it."""
    try:
        port = int(text.strip())
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise ConfigError(f"{name}={text!r} is not a TCP port (1-65535)")
    return port


def _error_lines(exc: ValidationError) -> str:
    """One line per problem; an unknown key names itself and its section (``[datasets.mt.audit]``)."""
    lines = []
    for error in exc.errors():
        loc = [str(part) for part in error["loc"]]
        if error["type"] == "extra_forbidden":
            section = f"[{'.'.join(loc[:-1])}]" if len(loc) > 1 else "the top level"
            lines.append(f"{section} {loc[-1]}: unknown key (not a setting of {section})")
        else:
            lines.append(f"{'.'.join(loc)}: {error['msg']} (got {error.get('input')!r})")
    return "\n".join(lines)


def load_settings(config: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the frozen settings from the TOML file, the environment and ``overrides``.

    Args:
        config: a TOML file; ``None`` uses ``draftstream.toml`` in the working
            directory when it exists.
        overrides: section values that win over everything else.
    """
    import os

    environ = os.environ
    path: Path | None
    if config is None:
        path = Path(DEFAULT_CONFIG_FILE) if Path(DEFAULT_CONFIG_FILE).is_file() else None
    else:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
    if path is not None:
        try:
            _refuse_secrets_in_file(path)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None

    kafka_over: dict[str, Any] = dict(overrides.pop("kafka", {}) or {})
    if "KAFKA_BOOTSTRAP_SERVERS" in environ and "DRAFTSTREAM_KAFKA__BOOTSTRAP_SERVERS" not in environ:
        kafka_over.setdefault("bootstrap_servers", environ["KAFKA_BOOTSTRAP_SERVERS"])
    elif (
        "KAFKA_PORT" in environ
        and "DRAFTSTREAM_KAFKA__BOOTSTRAP_SERVERS" not in environ
        and not _file_sets(path, "kafka", "bootstrap_servers")
    ):
        # The local broker's port (deploy/kafka/kafka.sh reads KAFKA_PORT): only the
        # default follows it, so a file or an explicit setting still wins.
        kafka_over.setdefault("bootstrap_servers", f"127.0.0.1:{_port(environ['KAFKA_PORT'], 'KAFKA_PORT')}")
    provider_over: dict[str, Any] = dict(overrides.pop("provider", {}) or {})
    if "OPENROUTER_API_KEY" in environ and "DRAFTSTREAM_PROVIDER__API_KEY" not in environ:
        provider_over.setdefault("api_key", environ["OPENROUTER_API_KEY"])
    if kafka_over:
        overrides["kafka"] = kafka_over
    if provider_over:
        overrides["provider"] = provider_over

    _CURRENT_TOML[0] = path
    try:
        settings = Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError(f"invalid configuration{f' in {path}' if path else ''}:\n{_error_lines(exc)}") from None
    except ValueError as exc:
        raise ConfigError(f"invalid configuration{f' in {path}' if path else ''}:\n{exc}") from None
    finally:
        _CURRENT_TOML[0] = None
    if "OPENROUTER_API_KEY" in environ:  # the conventional key of every OpenRouter section without its own
        keyed = {
            name: p.model_copy(update={"api_key": SecretStr(environ["OPENROUTER_API_KEY"])})
            if p.kind == "openrouter" and p.api_key is None else p
            for name, p in settings.providers.items()
        }
        settings = settings.model_copy(update={"providers": keyed})
    settings._layers = {
        "override": overrides,
        "env": EnvSettingsSource(Settings)(),
        "file": tomllib.loads(path.read_text(encoding="utf-8")) if path is not None else {},
    }
    return settings
