"""Training: the loop, its two synchronisation strategies, the gradient exchange, and the run's files.

The batches come from :mod:`dimd.shuffle` (the data path ends there, on the
device); everything from the forward pass on is here. By job:

- the run: ``config`` (``TrainConfig``, the only defaults), ``rules`` (the
  rules between settings, each once), ``run_plan`` (the set-up: a config
  made into a frozen ``RunPlan``, each choice with its reason), ``engine``
  (``Trainer``: the loop), ``steps`` (one step and the
  ``Strategy`` interface), ``evaluate``, ``results`` (what a run reports),
  ``signals`` (a scheduler's SIGTERM/SIGUSR1 -> checkpoint and stop),
  ``hardware`` (threads and device), ``precision`` (32-bit or autocast);
- the strategies: ``sgd`` (``SSGD``, S-SGD: one learner per rank, the
  gradients averaged every step), ``sma`` (Crossbow's model averaging),
  ``learners`` (K replicas of one model in flat buffers), ``autotune``
  (Crossbow's learner count), ``batchnorm`` (statistics recomputed over the
  ranks);
- CUDA graphs: ``graphs`` (a step captured once and replayed; the CPU's
  stand-in), ``graphed_sgd`` and ``graphed_sma`` (the two strategies'
  steps as graphs);
- the gradients: ``flatgrad`` (every gradient in one buffer), ``buckets``
  (``GradientBuckets``: reduced while backward runs, through
  :mod:`dimd.allreduce`), ``distributed`` (``DistributedGradients`` for a
  user's own loop), ``noise`` (the gradient noise scale);
- models and schedules: ``models`` (the zoo), ``model_source`` (``--model
  file.py:build``), ``schedule`` (learning-rate rules as pure functions);
- checkpoints: ``checkpoint`` (the files, a run's save and resume),
  ``folderlock`` (one run per folder);
- a user's own script: ``launch`` (``dimd.init``: MPI, threads, device);
- ``plan`` (``dimd plan-batch``): the batch size and rank count, from
  measurements; it builds on training, never the reverse.

Importing this package is cheap; its modules import torch.
"""
