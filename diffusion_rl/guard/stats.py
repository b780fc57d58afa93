"""Image statistics that no reward optimises, to see a policy drift while its reward climbs (reward hacking).

Per image (uint8 RGB [H, W, 3]), with luma Y = 0.299 R + 0.587 G + 0.114 B on the 0–255 scale (ITU-R BT.601):

- `brightness`        mean(Y) / 255, in [0, 1];
- `dark_fraction`     share of pixels with Y < 16 (near black), in [0, 1];
- `saturated_fraction` share of pixels with a channel ≥ 250 (clipped highlights or fully saturated colour);
- `colorfulness`      Hasler & Süsstrunk (2003): with rg = R − G and yb = (R + G) / 2 − B,
                      M = sqrt(σ_rg² + σ_yb²) + 0.3 · sqrt(μ_rg² + μ_yb²)   (population σ, 0–255 scale);
- `edge_density`      share of interior pixels whose luma gradient (central differences on Y / 255:
                      gx = (Y[y, x+1] − Y[y, x−1]) / 2, gy likewise) has magnitude sqrt(gx² + gy²) > 0.05;
- `jpeg_kb`           size of the image saved as JPEG at quality 95, in kB (as the jpeg rewards measure it);

and per batch:

- `group_diversity`   mean over the groups of ≥ 2 samples of the mean over their pairs i < j of
                      mean(|x_i − x_j|) / 255 (per pixel and channel): 0 when a group's samples are identical;
- `val_drift`         mean over validation images of mean(|x − x_base|) / 255, x_base being the image of the same
                      prompt and seed at the reference validation (step 0: the base model's images).

The batch value of a per-image statistic is its mean over the batch. Images larger than `max_side` are first
shrunk (box filter, aspect kept) so the cost stays bounded at high resolution; a run compares like with like.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
from PIL import Image

from diffusion_rl.config.guard import ROLLOUT_STATS  # the statistics' names, declared with the section

DARK_LUMA = 16.0  # of 255
SATURATED_LEVEL = 250  # of 255
EDGE_THRESHOLD = 0.05  # gradient magnitude on luma in [0, 1]
JPEG_QUALITY = 95


def luma(images_BHW3: np.ndarray) -> np.ndarray:
    """float64 [B, H, W]: BT.601 luma on the 0–255 scale."""
    rgb = images_BHW3.astype(np.float64)
    return 0.299 * rgb[..., 0] + 0.587 * rgb[..., 1] + 0.114 * rgb[..., 2]


def brightness(images_BHW3: np.ndarray) -> np.ndarray:
    return luma(images_BHW3).mean(axis=(1, 2)) / 255


def dark_fraction(images_BHW3: np.ndarray) -> np.ndarray:
    return (luma(images_BHW3) < DARK_LUMA).mean(axis=(1, 2))


def saturated_fraction(images_BHW3: np.ndarray) -> np.ndarray:
    return (images_BHW3 >= SATURATED_LEVEL).any(axis=-1).mean(axis=(1, 2))


def colorfulness(images_BHW3: np.ndarray) -> np.ndarray:
    rgb = images_BHW3.astype(np.float64)
    rg = rgb[..., 0] - rgb[..., 1]
    yb = (rgb[..., 0] + rgb[..., 1]) / 2 - rgb[..., 2]
    spread = np.sqrt(rg.std(axis=(1, 2)) ** 2 + yb.std(axis=(1, 2)) ** 2)
    offset = np.sqrt(rg.mean(axis=(1, 2)) ** 2 + yb.mean(axis=(1, 2)) ** 2)
    return spread + 0.3 * offset


def edge_density(images_BHW3: np.ndarray) -> np.ndarray:
    y = luma(images_BHW3) / 255
    if y.shape[1] < 3 or y.shape[2] < 3:
        return np.zeros(len(y))
    gx = (y[:, 1:-1, 2:] - y[:, 1:-1, :-2]) / 2
    gy = (y[:, 2:, 1:-1] - y[:, :-2, 1:-1]) / 2
    return (np.sqrt(gx**2 + gy**2) > EDGE_THRESHOLD).mean(axis=(1, 2))


def jpeg_kb(images_BHW3: np.ndarray) -> np.ndarray:
    sizes = []
    for image in images_BHW3:
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=JPEG_QUALITY)
        sizes.append(buffer.tell() / 1000)
    return np.array(sizes, dtype=np.float64)


def mean_abs_difference(a_HW3: np.ndarray, b_HW3: np.ndarray) -> float:
    """mean(|a − b|) / 255 over pixels and channels."""
    return float(np.abs(a_HW3.astype(np.float64) - b_HW3.astype(np.float64)).mean() / 255)


def pairwise_differences(images_BHW3: np.ndarray, group_index: np.ndarray) -> dict[int, np.ndarray]:
    """Per group of ≥ 2 samples, its rows' mean(|x_i − x_j|) / 255 [n, n] (0 on the diagonal), keyed by the group's
    first row: computed once per pair, read by `group_diversity` and by each row's nearest neighbour (`nearest`)."""
    groups = np.asarray(group_index).reshape(-1)
    out = {}
    for g in np.unique(groups):
        rows = np.flatnonzero(groups == g)
        if len(rows) < 2:
            continue
        table = np.zeros((len(rows), len(rows)))
        for a in range(len(rows)):
            for b in range(a + 1, len(rows)):
                table[a, b] = table[b, a] = mean_abs_difference(images_BHW3[rows[a]], images_BHW3[rows[b]])
        out[int(rows[0])] = table
    return out


