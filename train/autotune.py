"""Crossbow's auto-tuner (Algorithm 2, as its authors coded it): how many learners per rank.

Start with one learner per rank. After each measurement window compare the
throughput (images per second, all ranks) with the previous window's: if it
rose by more than ``threshold`` (relative; the first window always counts as
a rise), add a learner; otherwise remove one and stop tuning for good.

The tuner is pure bookkeeping: the engine measures the window identically on
every rank (the figures travel in the synchronisation's allreduce), so every
rank calls :meth:`AutoTuner.observe` with the same number and takes the same
decision at the same step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Decision:
    window: int             # 1-based
    throughput: float       # images per second over the window, all ranks
    rise: float | None      # relative to the previous window (None for the first)
    learners_before: int
    learners_after: int
    frozen: bool

    @property
    def change(self) -> int:
        return self.learners_after - self.learners_before

    def describe(self) -> str:
        rise = "first window" if self.rise is None else f"{self.rise:+.1%} over the previous window"
        if self.change > 0:
            action = f"adding a learner: {self.learners_after} per rank"
        elif self.change < 0:
            action = f"removing one: {self.learners_after} per rank; tuning stops"
        else:
            action = f"keeping {self.learners_after} per rank; tuning stops"
        return (f"auto-tune window {self.window}: {self.throughput:,.0f} img/s with "
                f"{self.learners_before} learner(s) per rank ({rise}); {action}")


@dataclass
class AutoTuner:
    threshold: float = 0.1
    max_learners: int = 64
    learners: int = 1
    previous: float = 0.0          # the previous window's throughput (0: none yet)
    frozen: bool = False
    decisions: list[Decision] = field(default_factory=list)

    def observe(self, throughput: float) -> Decision | None:
        """One window's throughput; returns the decision (None once tuning has stopped)."""
        if self.frozen:
            return None
        rise = None if self.previous <= 0 else (throughput - self.previous) / self.previous
        before = self.learners
        self.previous = throughput
        if rise is not None and rise <= self.threshold:
            self.learners = max(1, before - 1)       # back off to the last better count, for good
            self.frozen = True
        elif before < self.max_learners:
            self.learners = before + 1
        else:
            self.frozen = True                       # no room for another learner
        decision = Decision(window=len(self.decisions) + 1, throughput=throughput, rise=rise,
                            learners_before=before, learners_after=self.learners, frozen=self.frozen)
        self.decisions.append(decision)
        return decision

    def state_dict(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "max_learners": self.max_learners, "learners": self.learners,
                "previous": self.previous, "frozen": self.frozen,
                "decisions": [asdict(d) for d in self.decisions]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "AutoTuner":
        return cls(threshold=float(state["threshold"]), max_learners=int(state["max_learners"]),
                   learners=int(state["learners"]), previous=float(state["previous"]),
                   frozen=bool(state["frozen"]), decisions=[Decision(**d) for d in state["decisions"]])
