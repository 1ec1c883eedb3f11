"""The ``draftstream`` command: one entry point for every service and every chore.

Each stage package contributes its commands through ``services/<stage>/cli.py``'s
``register(app)``; heavy imports (tokenizers, HTTP clients) happen inside the commands so
``draftstream --help`` stays fast.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer.core import TyperGroup

from services.common.cli import ConfigOption, Hooks, fail, loaded_bootstrap, run_app, settings_from
from services.common.config import ConfigError
from services.common.errors import CommandError
from services.common.logs import LogLevelOption

if TYPE_CHECKING:
    from services.common.broker import BrokerStatus
    from services.common.config import Settings

class _OneLineErrors(TyperGroup):
    """The root command: errors a person can act on become one line on stderr and exit 2.

    Every command runs inside :meth:`invoke`, so configuration errors, a broker that does
    not answer, a port in use or a locked directory never reach the user as a traceback,
    whichever command (or service) hit them. Anything else is a bug and keeps its traceback.
    """

    def invoke(self, ctx: Any) -> Any:  # typer vendors click: its Context type is private
        """Run the command; translate the errors a user can act on."""
        try:
            return super().invoke(ctx)
        except (CommandError, ConfigError) as exc:
            fail(str(exc))
        except Exception as exc:
            if not _is_kafka_error(exc):
                raise
            fail(_kafka_error_line(exc, loaded_bootstrap()))


def _is_kafka_error(exc: BaseException) -> bool:
    # aiokafka is imported lazily by the commands; if it is not loaded, this is not its error.
    errors = sys.modules.get("aiokafka.errors")
    return errors is not None and isinstance(exc, errors.KafkaError)


def _kafka_error_line(exc: BaseException, bootstrap: str | None) -> str:
    """One line for a Kafka client error: where, what, and what to do when unreachable."""
    where = f" at {bootstrap}" if bootstrap else ""
    errors = sys.modules["aiokafka.errors"]
    if isinstance(exc, errors.KafkaConnectionError | errors.KafkaTimeoutError):
        return (
            f"cannot reach Kafka{where}: start a local broker with `draftstream broker start`, or point "
            "KAFKA_BOOTSTRAP_SERVERS (or [kafka] bootstrap_servers) at a running one"
        )
    detail = str(exc).splitlines()[0] if str(exc) else ""
    return f"Kafka error{where}: {type(exc).__name__}{': ' + detail if detail else ''}"


app = typer.Typer(
    name="draftstream",
    help="Token-exact training data for speculative-decoding drafters, streamed through Kafka.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    cls=_OneLineErrors,
)
app.add_typer(run_app, name="run")
broker_app = typer.Typer(help="The local Kafka broker (no Docker needed).", no_args_is_help=True)
app.add_typer(broker_app, name="broker")
topics_app = typer.Typer(help="Kafka topics.", no_args_is_help=True)
app.add_typer(topics_app, name="topics")
schemas_app = typer.Typer(help="The wire contracts.", no_args_is_help=True)
app.add_typer(schemas_app, name="schemas")
config_app = typer.Typer(help="Configuration.", no_args_is_help=True)
app.add_typer(config_app, name="config")
acls_app = typer.Typer(help="Least-privilege Kafka ACLs, one SASL user per service.", no_args_is_help=True)
app.add_typer(acls_app, name="acls")

def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"draftstream {version('draftstream')}")
        except PackageNotFoundError:
            print("draftstream (not installed: version unknown)")
        raise typer.Exit(0)


@app.callback()
def _root(
    ctx: typer.Context,
    show_version: Annotated[
        bool, typer.Option("--version", help="Print the version and exit", is_eager=True, callback=_version)
    ] = False,
) -> None:
    """Token-exact training data for speculative-decoding drafters, streamed through Kafka."""
    # Until a service sets logging up, aiokafka's connection errors would reach stderr
    # through logging's last-resort handler, next to the one line the command prints.
    logging.getLogger("aiokafka").addHandler(logging.NullHandler())
    ctx.obj = _hooks()


def _describe(status: BrokerStatus) -> str:
    if not status.running:
        return "stopped"
    if status.nodes:
        return (
            f"running: Kafka {status.version or '?'}, {len(status.running_nodes)} of {len(status.nodes)} nodes "
            f"at {status.bootstrap}"
        )
    return f"running: Kafka {status.version or '?'} at {status.bootstrap} (pid {status.pid})"


NodeOption = Annotated[int | None, typer.Option("--node", help="Only this node of the local cluster (1..N)")]


@broker_app.command("start")
def broker_start(
    port: Annotated[int | None, typer.Option(help="Client port (default 9092 or $KAFKA_PORT)")] = None,
    nodes: Annotated[
        int | None,
        typer.Option(
            help="Start a local cluster of this many nodes (node i on port+i-1; default 1, or the run dir's cluster)",
            min=1,
            max=9,
        ),
    ] = None,
    node: NodeOption = None,
) -> None:
    """Start the local Kafka (KRaft) broker under .run/kafka, or a local cluster with --nodes."""
    from services.common import broker

    try:
        status = broker.start(port=port, nodes=nodes, node=node)
    except broker.BrokerError as exc:
        fail(str(exc))
    print(_describe(status))
    if status.bootstrap:
        print("to use it from draftstream commands in other shells:")
        print(f"export KAFKA_BOOTSTRAP_SERVERS={status.bootstrap}")


@broker_app.command("stop")
def broker_stop(node: NodeOption = None) -> None:
    """Stop the local broker, every node of the local cluster, or one --node."""
    from services.common import broker

    try:
        print("stopped" if broker.stop(node=node) else "was not running")
    except broker.BrokerError as exc:
        fail(str(exc))


@broker_app.command("status")
def broker_status() -> None:
    """Say whether the local broker runs (exit 1 when it does not); for a cluster, list the
    nodes, the active controller, partition leaders per node and under-replicated partitions."""
    from services.common import broker

    status = broker.status()
    print(_describe(status))
    if status.nodes:
        for line in _cluster_lines(status):
            print(line)
    raise typer.Exit(0 if status.running else 1)


def _cluster_lines(status: BrokerStatus) -> list[str]:
    """The nodes of a local cluster, and (when one runs) its quorum and partition layout."""
    from services.common import broker
    from services.common.config import KafkaSettings
    from services.common.kafka import describe_layout

    lines = [
        f"  node {n.node_id}: {'running (pid ' + str(n.pid) + ')' if n.running else 'stopped'}, "
        f"port {n.port}, controller port {n.controller_port}"
        for n in status.nodes
    ]
    if not status.running or not status.bootstrap:
        return lines
    try:
        quorum = broker.quorum()
        lines.append(f"active controller: node {quorum.leader} (epoch {quorum.epoch}, voters {list(quorum.voters)})")
    except broker.BrokerError as exc:
        lines.append(f"active controller: unknown ({str(exc).splitlines()[-1]})")
    try:
        layout = asyncio.run(asyncio.wait_for(describe_layout(KafkaSettings(bootstrap_servers=status.bootstrap)), 30))
    except TimeoutError:
        return [*lines, f"partitions: unknown (no answer from {status.bootstrap} within 30 s)"]
    leaders = layout.leaders_per_broker()
    lines.append(
        "partition leaders per node: "
        + ", ".join(f"{'no leader' if b < 0 else f'node {b}'}: {n}" for b, n in sorted(leaders.items()))
    )
    under = layout.under_replicated
    lines.append(f"under-replicated partitions: {len(under)} of {len(layout.partitions)}")
    shown = 20
    lines += [
        f"  {p.topic}[{p.partition}] leader {p.leader} replicas {list(p.replicas)} isr {list(p.isr)}"
        for p in under[:shown]
    ]
    if len(under) > shown:
        lines.append(f"  ... and {len(under) - shown} more")
    return lines


@topics_app.command("create")
def topics_create(
    config: ConfigOption = None,
    dataset: Annotated[list[str] | None, typer.Option("--dataset", "-d", help="Also create prompts.<dataset>")] = None,
) -> None:
    """Create every topic draftstream uses (idempotent)."""
    from services.common.config import check_dataset_name
    from services.common.kafka import ensure_topics

    settings = settings_from(config)
    names = list(dataset or []) + list(settings.datasets)
    try:
        for name in names:
            check_dataset_name(name)
    except ConfigError as exc:
        fail(str(exc))
    created = asyncio.run(ensure_topics(settings.kafka, names))
    print(f"created {len(created)} topic(s): {', '.join(created) or '-'} (others already existed)")


PrefixOption = Annotated[
    str | None, typer.Option("--prefix", help="Topic prefix of the deployment (default: [kafka] topic_prefix)")
]
UserPrefixOption = Annotated[
    str, typer.Option("--user-prefix", help="Prefix of the SASL user names: principal User:<prefix><service>")
]
ACL_FORMATS = ("kafka-acls", "json")


@acls_app.command("print")
def acls_print(
    config: ConfigOption = None,
    prefix: PrefixOption = None,
    user_prefix: UserPrefixOption = "",
    fmt: Annotated[str, typer.Option("--format", help="kafka-acls (command lines) or json")] = "kafka-acls",
) -> None:
    """Print the ACL set derived from the topology: each service only its topics and group."""
    from services.common.acls import acl_bindings, format_json, format_kafka_acls

    if fmt not in ACL_FORMATS:
        fail(f"--format {fmt!r}: use one of {', '.join(ACL_FORMATS)}")
    topic_prefix = settings_from(config).kafka.topic_prefix if prefix is None else prefix
    bindings = acl_bindings(topic_prefix=topic_prefix, user_prefix=user_prefix)
    text = format_json(bindings) if fmt == "json" else format_kafka_acls(bindings, topic_prefix=topic_prefix)
    sys.stdout.write(text)


@acls_app.command("apply")
def acls_apply(
    config: ConfigOption = None,
    prefix: PrefixOption = None,
    user_prefix: UserPrefixOption = "",
    kafka_acls: Annotated[
        Path | None, typer.Option("--kafka-acls", help="kafka-acls.sh to run (default: on PATH, else the jars)")
    ] = None,
    kafka_libs: Annotated[
        Path | None, typer.Option("--kafka-libs", help="Kafka jars to run kafka-acls from (default .run/kafka/libs)")
    ] = None,
) -> None:
    """Add the ACL set to the cluster, as the admin user of the configuration (idempotent)."""
    from services.common.acls import acl_bindings
    from services.common.acls_apply import acl_tool, apply_acls

    settings = settings_from(config)
    topic_prefix = settings.kafka.topic_prefix if prefix is None else prefix
    bindings = acl_bindings(topic_prefix=topic_prefix, user_prefix=user_prefix)
    runs = apply_acls(bindings, settings.kafka, tool=acl_tool(kafka_acls, kafka_libs))
    principals = sorted({b.principal for b in bindings})
    print(f"applied {len(bindings)} ACL(s) for {len(principals)} principal(s) in {runs} kafka-acls run(s) "
          f"as User:{settings.kafka.sasl_username or 'ANONYMOUS'}: {', '.join(principals)}")


@schemas_app.command("export")
def schemas_export(
    out: Annotated[Path, typer.Option(help="Output folder")] = Path("schemas/generated"),
) -> None:
    """Write the JSON Schema of every event and the AsyncAPI document under schemas/generated/."""
    from schemas.export import export

    written = export(out)
    print(f"wrote {len(written)} schema file(s) to {out}")


@config_app.command("show")
def config_show(
    config: ConfigOption = None,
    dataset: Annotated[
        str | None, typer.Option("--dataset", "-d", help="One dataset's effective settings, each with its origin")
    ] = None,
) -> None:
    """Print the effective configuration (JSON, secrets masked) with where each dataset setting came from.

    Every dataset inherits from [defaults] the keys its own section does not set; "origins"
    says, per dataset and key: dataset, defaults, env, provider ([provider] mode) or built-in.
    """
    settings = settings_from(config)
    if dataset is not None:
        from services.common.config import check_dataset_name

        check_dataset_name(dataset)
    _check_profiles(settings, [dataset] if dataset is not None else list(settings.datasets))
    if dataset is not None:
        named = "" if dataset in settings.datasets else "  # not in [datasets]: [defaults] and built-ins"
        print(f"[datasets.{dataset}]{named}")
        for key, (value, origin) in settings.dataset_origins(dataset).items():
            print(f"{key} = {json.dumps(value)}  # {origin}")
        return
    print(json.dumps({**settings.redacted(), "origins": settings.origins()}, indent=2))


@run_app.command("all")
def run_all(
    config: ConfigOption = None,
    logs: Annotated[Path, typer.Option("--logs", help="Folder of the services' logs, one file each")] = Path(
        ".run/logs"
    ),
    log_level: LogLevelOption = None,
) -> None:
    """Run every service the config needs (budget, inference, reconstruct, audit, sink; continuation when a
    dataset has turns = "all") as child processes, one log each; Ctrl-C stops them all within 10 s."""
    from services.common.supervise import Supervisor, services_for

    settings = settings_from(config)
    names = services_for(settings)
    extra = [*(["--config", str(config)] if config else []), *(["--log-level", log_level] if log_level else [])]
    supervisor = Supervisor(
        lambda name: [sys.executable, "-m", "services.cli", "run", name, *extra], logs,
        say=lambda line: print(line, flush=True),
    )
    print(f"running {', '.join(names)}; Ctrl-C stops them all", flush=True)
    raise typer.Exit(supervisor.run(names))


def _check_profiles(settings: Settings, datasets: list[str]) -> None:
    """Load each dataset's profile as ``estimate`` and the workers do: one that cannot load is a one-line error."""
    from services.profiles import ProfileError, load_profile

    for name in datasets:
        profile = settings.dataset(name).profile
        try:
            load_profile(profile, settings)
        except ProfileError as exc:
            fail(f"dataset {name}: profile {profile}: {exc}")


