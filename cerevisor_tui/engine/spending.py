"""The run's budget as a policy (`[run] budget_usd`; what is spent is counted by the attempt owner's `Budget`):
at 80% a notice; at all of it admissions pause (running agents and requests finish, nothing is killed), a
gateway session's next request is refused, and a foreground run with no console attached ends once what runs
has finished. The operator may resume past it."""

from __future__ import annotations

from collections.abc import Callable

from cerevisor_tui.contract import events as ev
from cerevisor_tui.engine.attempt import Budget
from cerevisor_tui.engine.caps import Caps
from cerevisor_tui.engine.clock import Clock
from cerevisor_tui.engine.roster import RunLife
from cerevisor_tui.kinds import FinalStatus


class BudgetPolicy:
    def __init__(self, budget: Budget, run_id: str, caps: Caps, life: RunLife, emit: Callable[[ev.Event], None],
                 stop: Callable[[str, FinalStatus], None], clock: Clock) -> None:
        self.budget = budget
        self.run_id = run_id
        self.caps = caps
        self.life = life
        self.emit = emit
        self.stop = stop
        self.clock = clock
        self.spent_at: float | None = None  # what was spent when the budget paused admissions; None: it has not
        # How many consoles are attached, for a run in the foreground (`run`): once its budget is spent and what
        # runs has finished, with none attached to resume it, it ends. None: the run's consoles are expected (a
        # detached run, a console's own): a spent budget waits for one to resume or stop it.
        self.consoles_attached: Callable[[], int] | None = None
        budget.on_near, budget.on_reached = self.near, self.reached

    def reached(self, spent_usd: float) -> None:
        self.caps.pause()
        self.spent_at = spent_usd
        then = (" With no console attached by the time they have, the run ends there: the agents not admitted are "
                "skipped." if self.consoles_attached is not None else "")
        self.emit(ev.RunNotice(self.clock.now(), f"Budget reached: ${spent_usd:.4f} of ${self.budget.limit_usd:g} "
                               f"spent. No new agent is admitted; running agents finish.{then} Resume (p, in a console: "
                               f"cerevisor-tui attach {self.run_id}) to go on past it, or stop the run "
                               f"(cerevisor-tui stop {self.run_id}).", "warning", "Budget reached"))
        self.end_if_spent()

    def near(self, spent_usd: float) -> None:
        """80% of the budget is spent: said once, before admissions pause at all of it."""
        limit = self.budget.limit_usd
        self.emit(ev.RunNotice(self.clock.now(), f"Budget: ${spent_usd:.4f} of ${limit:g} spent ({spent_usd / limit:.0%}). "
                               "At all of it no new agent or session request is admitted.", "warning", "Budget"))

    def start(self) -> None:
        """The run begins: a resumed run that had already spent its budget is held by it at once."""
        if 0 < self.budget.limit_usd <= self.budget.spent_usd:
            self.reached(self.budget.spent_usd)

    def resumed(self) -> None:
        """The operator resumed: past the budget, the operator's call, the run goes on."""
        self.spent_at = None

    def refusal(self) -> str:
        """Why a gateway session's request is refused for the run's budget ("" when it is not): held by the budget
        and not resumed past it by the operator."""
        if self.spent_at is None or not self.caps.scheduler.paused:
            return ""
        return (f"the run's budget is spent (${self.budget.spent_usd:.4f} of ${self.budget.limit_usd:g}, "
                "[run] budget_usd); the operator may resume past it")

    def end_if_spent(self) -> None:
        """A foreground run held by its spent budget, with nothing running and no console attached to resume it,
        waits for no one: it ends, and the agents it never admitted are skipped, with the budget as the reason."""
        scheduler, life = self.caps.scheduler, self.life
        if (self.spent_at is None or self.consoles_attached is None or not scheduler.paused
                or scheduler.running or life.stopping or life.ended or self.consoles_attached()):
            return
        self.stop(f"budget reached (${self.spent_at:.4f} of ${self.budget.limit_usd:.4f})", "skipped")
