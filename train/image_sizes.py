"""Progressive resizing: the training crop grows from START to END px between two epochs (FFCV's recipe).

Early epochs learn as much from small images at a fraction of the pixels, so
FFCV trains ResNet-50 at 160 px rising to 192 px, and tests larger still (the
train-test resolution effect: a random-resized crop shows objects larger than
the centre crop of the same size does). ``START:END[:FIRST:LAST]``:

- epochs up to FIRST train at START px, epochs from LAST on at END px;
- between them the size follows the straight line from (FIRST, START) to
  (LAST, END), rounded to the nearest multiple of the model's step (FFCV's
  ``get_resolution``), so the batch shapes, and the CUDA graphs captured for
  them, are few;
- FIRST and LAST are epoch numbers counted from 0 (the loader's and FFCV's);
  left out, the ramp spans the whole run, from the first epoch to the last.

The step is what the model's downsampling tolerates (:func:`size_step`): 32 px
for the ImageNet networks of the zoo (five stride-2 stages), 8 px for the CIFAR
ones. The schedule is parsed and checked once (:func:`parse_size_schedule`);
:meth:`SizeSchedule.check_short_side` checks it against the packed set before
the data loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from dimd.errors import ConfigError, DimdError

#: The config field (``--image-size-schedule``) the messages name.
FIELD = "image_size_schedule"
#: Steps in px: for a model designed at ImageNet's size, and for the others (a user's model included).
IMAGENET_STEP, SMALL_STEP = 32, 8
#: The design size from which a zoo model counts as an ImageNet network.
IMAGENET_DESIGN_SIZE = 224


def size_step(model: str) -> int:
    """The px a model's training size moves by: 32 for the zoo's ImageNet networks (their five stride-2 stages
    leave a 7 x 7 grid at 224 px), 8 for the CIFAR-size ones and a user's own model (whose strides dimd
    cannot know)."""
    from dimd.train.models import MODELS

    spec = MODELS.get(model)
    return IMAGENET_STEP if spec is not None and spec.image_size >= IMAGENET_DESIGN_SIZE else SMALL_STEP


@dataclass(frozen=True)
class SizeSchedule:
    """The training crop of each epoch: ``start`` px up to epoch ``first``, ``end`` px from epoch ``last``,
    multiples of ``step`` between (see the module's docstring)."""

    start: int
    end: int
    first: int
    last: int
    step: int

    def size(self, epoch: int) -> int:
        """The training crop of ``epoch`` (counted from 0), in px."""
        if epoch <= self.first:
            return self.start
        if epoch >= self.last:
            return self.end
        on_line = self.start + Fraction(self.end - self.start) * (epoch - self.first) / (self.last - self.first)
        return self.step * math.floor(on_line / self.step + Fraction(1, 2))   # the nearest multiple, halves up

    __call__ = size

    @property
    def largest(self) -> int:
        """The largest crop: what the loader's batch slots are sized for."""
        return self.end

    def sizes(self, epochs: int) -> list[int]:
        """The distinct sizes a run of ``epochs`` epochs trains at, in order (a CUDA graph each)."""
        return sorted({self.size(epoch) for epoch in range(epochs)})

    def check_short_side(self, short_side: int, path: str) -> None:
        """Refuse, in one line, a schedule whose crops would be larger than the packed images' shorter side
        (every crop an upscaled, blurred region): before the data loads."""
        if self.end > short_side:
            raise DimdError(f"`{FIELD}` ends at {self.end} px, past the packed short side of {path} "
                            f"({short_side} px); end at {short_side - short_side % self.step} px or pack "
                            f"with a larger --short-side")

    def __str__(self) -> str:
        return f"{self.start}:{self.end}:{self.first}:{self.last}"


def parse_size_schedule(text: str, *, model: str, epochs: int, field: str = FIELD) -> SizeSchedule:
    """``START:END[:FIRST:LAST]`` for ``model`` over ``epochs`` epochs; a :class:`ConfigError` naming
    ``field`` for one that does not parse, shrinks, is not a multiple of the model's step, or ends its
    ramp after the run."""
    parts = text.split(":")
    try:
        numbers = [int(part) for part in parts]
    except ValueError:
        numbers = []
    if len(numbers) not in (2, 4):
        raise ConfigError(field, f"must be START:END or START:END:FIRST:LAST in px and epochs (got {text!r})")
    step = size_step(model)
    start, end = numbers[:2]
    first, last = numbers[2:] if len(numbers) == 4 else (0, epochs - 1)
    from dimd.train.models import image_size_problem

    too_small = image_size_problem(model, start) if start >= step else f"must start at {step} px at least for {model}"
    if too_small:
        raise ConfigError(field, f"{too_small.split(' (got')[0]} (got {text!r})")
    if end < start:
        raise ConfigError(field, f"must not shrink: START {start} px is above END {end} px (got {text!r})")
    off_step = [size for size in (start, end) if size % step]
    if off_step:
        raise ConfigError(field, f"must be in steps of {step} px for {model}: {off_step[0]} px is not a "
                                 f"multiple of {step} (got {text!r})")
    if not 0 <= first <= last:
        raise ConfigError(field, f"needs 0 <= FIRST <= LAST epochs (got {text!r})")
    if last >= epochs:
        raise ConfigError(field, f"ends its ramp at epoch {last}, after the run's last epoch ({epochs - 1}, "
                                 f"counted from 0) (got {text!r})")
    return SizeSchedule(start, end, first, last, step)
