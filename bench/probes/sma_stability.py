"""SMA's update on a quadratic without noise: the largest stable rate for learner and central momentum.

L identical learners on f(w) = h w^2 / 2 take Crossbow's learner step (momentum mu) and correction
(alpha, pre-step weights), and z its update with central momentum mu_c. The printed figure is the
smallest lr*h in (0, 4] at which |w| + |z| grows past 1e6 within 2,000 steps (plain momentum SGD:
2 (1 + mu) = 3.8 at mu = 0.9). docs/sma.md, "Why no central momentum by default", quotes it.

    python bench/probes/sma_stability.py
"""

from __future__ import annotations

import numpy as np


def grows(rate: float, mu: float, mu_c: float, alpha: float, learners: int, steps: int = 2000) -> bool:
    w, v, z, previous = 1.0, 0.0, 1.0, 0.0
    for _ in range(steps):
        v = mu * v - rate * w
        pre = w
        w = w + v - alpha * (pre - z)
        delta = alpha * learners * (pre - z) + mu_c * previous
        previous, z = delta, z + delta
        if abs(w) + abs(z) > 1e6:
            return True
    return False


def first_unstable(mu: float, mu_c: float, alpha: float, learners: int) -> float | None:
    for rate in np.linspace(0.005, 4.0, 800):
        if grows(float(rate), mu, mu_c, alpha, learners):
            return round(float(rate), 2)
    return None


def main() -> None:
    print("learners  alpha   mu   mu_c  first unstable lr*h (None: stable up to 4)")
    for learners in (2, 4, 8):
        for mu, mu_c in ((0.9, 0.9), (0.9, 0.0), (0.0, 0.9), (0.0, 0.0)):
            alpha = 1 / learners
            print(f"{learners:8d}  {alpha:5.3f}  {mu:3.1f}  {mu_c:4.1f}  {first_unstable(mu, mu_c, alpha, learners)}")


if __name__ == "__main__":
    main()
