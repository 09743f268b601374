"""What a `[training]` or `[validation]` section reads: one path or a weighted mixture of paths, a split,
the train or held-out part of a source, and how many steps an epoch of it takes.

titan-data holds the pieces (`MixtureSource`, `mix_rows`, `HoldoutSource`, `keep_row`); this module maps
the config onto them. Under `validation.holdout_share` the validation loader reads the training
section's data, its held-out part, and the training loader its train part.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from titan_data import (
    HoldoutSource,
    MixtureSource,
    StreamLayout,
    TextSource,
    get_source,
    keep_row,
)

logger = logging.getLogger(__name__)


def data_section(config: Any, section: Any) -> tuple[Any, str | None]:
    """The section whose data `section` reads, and the part of it ("train", "holdout", or None: all)."""
    share = config.validation.holdout_share if config.validation.enable else 0.0
    if not share:
        return section, None
    return config.training, "holdout" if section is config.validation else "train"


def section_paths(section: Any) -> list[Any]:
    """The paths a section reads: its mixture's, else its one dataset_path (None: the dataset's default)."""
    return list(getattr(section, "dataset_mixture", None) or [section.dataset_path])


def text_source(section: Any, part: str | None, share: float) -> TextSource:
    """The section's documents: one source or a weighted mixture, the `part` of a held-out split."""
    sources = [get_source(section.dataset, path, section.dataset_split) for path in section_paths(section)]
    if part is not None:
        sources = [HoldoutSource(source, share, part) for source in sources]
    if len(sources) == 1:
        return sources[0]
    mixture = MixtureSource(sources, section.dataset_weights)
    for source, share_of in zip(sources, mixture.shares, strict=True):
        logger.info("mixture: %s at %s: weight %.4g of the documents", source.name, source.location, share_of)
    return mixture


def row_filter(part: str | None, share: float) -> Callable[[int], bool] | None:
    """Which chat rows (by number) a part keeps; None: all."""
    return None if part is None else keep_row(share, part)


def epoch_steps(make: Callable[[StreamLayout], Any], global_batch: int, what: str) -> int:
    """Steps one pass over a finite dataset takes: its sequences as one stream packs them (a finite copy
    read once), over the global batch, rounded up. Counted over one stream, the number is the same at any
    num_streams (more streams each end on a part-filled sequence, so they add at most one per stream), and
    a resume that adopts a checkpoint's number of streams plans the same steps."""
    windows = sum(1 for _ in make(StreamLayout(0, 1, 1)).windows())
    steps = max(1, math.ceil(windows / global_batch))
    logger.info(
        "data: one epoch of %s is %d sequences, %d steps of a global batch of %d",
        what,
        windows,
        steps,
        global_batch,
    )
    return steps
