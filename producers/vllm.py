"""The vLLM hook: `--scheduler-cls producers.vllm.TableTuneScheduler`.

One class is all a user attaches. It records one step record per engine step and owns the
engine's table switch. vLLM does not adapt a custom scheduler class to async scheduling, so
`TableTuneScheduler(...)` returns an instance of a subclass of vLLM's `Scheduler` or
`AsyncScheduler`, whichever the final config asks for.

Per step, on the engine thread, the hook only reads two clocks, copies the sampled lengths and
appends one object to a queue; the recorder's background thread does the accounting
(producers/vllm_steps.py), framing and I/O. Telemetry failures are logged and counted, never
raised into vLLM: if TableTune cannot start, the engine runs as if it were not attached.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from functools import partial
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from controller.engine.table_switch import StagedTable, TableSwitch
from producers.identity import EngineIdentity, default_engine_id, drafter_name
from producers.ngram_proposer import lookup_range_from_env
from producers.proposer_link import (
    drafts_are_marked,
    runs_tabletune_proposer,
    unmark,
)
from producers.recorder import StepRecorder
from producers.sinks import sink_from_url
from producers.vllm_steps import RawStep, VllmRequests, build_step_fields
from schemas import DraftTable, TableError, TableKey
from schemas.settings import Settings, SettingsError

log = logging.getLogger(__name__)


def first_step_seq() -> int:
    """Where this engine process numbers its steps from: the start time in microseconds. An
    engine restarted under its old id (a pod's name, a fixed TABLETUNE_ENGINE_ID) then never
    numbers a step over one of its earlier run's, which the fitter would read as two
    different records for one step (a conflict) and keep out of every fit."""
    return time.time_ns() // 1000


class TableTuneHook:
    """Mixin over vLLM's scheduler; state lives in `_tt_*` attributes to avoid clashes."""

    DRAFT_MARKS = True
    """It strips and cuts the marked drafts of TableTune's proposer (proposer_link)."""

    _tt_recorder: StepRecorder | None
    _tt_switch: TableSwitch | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tt_recorder = None
        self._tt_switch = None
        self._tt_feed: Any = None
        self._tt_async = isinstance(self, AsyncScheduler)
        self._tt_schedules: deque[tuple[int, float, int, bool]] = deque(maxlen=8)
        self._tt_last_update: float | None = None
        self._tt_hook_errors = 0
        self._tt_build: Any = None
        """build_step_fields bound to this engine's request ledger (made on first use)."""
        self._tt_draft_match: tuple[list[str], list[int]] | None = None
        """The last drafts' request ids and match lengths (TableTune's proposer only)."""
        self._tt_marked = drafts_are_marked(self.vllm_config)
        """TableTune's proposer marks its drafts: strip them, whether or not set-up works."""
        self._tt_limits: tuple[int, tuple[int, ...] | None] = (self.num_spec_tokens, None)
        """The last schedule's K and budget: what its drafts are cut to."""
        try:
            self._tt_setup()
        except SettingsError as exc:  # names the variable: one line, no traceback
            log.error("TableTune refused to start, the engine runs without it: %s", exc)
            self._tt_recorder = None
        except Exception:
            log.exception("TableTune could not start; the engine runs without it")
            self._tt_recorder = None

    # ---- set-up ---------------------------------------------------------------------------
    def _tt_setup(self) -> None:
        config = self.vllm_config
        max_num_seqs = config.scheduler_config.max_num_seqs
        max_k = int(getattr(self, "num_spec_tokens", 0) or 0)
        lookup = getattr(self, "dynamic_sd_lookup", None)
        budgets = budget_support(config, self._tt_marked)
        if lookup is not None:
            startup = DraftTable.from_dense(list(lookup))
            self._tt_switch = TableSwitch(startup, max_k=max_k, max_batch=max_num_seqs,
                                          max_match=budgets[0])
        identity = engine_identity(config)
        settings = Settings.from_env()
        follow = bool(settings.bootstrap_servers) and self._tt_switch is not None
        sink_url = os.environ.get("TABLETUNE_SINK")
        if not sink_url and settings.bootstrap_servers:
            sink_url = "kafka://" + ",".join(settings.bootstrap_servers)
        tap = None
        if sink_url:
            sink: Any = sink_from_url(sink_url, settings)
            if follow:
                from controller.engine.watch import TapSink
                sink = tap = TapSink(sink)
            self._tt_recorder = StepRecorder(identity, sink, max_k=max(max_k, 1),
                                             first_step_seq=first_step_seq())
        else:
            log.warning("TableTune attached without TABLETUNE_SINK or TABLETUNE_BOOTSTRAP: "
                        "no telemetry is recorded")
        if follow:
            assert self._tt_switch is not None
            self._tt_feed = start_table_feed(settings, identity, self._tt_switch, max_num_seqs,
                                             tap)
        if self._tt_recorder is None:
            return
        from producers.metrics import engine_counters, serve_metrics
        try:
            serve_metrics("engine", lambda: engine_counters(self._tt_recorder,
                                                            self._tt_switch, self._tt_feed),
                          {"engine_id": identity.engine_id})
        except (OSError, ValueError) as exc:  # a taken port must not cost the engine its telemetry
            log.error("TableTune metrics endpoint not started: %s", exc)
        log.info("TableTune telemetry for %s -> %s (table switch: %s; budgets: %s)",
                 identity.engine_id, sink_url,
                 "on" if self._tt_switch else "off, no startup table",
                 budgets[1] if self._tt_switch else "off, no table switch")

    # ---- the table switch -----------------------------------------------------------------
    def stage_table(self, table: DraftTable, version: int, *, forced: bool = False
                    ) -> StagedTable:
        """Off the engine thread: validate and stage a table for the next schedule().

        Raises TableError (and changes nothing) when the engine was started without a
        table, or the table does not fit this engine.
        """
        if self._tt_switch is None:
            raise TableError("this engine was started without num_speculative_tokens_per_"
                             "batch_size; vLLM cannot switch tables on it")
        return self._tt_switch.stage(table, version, forced=forced)

    @property
    def table_switch(self) -> TableSwitch | None:
        return self._tt_switch

    @property
    def telemetry(self) -> StepRecorder | None:
        return self._tt_recorder

    # ---- per step (engine thread) ---------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        switch = self._tt_switch
        if switch is not None and switch.pending:
            staged = switch.apply_staged()
            if staged is not None:
                # One attribute store; vLLM reads it once per step in schedule().
                self.dynamic_sd_lookup = (list(staged.lookup) if staged.explorer is None
                                          else ExploringLookup(staged.lookup, switch))
        output = super().schedule(*args, **kwargs)
        if self._tt_marked:  # this step's drafts are cut to its K, or budget, on their return
            self._tt_limits = (output.num_spec_tokens_to_schedule,
                               switch.budget_for(len(output.num_scheduled_tokens))
                               if switch is not None else None)
        if self._tt_recorder is not None:
            version, forced = (switch.version, switch.step_forced) if switch else (0, False)
            self._tt_schedules.append((id(output), started, version, forced))
        return output

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        if self._tt_marked:
            matched = unmark(draft_token_ids.draft_token_ids, *self._tt_limits)
            # in the order of the request ids, which for list drafts is vLLM's live
            # input-batch list: copied, as vLLM reorders it later
            self._tt_draft_match = (list(draft_token_ids.req_ids), matched)
        super().update_draft_token_ids(draft_token_ids)

    def update_draft_token_ids_in_output(self, draft_token_ids: Any,
                                         scheduler_output: Any) -> None:
        if self._tt_marked:  # the same drafts on vLLM's deferred path: never a mark to vLLM
            unmark(draft_token_ids.draft_token_ids, *self._tt_limits)
        super().update_draft_token_ids_in_output(draft_token_ids, scheduler_output)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        recorder = self._tt_recorder
        if recorder is not None:
            try:
                self._tt_capture(recorder, scheduler_output, model_runner_output)
            except Exception:
                self._tt_hook_errors += 1
                if self._tt_hook_errors == 1:
                    log.exception("TableTune could not capture a step (counted, not raised)")
        return super().update_from_output(scheduler_output, model_runner_output)

    def _tt_capture(self, recorder: StepRecorder, output: Any, runner_output: Any) -> None:
        now = time.perf_counter()
        started, version, forced = now, 0, False
        key = id(output)
        # Newest first: ids of freed outputs are reused, and only the newest can be ours.
        for entry in reversed(self._tt_schedules):
            if entry[0] == key:
                _, started, version, forced = entry
                break
        sampled = runner_output.sampled_token_ids
        build = self._tt_build
        if build is None:
            build = self._tt_build = partial(build_step_fields,
                                             requests=VllmRequests(recorder.max_k))
        recorder.defer(build, RawStep(
            schedule_start_s=started,
            update_start_s=now,
            previous_update_start_s=self._tt_last_update,
            scheduler_output=output,
            sampled_lengths=list(map(len, sampled)) if sampled else [],
            req_id_to_index=runner_output.req_id_to_index,
            table_version=version,
            forced=forced,
            async_scheduling=self._tt_async,
            max_positions=recorder.max_k,
            ts_ns=time.time_ns(),
            draft_match=self._tt_draft_match,
        ))
        self._tt_last_update = now

    @property
    def table_feed(self) -> Any:
        return self._tt_feed

    def shutdown(self) -> None:
        recorder, self._tt_recorder = self._tt_recorder, None
        feed, self._tt_feed = self._tt_feed, None
        try:
            if feed is not None:
                feed.stop()
                feed.status.close()
            if recorder is not None:
                recorder.close(timeout_s=5.0)
        except Exception:
            log.exception("TableTune telemetry did not close cleanly")
        finally:
            super().shutdown()


class ExploringLookup(list):  # type: ignore[type-arg]
    """vLLM's dense lookup, answered by the switch so a bounded share of steps explores.

    vLLM indexes `dynamic_sd_lookup[batch_size]` once per step; this list answers through
    `TableSwitch.k_for_step`, which also sets `step_forced` for the step's telemetry."""

    def __init__(self, lookup: Any, switch: TableSwitch) -> None:
        super().__init__(lookup)
        self._switch = switch

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int):
            return self._switch.k_for_step(index)
        return super().__getitem__(index)


