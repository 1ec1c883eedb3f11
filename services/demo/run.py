"""``draftstream demo``: the whole pipeline on this machine, on embedded defaults.

Starts (or reuses) a Kafka broker, the provider simulator with a few faults on, and every
service as its own process, exactly as a user would run them; publishes the bundled
datasets; waits until every prompt is accounted for (an accepted row or a dead letter);
prints the summary; replays the inference dead letters and shows them accepted; then
shuts everything down.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import schemas as s
from services.common.config import Settings, load_settings
from services.common.console import data_console, styled
from services.sink.core import torn_tail

DATA = Path(__file__).parent / "data"
DATASETS = ("math", "code", "tools", "chat")
# Multi-turn regeneration: every assistant turn regenerated on the regenerated history.
MULTI_TURN = ("chat",)
# The budget first: it announces the lease policy the workers wait for (docs/leases-and-rate-limits.md, "Leases").
SERVICES = ("budget", "inference", "reconstruct", "audit", "sink", "continuation")
REPO = Path(__file__).resolve().parents[2]
# The columns of the two tables the demo ends with (the README's demo excerpt shows them).
SUMMARY_COLUMNS = ("dataset", "published", "accepted", "dead-lettered", "accounted")  # topology: not a topic
CONVERSATION_COLUMNS = ("dataset", "conversations", "rows", "how they ended")

console = data_console()


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def demo_config(run_dir: Path, bootstrap: str, sim_port: int) -> str:
    """The embedded demo configuration (TOML)."""
    prefix = f"demo{int(time.time())}."
    return f"""# Written by `draftstream demo`; a starting point for a real config.
[kafka]
bootstrap_servers = "{bootstrap}"
topic_prefix = "{prefix}"

[provider]
kind = "simulator"
base_url = "http://127.0.0.1:{sim_port}/api/v1"
model = "qwen/qwen3-8b"
concurrency = 64
max_attempts = 2
backoff_initial_s = 0.05
backoff_max_s = 0.2
timeout_s = 10

[sink]
out_dir = "{run_dir / "out"}"

[stage]
batch_max = 32
batch_timeout_ms = 100

[metrics]
inference_port = {free_port()}
reconstruct_port = {free_port()}
audit_port = {free_port()}
budget_port = {free_port()}
sink_port = {free_port()}
continuation_port = {free_port()}
simulator_port = 0

[datasets.math]
profile = "qwen3"
max_tokens = 2048

[datasets.code]
profile = "qwen3"
max_tokens = 2048

[datasets.tools]
profile = "qwen3"
max_tokens = 2048

[datasets.chat]
profile = "qwen3"
max_tokens = 2048
turns = "all"
"""


@dataclass
class Processes:
    """The processes the demo started, stopped in reverse order on exit."""

    log_dir: Path
    procs: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)
    logs: list[IO[bytes]] = field(default_factory=list)

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Start one process with its output in ``<log_dir>/<name>.log``."""
        log = (self.log_dir / f"{name}.log").open("wb")
        self.logs.append(log)
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)  # noqa: S603 - our own CLI
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        """Fail loudly when a service died."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.log_dir / name}.log")

    def stop_all(self) -> None:
        """SIGTERM everything, then SIGKILL what is left after 20 s."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _, proc in reversed(self.procs):
            with suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in self.logs:
            log.close()


def shown(path: Path) -> str:
    """A path as the demo prints it: relative to the working directory when under it (no machine paths)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def cli(*args: str) -> list[str]:
    """The argv that runs a draftstream command in this interpreter."""
    return [sys.executable, "-m", "services.cli", *args]


def run_cli(args: list[str], env: dict[str, str], what: str) -> str:
    """Run a short draftstream command; raise with its output when it fails."""
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)  # noqa: S603
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return done.stdout


def show(output: str) -> None:
    """Print a subcommand's output as it is (its tables are already laid out)."""
    sys.stdout.write(output if output.endswith("\n") else output + "\n")
    sys.stdout.flush()


