"""Random image augmentation on the host that keeps dpax's promise.

Each example's randomness is drawn from (seed, step, its position in the
GLOBAL batch), like dropout's masks: every process draws the whole global
batch's offsets and flips and applies the rows it holds, so the augmented
batch of a step is the same for any device or process count, and a new
epoch (another step) gives new crops.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dpax.errors import DpaxError

KINDS = ("crop", "flip")
STREAM = 0xA06  # keeps these draws apart from the batch order's (seed, epoch)


@dataclasses.dataclass(frozen=True)
class Augment:
    """`crop`: pad `pad` zeros on each side and cut a random window of the
    original size; `flip`: mirror left-right with probability 1/2."""

    crop: bool = False
    flip: bool = False
    pad: int | None = None  # default: an eighth of the image side (4 for 32x32)

    def __call__(self, x: np.ndarray, seed: int, step: int, first: int,
                 batch_size: int) -> np.ndarray:
        """Rows `first..first+len(x)` of global batch `step` (NHWC), augmented;
        rows past the batch (padding) are left as they are."""
        self.check(x.shape[1:])
        rng = np.random.default_rng([seed, STREAM, step])
        side = x.shape[1:3]
        pad = self.pad if self.pad is not None else max(1, min(side) // 8)
        # Drawn for the whole global batch, whichever rows this process holds.
        offsets = rng.integers(0, 2 * pad + 1, size=(batch_size, 2))
        flips = rng.random(batch_size) < 0.5
        out = x.copy()
        padded = np.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0))) if self.crop else None
        for i in range(min(len(x), batch_size - first)):
            g = first + i  # the example's position in the global batch
            if self.crop:
                oy, ox = offsets[g]
                out[i] = padded[i, oy:oy + side[0], ox:ox + side[1]]
            if self.flip and flips[g]:
                out[i] = out[i, :, ::-1]
        return out


    def check(self, input_shape: tuple[int, ...]) -> None:
        """Refuse inputs that are not images, before a run starts."""
        if len(input_shape) != 3:
            raise DpaxError(f"augmentation needs images (examples of shape HxWxC), got "
                            f"examples of shape {tuple(input_shape)}; drop `augment`")


def parse(spec: str | None) -> Augment | None:
    """`crop,flip` (any of `KINDS`, comma separated) as an Augment; None or
    empty: no augmentation."""
    if not spec:
        return None
    kinds = [k.strip() for k in spec.split(",")]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise DpaxError(f"unknown augmentation {unknown[0]!r} in `augment={spec}`; "
                        f"choose from {', '.join(KINDS)}, e.g. crop,flip")
    return Augment(crop="crop" in kinds, flip="flip" in kinds)
