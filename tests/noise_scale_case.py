"""The gradient noise scale through the real engine, against the same estimator fed offline (tests).

    mpiexec -n 2 python -m mpi4py tests/noise_scale_case.py PACKED_SET

Every rank trains lenet on PACKED_SET with ``noise_scale`` on, and keeps a
float64 copy of its own gradient just before each allreduce (the flat
buffer's ``allreduce`` is wrapped). Rank 0 then gathers those copies and
feeds :class:`dimd.train.plan.noise.NoiseScale` offline with norms computed
from them in float64; the engine's per-epoch figures must match. Under
``python -m mpi4py`` a failed assert on any rank ends the job.
"""

import sys


def main(data: str) -> None:
    import numpy as np

    from dimd.mpi import init_mpi

    init_mpi("funneled")
    from mpi4py import MPI

    from dimd.train.config import TrainConfig
    from dimd.train.engine import train
    from dimd.train.flatgrad import FlatGradients
    from dimd.train.plan.noise import NoiseScale, noise_estimates_from_gradients

    comm = MPI.COMM_WORLD
    seen: list[np.ndarray] = []
    real_allreduce = FlatGradients.allreduce

    def allreduce(self, reduce, world_size):   # this rank's gradient, as the step computed it
        seen.append(self.grads.detach().double().numpy().copy())
        return real_allreduce(self, reduce, world_size)

    FlatGradients.allreduce = allreduce
    batch = 6
    config = TrainConfig(train=data, val=data, model="lenet", image_size=16, epochs=2, batch_size=batch, lr=0.1,
                         lr_scaling=False, schedule="constant", decode_threads=1, threads=1, noise_scale=True)
    result = train(config, comm)
    everyone = comm.gather(seen, root=0)
    if comm.Get_rank() != 0:
        return
    ranks = comm.Get_size()
    steps_per_epoch = result.steps_per_epoch
    offline = NoiseScale()
    per_epoch = []
    for step in range(len(seen)):
        grads = np.stack([everyone[r][step] for r in range(ranks)])          # P x D
        local = float(np.mean(np.einsum("pd,pd->p", grads, grads)))
        mean = grads.mean(axis=0)
        offline.update(local, float(mean @ mean), batch, ranks)
        # the scalar form the engine uses is the gradient form of the estimator
        g2, trace = noise_estimates_from_gradients(grads, batch)
        assert np.isclose(g2, (ranks * float(mean @ mean) - local) / (ranks - 1))
        if (step + 1) % steps_per_epoch == 0:
            per_epoch.append(offline.figures())
    assert len(per_epoch) == len(result.epochs) == 2
    for engine, expected in zip(result.epochs, per_epoch):
        assert engine.noise_steps == expected["noise_steps"]
        for key in ("noise_gradient_sqnorm", "noise_trace", "noise_scale"):
            got, want = getattr(engine, key), expected[key]
            assert (got is None) == (want is None), (key, got, want)
            if want is not None:
                assert np.isclose(got, want, rtol=1e-3, atol=1e-7), (key, got, want)
    assert result.epochs[-1].noise_scale is not None   # |G|^2's average has turned positive by then
    print(f"ok {len(seen)} steps; B_simple per epoch "
          + ", ".join(f"{e.noise_scale}" for e in result.epochs), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