def wait_http(url: str, timeout: float) -> None:
    """Wait until a local HTTP endpoint answers."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def sink_rows(out_dir: Path) -> list[dict[str, Any]]:
    """Every whole row of the sink's JSONL parts under ``out_dir``, read while the sink may run.

    A row is written with buffered writes and fsynced per batch, so a reader can find a
    part's last line only partly there: what follows the last newline is a write in
    progress, left for the next read (the sink itself truncates it as a torn write if it
    stopped there).
    """
    rows: list[dict[str, Any]] = []
    for part in sorted(out_dir.glob("*/part-*.jsonl")):
        data = part.read_bytes()
        whole = data[: len(data) - torn_tail(data)]
        rows.extend(json.loads(line) for line in whole.splitlines() if line.strip())
    return rows


def accepted_keys(out_dir: Path) -> Counter[str]:
    """How often each key appears in the training files."""
    return Counter(row["id"] for row in sink_rows(out_dir))


@dataclass
class DeadLetterView:
    """The dead-letter topic read to its end: one entry per record."""

    records: list[tuple[str, str, str]] = field(default_factory=list)  # key, stage, reason

    def keys(self) -> set[str]:
        """Every key with at least one dead letter."""
        return {k for k, _, _ in self.records}


async def read_dead_letters(settings: Settings) -> DeadLetterView:
    """Read every dead letter currently on the topic."""
    from services.dlq.app import read_dead_letters as read_all_dead_letters

    records = await read_all_dead_letters(settings)
    return DeadLetterView(
        [(r.key_text, r.header(s.DLQ_HEADERS.STAGE) or "?", r.header(s.DLQ_HEADERS.REASON) or "?") for r in records]
    )


async def read_conversations(settings: Settings) -> dict[str, s.ConversationProgressed]:
    """The latest state of every multi-turn conversation (``<dataset>:<conversation_id>``)."""
    from services.common.topics import read_to_end

    latest: dict[str, s.ConversationProgressed] = {}

    def keep(record: object) -> None:
        with suppress(s.SchemaError):
            latest[(getattr(record, "key", None) or b"").decode()] = s.decode(
                getattr(record, "value", None), s.ConversationProgressed
            )

    await read_to_end(settings.kafka, settings.kafka.topic(s.CONVERSATIONS_TOPIC), keep)
    return latest


def concluded(settings: Settings, rows: set[str], dead: set[str], conversations: dict[str, int]) -> dict[str, str]:
    """How each multi-turn conversation ended, for those that did: finished, ended early (why), dead letter."""
    states = asyncio.run(read_conversations(settings))
    out: dict[str, str] = {}
    for cid in conversations:
        state = states.get(cid)
        if state is not None and state.state != "in_progress":
            out[cid] = "finished" if state.state == "finished" else f"ended early: {state.reason}"
            continue
        key = f"{cid}:{0 if state is None else state.turns_done}"
        if key in dead and key not in rows:
            out[cid] = "stopped at a dead letter"
    return out


def conversation_ids(files: dict[str, Path]) -> dict[str, int]:
    """``<dataset>:<id>`` of every conversation of the multi-turn datasets (the bundled rows have ids)."""
    ids: dict[str, int] = {}
    for name in MULTI_TURN:
        for line in files[name].read_text("utf-8").splitlines():
            if line.strip():
                ids[f"{name}:{json.loads(line)['id']}"] = 1
    return ids


def count_prompts(files: dict[str, Path]) -> dict[str, int]:
    """Prompts in each bundled dataset (non-empty lines)."""
    return {
        name: sum(1 for line in path.read_text("utf-8").splitlines() if line.strip()) for name, path in files.items()
    }


def wait_accounted(
    settings: Settings, out_dir: Path, expected: int, procs: Processes, timeout: float, conversations: dict[str, int]
) -> None:
    """Block until accepted keys plus dead-lettered keys cover every published prompt.

    A multi-turn conversation counts once it finished, ended early, or stopped at a dead letter.
    """
    with Progress(
        TextColumn("accounted for", style="bold", markup=False),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("prompts", total=expected)
        deadline = time.monotonic() + timeout
        while True:
            procs.check_alive()
            accepted = set(accepted_keys(out_dir))
            dead = asyncio.run(read_dead_letters(settings)).keys()
            single = {k for k in accepted | dead if k.split(":", 1)[0] not in MULTI_TURN}
            done = len(single) + len(concluded(settings, accepted, dead, conversations))
            progress.update(task, completed=min(done, expected))
            if done >= expected:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {done} of {expected} prompts accounted for after {timeout:.0f} s")
            time.sleep(1.0)


def conversation_summary(settings: Settings, out_dir: Path, conversations: dict[str, int], dead: set[str]) -> None:
    """Print how the multi-turn conversations ended and how many rows (regenerated turns) they made.

    ``dead``: the keys whose last dead letter stands (not replayed since).
    """
    accepted = accepted_keys(out_dir)
    console.print(conversation_table(accepted, concluded(settings, set(accepted), dead, conversations), conversations))


def conversation_table(accepted: Counter[str], ends: dict[str, str], conversations: dict[str, int]) -> Table:
    """The multi-turn table: conversations per dataset, rows written, how they ended."""
    table = Table(title="multi-turn conversations: one row per regenerated turn")
    for col in CONVERSATION_COLUMNS:
        table.add_column(col, justify="left" if col in ("dataset", "how they ended") else "right", overflow="fold")
    for name in MULTI_TURN:
        outcomes = Counter(v for k, v in ends.items() if k.startswith(f"{name}:"))
        in_progress = sum(1 for k in conversations if k.startswith(f"{name}:")) - sum(outcomes.values())
        if in_progress:
            outcomes["in progress"] = in_progress
        rows = sum(1 for k in accepted if k.startswith(f"{name}:"))
        table.add_row(name, str(sum(1 for k in conversations if k.startswith(f"{name}:"))), str(rows),
                      ", ".join(f"{what} {n}" for what, n in outcomes.most_common()))
    return table


def summary(
    settings: Settings, out_dir: Path, published: dict[str, int], conversations: dict[str, int]
) -> tuple[Counter[str], DeadLetterView]:
    """Print accepted and dead-lettered per dataset, reasons, spend, and where the files are.

    For a multi-turn dataset ``published`` counts conversations; its accepted rows are turns.
    """
    accepted = accepted_keys(out_dir)
    view = asyncio.run(read_dead_letters(settings))
    dead_only = view.keys() - set(accepted)
    ends = {name: len(concluded(settings, set(accepted), view.keys(), {k: 1 for k in conversations
                                                                       if k.startswith(f"{name}:")}))
            for name in MULTI_TURN if name in published}
    reasons: Counter[tuple[str, str]] = Counter((stage, reason) for k, stage, reason in view.records if k in dead_only)
    for table in summary_tables(published, accepted, dead_only, ends, reasons):
        console.print(table)
    duplicates = sum(1 for n in accepted.values() if n > 1)
    console.print(f"duplicate keys in the training files: {duplicates}")
    console.print(f"training files: {shown(out_dir)}/<dataset>/part-*.jsonl")
    return accepted, view


def summary_tables(
    published: dict[str, int],
    accepted: Counter[str],
    dead_only: set[str],
    concluded_per_dataset: dict[str, int],
    reasons: Counter[tuple[str, str]],
) -> list[Table]:
    """Where every prompt ended, per dataset, and the dead letters by stage and reason.

    ``concluded_per_dataset``: for a multi-turn dataset, how many of its conversations ended.
    """
    table = Table(title="draftstream demo: where every prompt ended")
    for col in SUMMARY_COLUMNS:
        table.add_column(col, justify="right" if col != "dataset" else "left", overflow="fold")
    for name, n in published.items():
        acc = sum(1 for k in accepted if k.startswith(f"{name}:"))
        dead = sum(1 for k in dead_only if k.startswith(f"{name}:"))
        if name in concluded_per_dataset:
            done = concluded_per_dataset[name]
            table.add_row(f"{name} (turns)", f"{n} conv.", str(acc), str(dead), "yes" if done == n else "NO")
            continue
        table.add_row(name, str(n), str(acc), str(dead), "yes" if acc + dead == n else "NO")
    rt = Table(title="dead letters by stage and reason")
    rt.add_column("stage", overflow="fold")
    rt.add_column("reason", overflow="fold")
    rt.add_column("count", justify="right")
    for (stage, reason), n in reasons.most_common():
        rt.add_row(stage, reason, str(n))
    return [table, rt]


def subcommand_env(env: dict[str, str], width: int) -> dict[str, str]:
    """The environment of the subcommands whose tables the demo shows: laid out at the demo's own width."""
    return {**env, "COLUMNS": str(width)}