def group_diversity(images_BHW3: np.ndarray, group_index: np.ndarray) -> float | None:
    """Mean over groups (≥ 2 samples) of their mean pairwise mean(|x_i − x_j|) / 255; None without such a group."""
    return diversity_of(pairwise_differences(images_BHW3, group_index))


def diversity_of(tables: dict[int, np.ndarray]) -> float | None:
    """`group_diversity` from the groups' `pairwise_differences`."""
    per_group = [np.mean(t[np.triu_indices(len(t), 1)]) for t in tables.values()]  # the pairs i < j, in order
    return float(np.mean(per_group)) if per_group else None


def nearest(group_index: np.ndarray, tables: dict[int, np.ndarray]) -> np.ndarray:
    """float64 [B]: each row's mean(|x_i − x_j|) / 255 to the closest other row of its group (NaN: alone)."""
    groups = np.asarray(group_index).reshape(-1)
    out = np.full(len(groups), np.nan)
    for first, table in tables.items():
        rows = np.flatnonzero(groups == groups[first])
        out[rows] = (table + np.diag(np.full(len(rows), np.inf))).min(axis=1)
    return out


def val_drift(images_BHW3: np.ndarray, reference_BHW3: np.ndarray) -> float:
    """Mean over images of mean(|x − x_ref|) / 255, image i against reference image i."""
    if images_BHW3.shape != reference_BHW3.shape:
        raise ValueError(
            f"validation images {images_BHW3.shape} and the reference {reference_BHW3.shape} differ in shape; "
            "the prompts, val.n or the image size changed since the reference was taken"
        )
    return float(np.mean([mean_abs_difference(x, r) for x, r in zip(images_BHW3, reference_BHW3)]))


def shrink(images_BHW3: np.ndarray, max_side: int) -> np.ndarray:
    """The images with their longer side at most `max_side` (box filter, aspect ratio kept); as is if smaller."""
    height, width = images_BHW3.shape[1:3]
    if max(height, width) <= max_side:
        return images_BHW3
    scale = max_side / max(height, width)
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return np.stack([np.asarray(Image.fromarray(im).resize(size, Image.Resampling.BOX)) for im in images_BHW3])


_IMAGE_FUNCTIONS = {
    "brightness": brightness,
    "dark_fraction": dark_fraction,
    "saturated_fraction": saturated_fraction,
    "colorfulness": colorfulness,
    "edge_density": edge_density,
    "jpeg_kb": jpeg_kb,
}


@dataclass
class RolloutStats:
    """One rollout's image statistics, row by row: each named statistic's values [B] and, when group_diversity is
    watched, the groups' pairwise differences. The guard logs their batch values; an algorithm may read the rows
    (GARDO's diversity and gate: docs/gardo.md) from the step's scores (`RewardResult.image_stats`)."""

    values: dict[str, np.ndarray]  # image statistic → float64 [B]
    group_index: np.ndarray  # [B]
    tables: dict[int, np.ndarray] | None = None  # `pairwise_differences`; None when group_diversity is not watched
    drift: np.ndarray | None = None  # float64 [B]: each row's distance from the baselines (guard/runner.py `drift`)

    def batch_values(self) -> dict[str, float]:
        """The batch value of each statistic: the mean over rows; group_diversity as `group_diversity` says."""
        out = {name: float(v.mean()) for name, v in self.values.items()}
        if self.tables is not None:
            diversity = diversity_of(self.tables)
            if diversity is not None:
                out["group_diversity"] = diversity
        return out

    def nearest(self) -> np.ndarray | None:
        """float64 [B]: each row's difference to its group's closest other row (NaN: alone); None unless the
        pairwise differences were computed."""
        return None if self.tables is None else nearest(self.group_index, self.tables)


def measure_rollout(
    images_BHW3: np.ndarray, group_index: np.ndarray, names: tuple[str, ...] = ROLLOUT_STATS, max_side: int = 256
) -> RolloutStats:
    """The named rollout statistics of every row (images shrunk to `max_side` first), each computed once."""
    images, groups = shrink(images_BHW3, max_side), np.asarray(group_index).reshape(-1)
    values = {name: _IMAGE_FUNCTIONS[name](images) for name in names if name in _IMAGE_FUNCTIONS}
    tables = pairwise_differences(images, groups) if "group_diversity" in names else None
    return RolloutStats({k: np.asarray(v, dtype=np.float64) for k, v in values.items()}, groups, tables)


def rollout_stats(
    images_BHW3: np.ndarray, group_index: np.ndarray, names: tuple[str, ...] = ROLLOUT_STATS, max_side: int = 256
) -> dict[str, float]:
    """The batch values of the named rollout statistics (a statistic that cannot be computed is left out)."""
    return measure_rollout(images_BHW3, group_index, names, max_side).batch_values()
