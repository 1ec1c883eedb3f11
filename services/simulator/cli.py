"""``draftstream simulate-provider``: run the OpenRouter-shaped simulator until SIGINT/SIGTERM."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from services.common.logs import LogLevelOption


def _parse_range(text: str, option: str) -> tuple[int, int]:
    """``"40-200"`` (or ``"100"``) as an inclusive token range."""
    from services.common.cli import fail

    low, sep, high = text.partition("-")
    try:
        lo = int(low)
        hi = int(high) if sep else lo
    except ValueError:
        fail(f"{option} must look like 40-200, got {text!r}")
    if lo < 1 or hi < lo:
        fail(f"{option} must be a range of positive integers low-high, got {text!r}")
    return lo, hi


def _parse_rates(items: list[str]) -> dict[str, float]:
    """``name=rate`` pairs as a dict."""
    from services.common.cli import fail

    rates: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            rates[name.strip()] = float(value)
        except ValueError:
            fail(f"--fault-rate takes name=rate (e.g. 429=0.05), got {item!r}")
    return rates


def register(app: typer.Typer, run_app: typer.Typer) -> None:
    """Add ``simulate-provider`` to the root command."""

    @app.command("simulate-provider")
    def simulate_provider(
        port: Annotated[int, typer.Option(help="Port to listen on")] = 8099,
        host: Annotated[str, typer.Option(help="Address to bind")] = "127.0.0.1",
        profile: Annotated[str, typer.Option(help="Model profile whose tokenizer generates")] = "qwen3",
        seed: Annotated[int, typer.Option(help="Seed of generation and of transient faults")] = 0,
        latency: Annotated[float, typer.Option(help="Fixed latency per response, seconds")] = 0.0,
        jitter: Annotated[float, typer.Option(help="Extra uniform latency 0..jitter, seconds")] = 0.0,
        reasoning_tokens: Annotated[str, typer.Option(help="Reasoning length range, tokens")] = "40-200",
        content_tokens: Annotated[str, typer.Option(help="Content length range, tokens")] = "20-120",
        answer_tokens: Annotated[
            str, typer.Option(help="Thinking answers: total length log-uniform in this range (overrides both ranges)")
        ] = "",
        reasoning_share: Annotated[
            float, typer.Option(help="With --answer-tokens: the least share of reasoning (up to +0.15)")
        ] = 0.80,
        fault_rate: Annotated[
            list[str] | None,
            typer.Option(
                "--fault-rate",
                help="name=rate, repeatable; names: 429 5xx timeout drop malformed error_in_200 "
                "truncate empty_reasoning bad_usage noncanonical_len noncanonical_same",
            ),
        ] = None,
        retry_after: Annotated[float, typer.Option(help="Retry-After of a 429, seconds")] = 0.1,
        timeout_sleep: Annotated[float, typer.Option(help="How long a 'timeout' fault stalls, seconds")] = 30.0,
        rate_limit_rps: Annotated[
            float | None,
            typer.Option(help="Admit this many requests per second (token bucket); beyond: 429 with Retry-After"),
        ] = None,
        rate_limit_burst: Annotated[
            float | None, typer.Option(help="Requests the bucket admits at once [default: the rate, rounded up]")
        ] = None,
        max_open: Annotated[
            int | None,
            typer.Option(help="Requests answered at once; beyond: 429 with Retry-After of --retry-after"),
        ] = None,
        hold_until_open: Annotated[
            int | None,
            typer.Option(help="Answer only once this many requests were open at once (60 s at most)"),
        ] = None,
        rate_limit_window: Annotated[
            int | None,
            typer.Option(help="Admit this many requests per fixed window (instead of the bucket); beyond: 429"),
        ] = None,
        rate_limit_window_s: Annotated[float, typer.Option(help="Length of that window, seconds")] = 60.0,
        rate_limit_schedule: Annotated[
            str | None,
            typer.Option(help="Change the bucket's rate after the first request: 'seconds:factor,...' (20:0.5,50:1)"),
        ] = None,
        limit_headers: Annotated[
            str, typer.Option(help="What a 429 states of the limit: x-ratelimit (headers) or none (a silent front)")
        ] = "x-ratelimit",
        count_end_of_turn: Annotated[
            bool, typer.Option(help="Count the end-of-turn token in usage.completion_tokens")
        ] = True,
        count_think_end: Annotated[
            bool, typer.Option(help="Count the think-end token in usage.completion_tokens")
        ] = True,
        logprobs: Annotated[bool, typer.Option(help="Always return logprobs")] = False,
        keep_truth: Annotated[
            bool, typer.Option(help="Keep the true output ids per sample key and serve them on GET /_sim/truth")
        ] = False,
        price_per_token: Annotated[float, typer.Option(help="USD per completion token in usage.cost")] = 2e-6,
        name: Annotated[
            str, typer.Option("--name", help="The upstream each answer names in its 'provider' field")
        ] = "SimProvider",
        free: Annotated[
            bool, typer.Option("--free", help="No usage.cost in the answers and nothing charged (a local server)")
        ] = False,
        parser: Annotated[
            str,
            typer.Option(
                help="Server parse to emulate: vllm (no whitespace stripped) or sglang-legacy "
                "(reasoning and content stripped)"
            ),
        ] = "vllm",
        chat_template_file: Annotated[
            Path | None,
            typer.Option(
                help="Render prompts from this Hugging Face chat template (e.g. the model's official one) "
                "instead of the profile's"
            ),
        ] = None,
        metrics_port: Annotated[
            int | None,
            typer.Option(help="Serve Prometheus metrics on this port (0: off) [default: metrics.simulator_port]"),
        ] = None,
        config: Annotated[Path | None, typer.Option("--config", "-c", help="TOML config (custom profiles)")] = None,
        log_level: LogLevelOption = None,
    ) -> None:
        """Serve an OpenRouter-shaped provider simulator (ground-truth ids, fault injection)."""
        import asyncio

        from services.common.cli import fail, settings_from
        from services.common.logs import setup_logging
        from services.common.service import collect_garbage_for_a_service, run_service
        from services.simulator.app import create_app
        from services.simulator.options import SimulatorOptions, get_profile

        try:
            options = SimulatorOptions(
                profile=profile,
                seed=seed,
                latency_s=latency,
                latency_jitter_s=jitter,
                reasoning_tokens=_parse_range(reasoning_tokens, "--reasoning-tokens"),
                content_tokens=_parse_range(content_tokens, "--content-tokens"),
                answer_tokens=_parse_range(answer_tokens, "--answer-tokens") if answer_tokens else None,
                reasoning_share=(reasoning_share, min(1.0, reasoning_share + 0.15)),
                retry_after_s=retry_after,
                timeout_sleep_s=timeout_sleep,
                count_end_of_turn=count_end_of_turn,
                count_think_end=count_think_end,
                logprobs=logprobs,
                keep_truth=keep_truth,
                price_per_token=price_per_token,
                provider_name=name,
                free=free,
                parser=parser,
                chat_template_file=str(chat_template_file) if chat_template_file is not None else None,
                rate_limit_rps=rate_limit_rps,
                rate_limit_burst=rate_limit_burst,
                max_open=max_open,
                hold_until_open=hold_until_open,
                rate_limit_window=rate_limit_window,
                rate_limit_window_s=rate_limit_window_s,
                rate_limit_schedule=rate_limit_schedule,
                limit_headers=limit_headers,
            ).with_fault_rates(_parse_rates(fault_rate or []))
        except ValueError as exc:
            fail(str(exc))
        if not name.strip():
            fail("--name must not be empty")
        if min(latency, jitter, retry_after, timeout_sleep, price_per_token) < 0:
            fail("latency, jitter, retry-after, timeout-sleep and price must not be negative")
        if chat_template_file is not None:
            from services.simulator.prompts import compile_chat_template

            try:
                compile_chat_template(chat_template_file.read_text(encoding="utf-8"))
            except Exception as exc:  # missing file, not UTF-8, or a Jinja syntax error: one clear line
                fail(f"--chat-template-file {chat_template_file}: {exc}")
        settings = settings_from(config)
        setup_logging(settings, log_level)
        try:
            loaded = get_profile(profile, settings)
        except Exception as exc:  # ProfileError and tokenizer load failures: one clear line
            fail(f"cannot load profile {profile!r}: {exc}")
        service = create_app(settings, options=options, host=host, port=port, profile=loaded)
        # Like every other service, the port comes from [metrics] unless the option names one.
        served_on = settings.metrics.simulator_port if metrics_port is None else metrics_port
        collect_garbage_for_a_service()  # thousands of requests open: the collector of a service
        try:
            asyncio.run(
                run_service(service, name="simulator", metrics_port=served_on, metrics_host=settings.metrics.host)
            )
        except OSError as exc:
            fail(f"cannot listen on {host}:{port}: {exc}")
