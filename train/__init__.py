"""Training: models, schedules, the S-SGD engine, checkpoints, evaluation.

``models`` (the zoo), ``schedule`` (learning-rate rules as pure functions),
``flatgrad`` (all gradients in one buffer), ``sgd`` (one synchronous step),
``engine`` (the run's set-up and loop), ``checkpoint`` (the files, and a run's
save and resume), ``results`` (the records a run reports), ``hardware`` (threads
and device), ``evaluate``, ``signals`` (SIGTERM/SIGUSR1 -> checkpoint and exit), ``filesource``
(the read-the-original-files baseline), ``config`` (the frozen run configuration).
Importing this package is cheap; its modules import torch.
"""