def run_demo(keep: bool = False, timeout: float = 600.0) -> int:
    """Run the demo end to end; returns the exit status."""
    started = time.monotonic()
    run_dir = REPO / ".run" / "demo"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    (run_dir / "logs").mkdir(parents=True)
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env = subcommand_env(env, console.width)  # the subcommands' tables fit the demo's terminal
    own_broker = False  # started here, so stopped here; a broker that was running stays running
    bootstrap = env.get("KAFKA_BOOTSTRAP_SERVERS")
    if not bootstrap:
        from services.common import broker

        status = broker.status()
        if status.running:
            console.print(f"using the local Kafka broker already running at {status.bootstrap}")
        else:
            console.print(styled("starting the local Kafka broker", "bold", " (first run downloads its jars)"))
            status = broker.start()
            console.print(f"Kafka {status.version} at {status.bootstrap}")
            own_broker = True
        bootstrap = status.bootstrap or "127.0.0.1:9092"
    sim_port = free_port()
    config = run_dir / "draftstream.toml"
    config.write_text(demo_config(run_dir, bootstrap, sim_port), encoding="utf-8")
    env["KAFKA_BOOTSTRAP_SERVERS"] = bootstrap
    settings = load_settings(config)
    procs = Processes(run_dir / "logs")
    files = {name: DATA / f"{name}.jsonl" for name in DATASETS}
    published = count_prompts(files)
    conversations = conversation_ids(files)
    try:
        console.print(styled("config", "bold", f" {shown(config)}"))
        run_cli(
            cli("topics", "create", "--config", str(config), *sum((["-d", d] for d in DATASETS), [])), env, "topics"
        )
        procs.start(
            "simulator",
            cli(
                "simulate-provider",
                "--config",
                str(config),
                "--port",
                str(sim_port),
                "--fault-rate",
                "429=0.15",
                "--fault-rate",
                "5xx=0.05",
                "--fault-rate",
                "truncate=0.03",
                "--fault-rate",
                "bad_usage=0.03",
                "--fault-rate",
                "noncanonical_len=0.02",
            ),
            env,
        )
        wait_http(f"http://127.0.0.1:{sim_port}/health", 60)
        for name in SERVICES:
            procs.start(name, cli("run", name, "--config", str(config)), env)
        started_what = f" simulator on :{sim_port} and {', '.join(SERVICES)} (logs in {shown(procs.log_dir)})"
        console.print(styled("started", "bold", started_what))
        for name, path in files.items():
            out = run_cli(cli("publish", str(path), "--dataset", name, "--config", str(config)), env, f"publish {name}")
            console.print(out.strip().splitlines()[-1] if out.strip() else f"published {name}")
        expected = sum(published.values())
        out_dir = Path(settings.sink.out_dir)
        wait_accounted(settings, out_dir, expected, procs, timeout, conversations)
        accepted, view = summary(settings, out_dir, published, conversations)
        conversation_summary(settings, out_dir, conversations, view.keys())
        show(run_cli(cli("budget", "--config", str(config)), env, "budget"))
        # Replay: inference dead letters were transient provider failures; send them again.
        retryable = {k for k, stage, _ in view.records if stage == "inference"} - set(accepted)
        if retryable:
            console.print(styled("replaying", "bold", f" {len(retryable)} inference dead letter(s)"))
            before = Counter(k for k, _, _ in view.records)
            standing = view.keys() - retryable
            show(run_cli(cli("dlq", "replay", "--stage", "inference", "--config", str(config)), env, "replay"))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                procs.check_alive()
                now_accepted = set(accepted_keys(out_dir))
                again = Counter(k for k, _, _ in asyncio.run(read_dead_letters(settings)).records)
                standing = {k for k in again if k not in retryable or again[k] > before[k]}
                # a replayed turn of a conversation goes on: wait for the conversation's end too
                ended = concluded(settings, now_accepted, standing, conversations)
                if all(k in now_accepted or again[k] > before[k] for k in retryable) and len(ended) == len(
                    conversations
                ):
                    break
                time.sleep(1)
            final = accepted_keys(out_dir)
            recovered = len(retryable & set(final))
            console.print(
                f"replay: {recovered} of {len(retryable)} replayed prompts are now accepted"
                + (
                    f", {len(retryable) - recovered} failed again (see `draftstream dlq list`)"
                    if recovered < len(retryable)
                    else ""
                )
            )
            console.print(
                f"duplicate keys in the training files after replay: {sum(1 for n in final.values() if n > 1)}"
            )
            conversation_summary(settings, out_dir, conversations, standing)
        else:
            console.print("no inference dead letters to replay this time")
        console.print(styled("demo finished", "bold green", f" in {time.monotonic() - started:.0f} s"))
        return 0
    except RuntimeError as exc:
        console.print(styled("demo failed:", "bold red", f" {exc}"))
        return 1
    finally:
        if not keep:
            procs.stop_all()
            if own_broker:
                from services.common import broker

                broker.stop()
