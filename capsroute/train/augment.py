"""Training augmentations of `capsroute train`, on whole batches with torch ops.

  translate(images, dy, dx)              each image moved by its own whole-pixel shift, zero filled
  efficient_capsnet(images, generator)   the official Efficient-CapsNet MNIST generator's
                                         rotation, shift, squish and erasure

(batching.shift_augment, the CapsNet paper's random shift, draws its shifts and calls translate.)
Every random number is drawn on the CPU from the generator given, so an augmented batch is a
function of the generator's state whatever the images' device: a resumed run augments exactly as
an uninterrupted one.
"""

import functools

import torch
import torch.nn.functional as F
from torch import Tensor


def translate(images: Tensor, dy: Tensor, dx: Tensor) -> Tensor:
    """out[n, :, i, j] = images[n, :, i - dy[n], j - dx[n]], 0 where that falls outside the image.

    images (N, C, H, W), any dtype; dy, dx (N,) whole numbers on the images' device."""
    n, c, h, w = images.shape
    rows = torch.arange(h, device=images.device) - dy[:, None]  # (N, H): the source rows
    cols = torch.arange(w, device=images.device) - dx[:, None]
    inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
    out = images.gather(2, rows.clamp(0, h - 1)[:, None, :, None].expand(n, c, h, w))
    out = out.gather(3, cols.clamp(0, w - 1)[:, None, None, :].expand(n, c, h, w))
    return out.masked_fill(~inside[:, None], 0)


# The official generator's random amounts: a = N(0, 0.33) clipped into (-1, 1), or |a|.
AMOUNT_STD = 0.33
MAX_AMOUNT = 0.9999
MAX_ROTATION_DEGREES = 30
ERASED = 4  # the side of the erased patch, in pixels
# Where the patch may start: rows (and columns) BORDER .. size - BORDER - 2, the official 4 .. 22.
ERASE_BORDER = 4


