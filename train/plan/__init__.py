"""Choosing the mini-batch size and the rank count from measurements (Perrone et al.).

The time to reach a target is T_C(M, P) = N_update(M) * (Gamma(M/P) + Delta(P)):
updates to the target at global batch M, times the seconds per update on P
ranks. Each factor is fitted to its own measurement, one module each:

* ``steptime``: Gamma(m) = c + gamma * max(m, M_T), per-rank compute seconds per step
  (``measure`` times the real model; the fit is a pure function);
* ``commmodel`` and ``commfit``: Delta(P) per allreduce algorithm, a
  latency-bandwidth-reduction cost model of what dimd's implementation sends,
  fitted to ``bench-allreduce`` results and checked on rank counts held out;
* ``convergence``: N_update(M) = N_inf + alpha / M from runs to a target;
* ``solver``: M_opt(P), and T_C for optimal, strong and weak scaling;
* ``noise``: McCandlish et al.'s gradient noise scale B_simple, whose
  critical batch plays the part of alpha / N_inf.

Everything here except ``measure`` (torch) and ``plot`` (matplotlib, only
when asked) is numpy, and none of it prints or talks MPI by itself.
"""
