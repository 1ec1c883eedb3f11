"""The shell of ``draftstream estimate``: prompts from files, ids from the profile, spend from Kafka.

Each prompt is rendered as the server renders it (the dataset's profile: its chat template
and template kwargs, with the row's tools wherever it offers them: they reach the model by
one route or another, services/inference/tool_route.py) and its ids are
counted; a ``turns = "all"`` conversation counts one request per turn it regenerates;
responses already observed come from the budget service's checkpoints on the
``budget-state`` topic when a broker answers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
from aiokafka.errors import KafkaConnectionError

from schemas import GLOBAL_SCOPE, BudgetSnapshot, PromptPublished
from services.common.config import DatasetSettings, Settings
from services.common.errors import CommandError
from services.continuation.core import turn_points
from services.estimate.core import Caps, DatasetEstimate, EstimateReport, Observed, build_report
from services.inference.core import request_max_tokens
from services.inference.tool_route import can_write_in_text, renders_tools, rows_lines
from services.publish.core import DUPLICATE, NormaliseOptions
from services.publish.reading import PublishError, Rejection, check_arguments, iter_prompts

_BATCH = 64  # prompts tokenized per call


def turn_requests(prompt: PromptPublished) -> list[PromptPublished]:
    """Every request a prompt makes: one, or one per turn of a ``turns = "all"`` conversation.

    Turn k's history is the dataset's conversation up to its k-th answer: the dataset's own answers
    stand in for the model's, which the estimate cannot know (their length is the regenerated one's
    best guess before a run).
    """
    conv = prompt.conversation
    if conv is None:
        return [prompt]
    later = turn_points(conv.original)[1:]
    return [prompt, *(msgspec.structs.replace(prompt, messages=list(conv.original[:point])) for point in later)]


class Estimator:
    """Counts one dataset's prompts with its profile; :meth:`add` prompts, then read :attr:`estimate`."""

    def __init__(self, settings: Settings, dataset: str, observed: Observed | None = None) -> None:
        """Load the dataset's profile; a profile that cannot load is a :class:`CommandError`."""
        from services.profiles import ProfileError, load_profile

        self.dataset_settings: DatasetSettings = settings.dataset(dataset)
        name = self.dataset_settings.profile
        try:
            self.profile = load_profile(name, settings)
        except ProfileError as exc:
            raise CommandError(f"dataset {dataset}: profile {name}: {exc}") from None
        profile = self.profile
        in_text = can_write_in_text(lambda m, t: profile.render_prompt(m, t))
        self.estimate = DatasetEstimate(dataset=dataset, profile=name, observed=observed, tools_in_prompt=in_text)
        self._texts: list[str] = []
        self._limits: list[tuple[int, bool, bool]] = []

    def render(self, prompt: PromptPublished) -> str:
        """The prompt text the server would tokenize for this request (the row's tools in it, once)."""
        tools = prompt.tools if renders_tools(prompt) else None
        return self.profile.render_prompt(prompt.messages, tools, reasoning=prompt.conversation is not None)

    def add(self, prompt: PromptPublished) -> None:
        """Count one prompt's requests, every turn of a conversation (tokenized in batches)."""
        for request in turn_requests(prompt):
            self._texts.append(self.render(request))
            limit = request_max_tokens(request, self.dataset_settings.max_tokens)
            self._limits.append((limit, bool(request.tools), request.tools_in_text))
        if len(self._texts) >= _BATCH:
            self.flush()

    def flush(self) -> DatasetEstimate:
        """Tokenize what is buffered; returns the estimate so far."""
        if self._texts:
            for ids, (max_tokens, tools, in_text) in zip(
                self.profile.encode_prompt_batch(self._texts), self._limits, strict=True
            ):
                self.estimate.add(len(ids), max_tokens, tools_sent=tools, in_text=in_text)
            self._texts.clear()
            self._limits.clear()
        return self.estimate


def tool_lines(settings: Settings, est: DatasetEstimate) -> list[str]:
    """By which route the dataset's rows send their tools, and whether their calls can be proven."""
    fielded, own = est.tools_sent - est.tools_in_text, est.tools_in_text
    lines = rows_lines(settings, est.dataset, in_text=est.tools_in_prompt, fielded=fielded, own_text=own)
    return [line for line, _sound in lines]


@dataclass(frozen=True)
class DatasetFiles:
    """One dataset's input files and how to read them."""

    dataset: str
    paths: Sequence[Path]
    fmt: str = "auto"
    limit: int | None = None
    system: str | None = None
    tools_field: str | None = None


def estimate_files(settings: Settings, files: DatasetFiles, observed: Observed | None = None) -> DatasetEstimate:
    """Count every good row of a dataset's files (bad rows and duplicates are left out)."""
    paths = [Path(p) for p in files.paths]
    try:
        check_arguments(settings, paths, files.dataset, files.fmt)
    except PublishError as exc:
        raise CommandError(str(exc)) from None
    options = NormaliseOptions(
        dataset=files.dataset,
        fmt=files.fmt,
        system=files.system,
        tools_field=files.tools_field,
        max_prompt_chars=settings.provider.max_prompt_chars,
        turns=settings.dataset(files.dataset).turns,
    )
    estimator = Estimator(settings, files.dataset, observed)
    for item in iter_prompts(paths, options, limit=files.limit):
        if item is None:
            estimator.estimate.skip(DUPLICATE)
        elif isinstance(item, Rejection):
            estimator.estimate.skip(item.reason, str(item))
        else:
            estimator.add(item)
    return estimator.flush()


def observed_from(snapshots: dict[str, BudgetSnapshot]) -> dict[str, Observed]:
    """What the budget counted per scope, from its checkpoints."""
    return {
        scope: Observed(responses=snap.responses, completion_tokens=snap.completion_tokens, cost_usd=snap.cost_usd)
        for scope, snap in snapshots.items()
    }


async def read_observed(settings: Settings) -> dict[str, Observed] | None:
    """The budget's counts per scope, or None when no broker answers (the estimate then has bounds only)."""
    from services.control import read_budget_snapshots

    try:
        return observed_from(await read_budget_snapshots(settings))
    except KafkaConnectionError:
        return None


def report_for(
    settings: Settings, estimates: Iterable[DatasetEstimate], spent: dict[str, Observed] | None
) -> EstimateReport:
    """Dollars and cap checks at the configured prices and caps."""
    datasets = list(estimates)
    return build_report(
        datasets,
        model=settings.provider.model,
        prices=settings.budget.prices,
        caps={
            e.dataset: Caps(settings.dataset(e.dataset).cap_completion_tokens, settings.dataset(e.dataset).cap_usd)
            for e in datasets
        },
        global_caps=Caps(settings.budget.global_cap_completion_tokens, settings.budget.global_cap_usd),
        spent=spent or {},
        global_scope=GLOBAL_SCOPE,
        observations_read=spent is not None,
    )


__all__ = [
    "DatasetFiles",
    "Estimator",
    "estimate_files",
    "observed_from",
    "read_observed",
    "report_for",
    "turn_requests",
]
