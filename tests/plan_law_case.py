"""``dimd ARGS`` with the validation score replaced by a known law: 1 once a run has taken N_inf + alpha/M steps.

For tests of ``plan-batch convergence`` under MPI whose updates-to-target
must come out exactly (the real engine trains; only the score is set)::

    mpiexec -n 2 python tests/plan_law_case.py N_INF ALPHA plan-batch convergence TRAIN --val VAL ...
"""

import sys


def main() -> None:
    n_inf, alpha = float(sys.argv[1]), float(sys.argv[2])

    from dimd.cli import main as dimd
    from dimd.train.engine import Trainer
    from dimd.train.evaluate import EvalResult

    def evaluate(trainer: Trainer) -> EvalResult:
        reached = trainer.step >= n_inf + alpha / trainer.global_batch
        return EvalResult(loss=0.0, top1=1.0 if reached else 0.0, top5=1.0, samples=1, seconds=0.0)

    Trainer.evaluate = evaluate  # type: ignore[method-assign]
    dimd(args=sys.argv[3:], prog_name="dimd")


if __name__ == "__main__":
    main()
