"""Items: the images a run makes, in order, each an :class:`Item` (its index,
noise seed and condition). Item ``i`` gets the seed ``seed + i``; a class list gives each class ``per_class``
times in a row (:func:`class_items`, the reference DiT), a prompt set each prompt ``images_per_prompt`` times
in a row (:func:`prompt_items`, pipelines; an editing pipeline's item also names its prompt's input image).
``AblationConfig.items`` and ``tomerge generate`` both make their items here; class ids may come from a file
(:func:`read_class_file`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .prompt_sets import PromptSet

__all__ = ["Item", "read_class_file", "class_items", "prompt_items"]


@dataclasses.dataclass(frozen=True)
class Item:
    """One image to produce: its global index, noise seed, and its condition (class label or prompt, and for
    editing pipelines the path of its input image).

    Example:
        >>> Item(7, 107, label=3).filename, Item(7, 107, prompt="a cat").filename
        ('00007_class3_seed107.png', '00007_seed107.png')
    """

    index: int
    seed: int
    label: int | None = None
    prompt: str | None = None
    image: str | None = None

    @property
    def filename(self) -> str:
        if self.label is not None:
            return f"{self.index:05d}_class{self.label}_seed{self.seed}.png"
        return f"{self.index:05d}_seed{self.seed}.png"

    @property
    def video_dirname(self) -> str:
        """The folder of a video item's frames (``frame_000.png``, ...): the file name without ``.png``.

        Example:
            >>> Item(7, 107, prompt="a cat").video_dirname
            '00007_seed107'
        """
        return self.filename.removesuffix(".png")

    def output_name(self, video: bool = False) -> str:
        """What the item is written as in a run's image folder: :attr:`filename` (a PNG), or for a video
        :attr:`video_dirname` (a folder of one PNG per frame)."""
        return self.video_dirname if video else self.filename


def read_class_file(path: str | os.PathLike) -> list[int]:
    """Class ids from a file: a JSON list (or ``{"classes": [...]}``), or text with ids separated by
    whitespace or commas (``#`` starts a comment). One id per image (``--per-class`` repeats them).

    Example:
        >>> import tempfile; f = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
        >>> _ = f.write("0 1, 2  # shirts\\n7\\n"); f.close()
        >>> read_class_file(f.name)
        [0, 1, 2, 7]
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"class file {path} not found")
    text = path.read_text()
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        data = json.loads(text)
        values = data.get("classes") if isinstance(data, dict) else data
        if not isinstance(values, list):
            raise ValueError(f"{path}: JSON must be a list of class ids or {{\"classes\": [...]}}")
    else:
        values = [tok for line in text.splitlines() for tok in line.split("#", 1)[0].replace(",", " ").split()]
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: class ids must be integers ({err})") from err


def class_items(classes: Sequence[int], per_class: int = 1, seed: int = 0) -> list[Item]:
    """Every class ``per_class`` times, in order; item ``i`` has seed ``seed + i``.

    Example:
        >>> [(i.index, i.label, i.seed) for i in class_items([4, 2], per_class=2, seed=10)]
        [(0, 4, 10), (1, 4, 11), (2, 2, 12), (3, 2, 13)]
    """
    if per_class < 1:
        raise ValueError(f"per_class must be >= 1, got {per_class}")
    labels = [int(c) for c in classes for _ in range(per_class)]
    return [Item(i, seed + i, label=c) for i, c in enumerate(labels)]


def prompt_items(prompt_set: PromptSet, seed: int = 0) -> list[Item]:
    """Every prompt of ``prompt_set`` (:meth:`~tomerge.experiments.sources.prompt_sets.PromptSet.prompts`)
    ``images_per_prompt`` times, in order, with its input image (``image_field``) if the set names them; item
    ``i`` has seed ``seed + i``.

    Example:
        >>> import pathlib, tempfile
        >>> from tomerge.experiments.sources.prompt_sets import PromptSet
        >>> path = pathlib.Path(tempfile.mkdtemp(), "prompts.txt")
        >>> _ = path.write_text("a fox\\na boat\\n")
        >>> [(i.index, i.prompt, i.seed) for i in prompt_items(PromptSet(str(path), images_per_prompt=2), seed=5)]
        [(0, 'a fox', 5), (1, 'a fox', 6), (2, 'a boat', 7), (3, 'a boat', 8)]
    """
    prompts = prompt_set.prompts()
    images = prompt_set.images() or [None] * len(prompts)  # input images of editing pipelines
    expanded = [(p, im) for p, im in zip(prompts, images) for _ in range(prompt_set.images_per_prompt)]
    return [Item(i, seed + i, prompt=p, image=None if im is None else str(im))
            for i, (p, im) in enumerate(expanded)]