def efficient_capsnet(images: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """The augmentation of the official Efficient-CapsNet MNIST training data, in its order, each
    image with its own random amounts (a = N(0, 0.33) clipped into (-1, 1)):

    1. rotation, of half of the images: by int(30 a) degrees counterclockwise about the pixel
       (W/2, H/2), bilinear, zeros outside (OpenCV's warpAffine);
    2. shift: along each axis, towards a random side, by floor(|a| m) pixels, m the blank margin
       on that side of the ink (plus one towards the bottom or right), so the ink stays inside;
    3. squish: the width resampled to W - w, w = 1 + floor(|a| W / 4) (1..7 of 28), by a
       Lanczos-3 filter widened for the reduction (TensorFlow's antialiased LANCZOS3 resize), the
       rows placed floor(w / 2) + floor(2 |a'|) columns from the left;
    4. erasure: a 4x4 patch zeroed at a uniform row and column in 4 .. H - 6 (4 .. 22 of 28).

    images: (N, C, H, W) float, the channels moved together. Returns a new tensor.
    """
    n, _, h, w = images.shape
    normal = torch.randn(n, 6, generator=generator).mul_(AMOUNT_STD).clamp_(-MAX_AMOUNT, MAX_AMOUNT)
    uniform = torch.rand(n, 4, generator=generator)
    normal, uniform = normal.to(images.device), uniform.to(images.device)
    magnitude = normal.abs()
    degrees = (normal[:, 0] * MAX_ROTATION_DEGREES).trunc()
    rotated = _rotate(images, degrees, normal[:, 1] <= 0)
    shifted = _shift_inside(rotated, magnitude[:, 2:4], uniform[:, :2] < 0.5)
    squished = _squish(shifted, magnitude[:, 4], magnitude[:, 5])
    positions = torch.tensor([h, w], device=images.device) - 2 * ERASE_BORDER - 1
    return _erase(squished, ERASE_BORDER + (uniform[:, 2:] * positions).floor().long())


def _rotate(images: Tensor, degrees: Tensor, rotate: Tensor) -> Tensor:
    """Each image where `rotate` turned by its `degrees` counterclockwise about (W/2, H/2)."""
    n, c, h, w = images.shape
    theta = torch.deg2rad(degrees.to(torch.float64))
    cos, sin = theta.cos()[:, None, None], theta.sin()[:, None, None]
    # warpAffine maps each output pixel back to its source: the inverse rotation about the centre.
    dy = torch.arange(h, dtype=torch.float64, device=images.device)[:, None] - h / 2
    dx = torch.arange(w, dtype=torch.float64, device=images.device)[None, :] - w / 2
    src_x = cos * dx - sin * dy + w / 2
    src_y = sin * dx + cos * dy + h / 2
    # grid_sample's coordinates (align_corners=False): pixel centres at (2 i + 1) / size - 1.
    grid = torch.stack([(2 * src_x + 1) / w - 1, (2 * src_y + 1) / h - 1], dim=-1)
    turned = F.grid_sample(
        images, grid.to(images.dtype), mode="bilinear", padding_mode="zeros", align_corners=False
    )
    return torch.where(rotate[:, None, None, None], turned, images)


def _shift_inside(images: Tensor, amounts: Tensor, forward: Tensor) -> Tensor:
    """Each image shifted down or up (forward[:, 0]), right or left (forward[:, 1]) by amounts
    (N, 2) in [0, 1) of the blank margin on that side of its ink (+1 down or right)."""
    _, _, h, w = images.shape
    shifts = []
    for axis, size, amount, ahead in (
        (2, h, amounts[:, 0], forward[:, 0]),
        (3, w, amounts[:, 1], forward[:, 1]),
    ):
        ink = images.sum(dim=(1, 5 - axis)) > 0  # (N, size): rows (axis 2) or columns with ink
        before = ink.int().argmax(1)  # blank lines before the first ink; 0 for a blank image
        after = ink.flip(1).int().argmax(1)
        shifts.append(
            torch.where(ahead, (amount * (after + 1)).floor(), (-amount * before).floor()).long()
        )
    return translate(images, *shifts)


def _squish(images: Tensor, width_amount: Tensor, offset_amount: Tensor) -> Tensor:
    """Each image's width resampled to W - w, w = 1 + floor(|a| W / 4), and placed
    floor(w / 2) + floor(2 |a'|) columns from the left: one (W, W) matrix per image."""
    w = images.shape[-1]
    narrowing = (width_amount * (w / 4) + 1).floor().long()  # 1 .. W / 4
    offset_extra = (offset_amount * 2).floor().long()  # 0 or 1
    table = _squish_matrices(w).to(images.device, images.dtype)  # (W/4 + 1, 2, W, W)
    matrices = table[narrowing, offset_extra]  # (N, W out, W in)
    return torch.einsum("nchi,noi->ncho", images, matrices)


@functools.lru_cache
def _squish_matrices(w: int) -> Tensor:
    """[narrowing, extra offset] -> the (W out, W in) matrix that resamples a row to W - narrowing
    columns and places them floor(narrowing / 2) + extra columns from the left."""
    table = torch.zeros(w // 4 + 1, 2, w, w, dtype=torch.float64)
    for narrowing in range(1, w // 4 + 1):
        resample = _lanczos3_resize_matrix(w, w - narrowing)
        for extra in (0, 1):
            start = narrowing // 2 + extra
            table[narrowing, extra, start : start + w - narrowing] = resample
    return table


def _lanczos3_resize_matrix(size: int, new_size: int) -> Tensor:
    """(new_size, size): TensorFlow's antialiased Lanczos-3 resize along one axis (its
    scale_and_translate with no translation): output x samples the input at (x + 0.5) size /
    new_size, the kernel widened by size / new_size when shrinking, the weights summing to 1."""
    inv_scale = size / new_size
    kernel_scale = max(inv_scale, 1.0)
    centre = (torch.arange(new_size, dtype=torch.float64) + 0.5) * inv_scale  # (new_size,)
    source = torch.arange(size, dtype=torch.float64) + 0.5
    x = ((source[None, :] - centre[:, None]) / kernel_scale).abs()
    radius = 3
    weights = torch.where(
        x < radius,
        torch.sinc(x) * torch.sinc(x / radius),
        torch.zeros((), dtype=torch.float64),
    )
    return weights / weights.sum(1, keepdim=True)


def _erase(images: Tensor, corner: Tensor) -> Tensor:
    """Each image with the ERASED x ERASED patch from (row, column) corner[n] zeroed."""
    _, _, h, w = images.shape
    rows = torch.arange(h, device=images.device) - corner[:, :1]  # (N, H)
    cols = torch.arange(w, device=images.device) - corner[:, 1:]
    patch = ((rows >= 0) & (rows < ERASED))[:, :, None] & ((cols >= 0) & (cols < ERASED))[:, None]
    return images.masked_fill(patch[:, None], 0)


__all__ = ["efficient_capsnet", "translate"]
