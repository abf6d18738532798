"""The profile's progress bar: engine time used of the budget, and the cell now running."""

from __future__ import annotations

from types import TracebackType

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from tabletune.profile_twin import CellRun


class ProgressBar:
    """A rich bar on stderr; `update` is a `ProgressCallback`. Disabled: does nothing."""

    def __init__(self, budget_s: float, *, enabled: bool = True) -> None:
        self.budget_s = budget_s
        self.enabled = enabled
        self._progress: Progress | None = None
        self._task = 0

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]profile"), BarColumn(),
                TextColumn("{task.completed:.0f}/{task.total:.0f} engine s"),
                TextColumn("{task.description}"), TimeElapsedColumn(), transient=False)
            self._progress.start()
            self._task = self._progress.add_task("starting", total=self.budget_s)
        return self

    def update(self, used_s: float, cell: CellRun) -> None:
        if self._progress is None:
            return
        self._progress.update(
            self._task, completed=min(used_s, self.budget_s),
            description=f"cell c={cell.cell.concurrency} K={cell.cell.k} "
                        f"(best K there now {cell.chosen_k})")

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self.budget_s, description="done")
            self._progress.stop()