_CONTRIBUTORS = (
    "services.simulator.cli",
    "services.inference.cli",
    "services.reconstruct.cli",
    "services.audit.cli",
    "services.sink.cli",
    "services.budget.cli",
    "services.publish.cli",
    "services.estimate.cli",
    "services.probe.cli",
    "services.dlq.cli",
    "services.export.cli",
    "services.status.cli",
    "services.demo.cli",
    "services.continuation.cli",
)


def _register_contributors() -> None:
    for module_name in _CONTRIBUTORS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # that stage is not built in this checkout
            raise
        module.register(app, run_app)


def _hooks() -> Hooks:
    """What one stage's command takes from another, wired here, above both: no stage's CLI
    imports another stage (publish --dry-run prices with the estimate stage; the inference
    worker runs the probe's probe_first)."""
    try:
        from services.estimate.cli import DryRunPricing
    except ModuleNotFoundError:
        return Hooks(worker_probe=_probe_first)  # the estimate stage is not built in this checkout
    return Hooks(dry_run_pricing=DryRunPricing, worker_probe=_probe_first)


async def _probe_first(*args: Any) -> object:
    """The probe's ``probe_first``, imported when a worker runs it (it loads the audit and reconstruct stages)."""
    from services.probe.app import probe_first

    return await probe_first(*args)


_register_contributors()


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
