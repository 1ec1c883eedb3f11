"""Shared plumbing for the benchmarks: results, CLI entry, subprocess services, config files.

Every benchmark is a module with ``run(quick: bool) -> list[Result]``; :func:`main` gives
it the ``[--quick] [--result-file F]`` command line, prints its figures and writes its
rows as JSON for :mod:`bench.run`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
BOOTSTRAP = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")


@dataclass
class Result:
    """One row of the results table; ``target`` reads like ``>= 0.85`` (applied to ``ratio``)."""

    name: str
    value: float
    reference: float
    ratio: float
    target: str
    met: bool
    unit: str = ""
    spread: str = ""  # min-max of the per-round ratios when the ratio is a median of rounds

    def row(self) -> dict[str, Any]:
        """The row as ``bench/results.json`` stores it."""
        out = asdict(self)
        out.pop("unit")
        return out


def judge(ratio: float, target: str) -> bool:
    """Whether ``ratio`` meets a target written ``>= x`` or ``<= x``."""
    op, _, number = target.partition(" ")
    bound = float(number)
    return ratio >= bound if op == ">=" else ratio <= bound


def result(
    name: str, value: float, reference: float, ratio: float, target: str, unit: str = "", spread: str = ""
) -> Result:
    """A result row whose ``met`` is judged from ``ratio`` and ``target``."""
    return Result(name, value, reference, ratio, target, judge(ratio, target), unit, spread)


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    return float(statistics.median(values))


def spread(ratios: Sequence[float]) -> str:
    """``min-max`` of per-round ratios, for printing beside their median."""
    return f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else ""


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation."""
    data = sorted(values)
    if len(data) == 1:
        return data[0]
    pos = (len(data) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def print_results(results: Sequence[Result]) -> None:
    """Figures of one benchmark, ratio last."""
    for r in results:
        unit = f" {r.unit}" if r.unit else ""
        print(
            f"{r.name}: value {r.value:.4g}{unit}, reference {r.reference:.4g}{unit}, "
            f"ratio {r.ratio:.3f}{f' (rounds {r.spread})' if r.spread else ''} (target {r.target}) "
            f"{'MET' if r.met else 'MISSED'}",
            flush=True,
        )


def main(run: Callable[[bool], list[Result]], description: str) -> None:
    """Command line of one benchmark: ``[--quick] [--result-file F]``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds, not minutes)")
    parser.add_argument("--result-file", type=Path, help="write the result rows here as JSON")
    args = parser.parse_args()
    results = run(args.quick)
    print_results(results)
    if args.result_file is not None:
        args.result_file.write_text(json.dumps([asdict(r) for r in results]))


def unique_prefix(name: str) -> str:
    """A topic prefix no other run shares."""
    return f"bench-{name}-{uuid.uuid4().hex[:8]}."


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def write_config(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    """A TOML config file from ``{section: {key: value}}`` (one level of sub-tables allowed)."""
    lines: list[str] = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        nested = {k: v for k, v in values.items() if isinstance(v, dict)}
        for key, value in values.items():
            if not isinstance(value, dict):
                lines.append(f"{key} = {_toml_value(value)}")
        for key, sub in nested.items():
            lines.append(f"[{section}.{key}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in sub.items())
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def base_sections(
    prefix: str, *, provider_url: str, out_dir: Path, **extra: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Config sections every benchmark shares: broker, prefix, simulator provider, metrics off."""
    sections: dict[str, dict[str, Any]] = {
        "kafka": {"bootstrap_servers": BOOTSTRAP, "topic_prefix": prefix},
        "provider": {"kind": "simulator", "base_url": provider_url},
        "metrics": {
            "inference_port": 0,
            "reconstruct_port": 0,
            "audit_port": 0,
            "budget_port": 0,
            "sink_port": 0,
            "simulator_port": 0,
        },
        "sink": {"out_dir": str(out_dir)},
    }
    for section, values in extra.items():
        sections.setdefault(section, {}).update(values)
    return sections


class Proc:
    """A child process of the benchmark (a service or the simulator), stopped on exit."""

    def __init__(self, name: str, argv: list[str], log_dir: Path) -> None:
        self.name = name
        self.own_core = False  # set by simulator_proc(own_core=True) when the kernel allowed it
        self.log_path = log_dir / f"{name}.log"
        self._log = self.log_path.open("wb")
        env = dict(os.environ)
        env.setdefault("TOKENIZERS_PARALLELISM", "true")
        self.popen = subprocess.Popen(  # noqa: S603 - our own interpreter and module
            argv, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self.popen.pid

    def alive(self) -> bool:
        """True while the child runs."""
        return self.popen.poll() is None

    def check(self) -> None:
        """Raise (with the log's tail) when the child died."""
        if not self.alive():
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{tail}")

    def vm_hwm_kib(self) -> int:
        """Peak resident memory (VmHWM) of the child, KiB."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        return 0

    def cpu_seconds(self) -> float:
        """User + system CPU time the child has used so far."""
        return pid_cpu_seconds(self.pid)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        self._log.close()


def pid_cpu_seconds(pid: int) -> float:
    """User + system CPU time process ``pid`` has used so far (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def listener_pid(port: int) -> int | None:
    """The pid of the local process listening on TCP ``port`` (the broker, for CPU accounting), if visible."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in inodes:
                    return int(proc.name)
    return None


def stage_proc(stage: str, config: Path, log_dir: Path, name: str | None = None, profile: Path | None = None) -> Proc:
    """``python -m services.cli run <stage> --config F`` as a child process.

    With ``profile``, the child runs under cProfile and writes its stats there when it
    stops (SIGTERM stops a service gracefully, so the file is written).
    """
    argv = [PYTHON, "-m", "cProfile", "-o", str(profile)] if profile is not None else [PYTHON]
    return Proc(name or stage, [*argv, "-m", "services.cli", "run", stage, "--config", str(config)], log_dir)


def simulator_proc(
    log_dir: Path,
    port: int,
    *,
    latency: float = 0.0,
    jitter: float = 0.0,
    reasoning: str = "40-200",
    content: str = "20-120",
    extra: Sequence[str] = (),
    name: str = "simulator",
    own_core: bool = False,
    pinned: bool = False,
) -> Proc:
    """The provider simulator in its own process (so it never shares a worker's event loop).

    ``extra``: more ``simulate-provider`` options (e.g. a rate limit). ``own_core``: give it
    a core of its own (:func:`give_own_core`; ``pinned``: always the same one); whether that
    took is ``Proc.own_core``.
    """
    proc = Proc(
        name,
        [
            PYTHON,
            "-m",
            "services.cli",
            "simulate-provider",
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--latency",
            str(latency),
            "--jitter",
            str(jitter),
            "--reasoning-tokens",
            reasoning,
            "--content-tokens",
            content,
            *extra,
        ],
        log_dir,
    )
    proc.own_core = own_core and give_own_core(proc.pid, pinned=pinned)
    return proc


def simulator_core() -> int:
    """The core a pinned simulator runs on (:func:`give_own_core`): the last one."""
    return (os.cpu_count() or 1) - 1


def keep_off_simulator_core(pid: int) -> bool:
    """Keep every thread of process ``pid`` off :func:`simulator_core` (threads it starts later inherit).

    A real-time simulator preempts whatever runs on its core when a request wakes it; a
    worker preempted so waits on that core's run queue until the scheduler moves it, tens of
    ms (docs/bench-history.md, 2026-12-05). A provider runs on machines of its own and never takes a worker's
    core: pinned apart, neither does the simulator.
    """
    others = set(range(os.cpu_count() or 1)) - {simulator_core()}
    if not others:
        return False
    try:
        _each_thread(pid, lambda tid: os.sched_setaffinity(tid, others))
    except OSError as exc:
        print(f"process {pid}: not kept off the simulator's core ({exc})", flush=True)
        return False
    return True


def _each_thread(pid: int, do: Callable[[int], None]) -> None:
    """``do(thread id)`` for every thread process ``pid`` has now (the ones it starts later inherit)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        do(int(task.name))


def give_own_core(pid: int, *, pinned: bool = False) -> bool:
    """Run every thread of process ``pid`` round-robin real-time (threads it starts later inherit).

    The provider a simulator stands in for runs on machines of its own. Here it shares two
    cores with the pipeline, and the scheduler leaves it waiting on a run queue beside an
    idle core (measured in bench/README.md): the pipeline's figure then says as much about
    how a core is split as about the pipeline. A real-time task runs whenever it is
    runnable, on either core (``pinned``: on :func:`simulator_core` only), up to the
    kernel's real-time share (95 % by default); the other core stays the pipeline's. False
    when not permitted (no root, no CAP_SYS_NICE) or on one core: the benchmark then runs as
    before and says so.
    """
    if (os.cpu_count() or 1) < 2:
        return False
    def own_core(tid: int) -> None:
        os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(1))
        if pinned:
            os.sched_setaffinity(tid, {simulator_core()})

    try:
        _each_thread(pid, own_core)
    except OSError as exc:
        print(f"simulator: no core of its own ({exc}); it shares the cores with the pipeline", flush=True)
        return False
    return True


async def wait_until(
    predicate: Callable[[], Awaitable[bool]],
    timeout: float,
    interval: float = 0.1,
    what: str = "condition",
    procs: Sequence[Proc] = (),
) -> None:
    """Poll an async predicate until true; raise on timeout or when a child process died."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            p.check()
        if await predicate():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


async def wait_simulator(base_url: str, proc: Proc, timeout: float = 60.0) -> None:
    """Wait until the simulator answers ``/health``."""
    async with httpx.AsyncClient(timeout=2.0) as client:

        async def up() -> bool:
            try:
                return (await client.get(f"{base_url}/health")).status_code == 200
            except httpx.HTTPError:
                return False

        await wait_until(up, timeout, 0.2, "the simulator", [proc])


async def sim_stats(client: httpx.AsyncClient, base_url: str, after: float | None = None) -> dict[str, Any]:
    """``GET /_sim/stats?brief=1`` (with ``requests_after`` when ``after`` is given): the counters
    without the per-key tables, which would cost the simulator's loop tens of milliseconds a poll."""
    params = {"brief": "1"} | ({"after": repr(after)} if after is not None else {})
    response = await client.get(f"{base_url}/_sim/stats", params=params)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def write_prompts(path: Path, ids: Sequence[str], texts: Sequence[str]) -> Path:
    """A JSONL file of OpenAI-style prompts with their own ids (publish keeps them)."""
    with path.open("w") as f:
        for sample_id, text in zip(ids, texts, strict=True):
            f.write(json.dumps({"id": sample_id, "messages": [{"role": "user", "content": text}]}) + "\n")
    return path


def prompt_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct short user prompts."""
    topics = ("primes", "matrices", "sorting", "graphs", "probability", "geometry", "strings", "series")
    return [f"Question {seed}-{i}: explain {topics[i % len(topics)]} with an example (case {i})." for i in range(n)]


@contextlib.contextmanager
def workdir(name: str) -> Iterator[Path]:
    """A scratch directory for configs, logs and files; kept when BENCH_KEEP is set."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
    try:
        yield path
    finally:
        if os.environ.get("BENCH_KEEP"):
            print(f"(kept {path})", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def processes() -> Iterator[list[Proc]]:
    """A list to register child processes in; every one is stopped on exit."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                p.stop()


async def delete_topics(prefix: str) -> None:
    """Remove a run's topics (best effort) so benchmark runs do not pile up on the broker."""
    from services.common.config import KafkaSettings
    from services.common.kafka import make_admin

    admin = make_admin(KafkaSettings(bootstrap_servers=BOOTSTRAP, topic_prefix=prefix))
    await admin.start()
    try:
        names = [t for t in await admin.list_topics() if t.startswith(prefix)]
        if names:
            await admin.delete_topics(names)
    except Exception as exc:  # noqa: BLE001 - cleanup only
        print(f"(could not delete topics of {prefix}: {exc})", file=sys.stderr)
    finally:
        await admin.close()


def seeds_settings(prefix: str, base_url: str, cap: int, max_tokens: int, **sections: dict[str, Any]) -> Any:
    """Settings for one capped ``seeds`` dataset on the test broker, the simulator at ``base_url``.

    ``sections``: more values per section (``provider`` is merged over the simulator's).
    """
    from services.common.config import load_settings

    provider = {"kind": "simulator", "base_url": base_url, **sections.pop("provider", {})}
    return load_settings(
        None,
        kafka={"bootstrap_servers": BOOTSTRAP, "topic_prefix": prefix},
        metrics={f"{s}_port": 0 for s in ("inference", "reconstruct", "audit", "budget", "sink", "simulator")},
        provider=provider,
        datasets={"seeds": {"cap_completion_tokens": cap, "max_tokens": max_tokens}},
        **sections,
    )


async def publish_seeds(settings: Any, prompts: int) -> None:
    """``prompts`` small prompts on the ``seeds`` dataset's topic (created first)."""
    from schemas import Message, PromptPublished, encode, sample_key
    from services.common.kafka import Outgoing, ensure_topics, make_producer, publish_all

    await ensure_topics(settings.kafka, settings.datasets)
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        topic = settings.kafka.prompts_topic("seeds")
        rows = [
            PromptPublished(dataset="seeds", sample_id=f"s{i}", messages=[Message(role="user", content=f"task {i}")])
            for i in range(prompts)
        ]
        await publish_all(
            producer, [Outgoing(topic, encode(p), sample_key(p.dataset, p.sample_id).encode()) for p in rows]
        )
    finally:
        await producer.stop()
