"""Every family under test: the :class:`~helpers.family.Family` rows of the declared adapters (``FAMILIES``: the
image families of ``helpers.image_families``, then the video families of ``helpers.video_families``).

A row named after its backbone is that backbone's configuration wherever one configuration per backbone runs (every
strategy on every backbone: ``helpers.cases``); the other rows are variants of the same adapter (another release's
configuration). tests/backbones/test_family_contract.py runs the contract over every row and checks that every
declared backbone of ``tomerge.list_backbones()`` has its row.
"""

from __future__ import annotations

from torch import nn

from helpers.family import Family
from helpers.image_families import IMAGE_FAMILIES
from helpers.video_families import VIDEO_FAMILIES

FAMILIES: dict[str, Family] = {**IMAGE_FAMILIES, **VIDEO_FAMILIES}

#: The rows named after their backbone: one configuration per declared backbone.
BACKBONE_ROWS = [name for name, family in FAMILIES.items() if name == family.backbone]


class Models(dict):
    """The families' models by row name, each built on first use (the ``models`` fixture of tests/backbones)."""

    def __missing__(self, name: str) -> nn.Module:
        model = self[name] = FAMILIES[name].build()
        return model