class TableTuneSyncScheduler(TableTuneHook, Scheduler):
    """The hook over vLLM's synchronous scheduler."""


class TableTuneAsyncScheduler(TableTuneHook, AsyncScheduler):
    """The hook over vLLM's async scheduler (GPU default)."""


class TableTuneScheduler:
    """What users attach: builds the hook over the scheduler the final config asks for."""

    DRAFT_MARKS = True
    """What it builds strips and cuts the marked drafts of TableTune's proposer."""

    def __new__(cls, vllm_config: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        if vllm_config.scheduler_config.async_scheduling:
            return TableTuneAsyncScheduler(vllm_config, *args, **kwargs)
        return TableTuneSyncScheduler(vllm_config, *args, **kwargs)


def budget_support(vllm_config: Any, marked: bool) -> tuple[int, str]:
    """(the switch's max match length, what the engine log says of budgets). Budgets need
    the drafts marked with their match lengths (`drafts_are_marked`): TableTune's n-gram
    proposer, under synchronous scheduling."""
    if marked:
        low, high = lookup_range_from_env()
        return high, f"on where published (TableTune's n-gram proposer, lookup {low}..{high})"
    if not runs_tabletune_proposer(vllm_config):
        return 0, "off, the drafter is not TableTune's n-gram proposer: tables apply"
    return 0, "off under async scheduling (--no-async-scheduling turns them on): tables apply"


def start_table_feed(settings: Settings, identity: EngineIdentity, switch: TableSwitch,
                     max_num_seqs: int, tap: Any = None) -> Any:
    """Follow the tables topic for this engine's key (TABLETUNE_TABLE_KEY overrides)."""
    from controller.engine.follower import TableFeed
    from controller.status import StatusPublisher
    from controller.validation import EngineLimits

    key_text = os.environ.get("TABLETUNE_TABLE_KEY")
    key = TableKey.parse(key_text) if key_text else TableKey(
        identity.model, identity.drafter, identity.hardware)
    limits = EngineLimits(key=key, startup_k_values=frozenset(switch.startup_table.k_values),
                          max_batch=max_num_seqs)
    status = StatusPublisher(settings, identity.engine_id, str(key))
    share = float(os.environ.get("TABLETUNE_EXPLORE_SHARE", "0.02"))
    return TableFeed(settings, switch, limits, status, explore_share=share, tap=tap).start()


def engine_identity(vllm_config: Any) -> EngineIdentity:
    """Engine id from the environment; model, drafter and hardware from vLLM's config."""
    model_config = vllm_config.model_config
    names = getattr(model_config, "served_model_name", None)
    if isinstance(names, list | tuple):
        names = names[0] if names else None
    model = str(names or model_config.model)
    if os.path.isabs(model):  # a local checkout: its folder name is the useful part
        model = os.path.basename(model.rstrip("/"))
    spec = vllm_config.speculative_config
    if spec is None:
        drafter = "none"
    else:
        draft_model = (spec.model if spec.method == "custom_class" else
                       getattr(getattr(spec, "draft_model_config", None), "model", None))
        drafter = drafter_name(str(spec.method), draft_model,
                               tabletune_proposer=runs_tabletune_proposer(vllm_config))
    return EngineIdentity(
        engine_id=default_engine_id(),
        model=model.replace("|", "_"),
        drafter=drafter.replace("|", "_"),
        hardware=(os.environ.get("TABLETUNE_HARDWARE") or device_name()).replace("|", "_"),
    )


def device_name() -> str:
    try:
        from vllm.platforms import current_platform
        name = current_platform.get_device_name()
        if name:
            return str(name)
    except Exception:  # platforms without a device name (CPU builds) fall through
        log.debug("no device name from vLLM", exc_info=True)
    import platform
    return platform.processor() or platform.machine() or "unknown"
