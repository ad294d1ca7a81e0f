"""A run folder as the figures read it: :class:`RunData` (its config, its result rows and its files: images,
videos, merge maps, block-call records) and :func:`load_run`, which reads one through
:mod:`~tomerge.experiments.runs.records` and refuses what figures cannot draw.

A W&B offline run directory inside a run folder (``runs/<name>/wandb/offline-run-*``) resolves to that run
folder. A broken run folder is named in one line, with what to do
(:class:`~tomerge.experiments.errors.DamagedFileError`): a truncated or unreadable image, ``prompts.jsonl`` or
merge map, a broken row of ``results.jsonl``, rows lacking the keys figures need (a folder of another tomerge
version); rows whose FLOPs another FLOP counter made are refused too. An unfinished last row is left out and
missing images are left out of the grids, each with a warning.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..errors import DamagedFileError, UsageError
from ..generation.files import frame_files, load_image_files, read_jsonl
from ..generation.generate import INDEX_FILE
from ..runs.records import RESULTS, last_rows, other_counter_message, other_counter_runs, read_rows

if TYPE_CHECKING:  # torch is imported where images are loaded: `tomerge figures --help` stays fast
    from torch import Tensor

__all__ = ["RunData", "load_run", "regenerate", "GRID_SELECT"]

GRID_SELECT = {"distinct": "one image per class or prompt", "first": "the first items"}


@dataclasses.dataclass
class RunData:
    """One run folder: its config, its result rows (the last row per run id, file order), its files."""

    path: Path
    name: str
    config: dict[str, Any]
    rows: list[dict[str, Any]]

    @property
    def baseline(self) -> dict[str, Any] | None:
        return next((r for r in self.rows if r["run"] == "baseline"), None)

    @property
    def merged(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["run"] != "baseline"]

    def index(self, run: str) -> list[dict[str, Any]]:
        """The run's items (``images/<run>/prompts.jsonl``): index, seed, file, prompt or label."""
        file = self.path / "images" / run / INDEX_FILE
        if not file.exists():
            return []
        return read_jsonl(file, f"delete it and {regenerate(self.path)}", required=("index", "file"),
                          appended=False)[0]

    def items(self, run: str, indices: Sequence[int] | None = None) -> list[dict[str, Any]]:
        """The run's items with these ``index`` values, in that order (all items: ``None``); an index the
        run does not have is left out."""
        items = self.index(run)
        if indices is None:
            return items
        by_index = {item["index"]: item for item in items}
        return [by_index[i] for i in indices if i in by_index]

    def images(self, run: str, k: int | None = None, indices: Sequence[int] | None = None) -> Tensor | None:
        """Images ``[n, C, H, W]`` float in [-1, 1], or ``None``: the items with these ``index`` values in
        that order (``indices``; items the run lacks are left out), else the first ``k`` (all: ``None``)."""
        items = self.items(run, indices) if indices is not None else self.index(run)[:k]
        files = [self.path / "images" / run / item["file"] for item in items]
        files = [f for f in files if f.exists()]
        return self._load(files) if files else None

    def _load(self, files: Sequence[Path]) -> Tensor:
        """``load_image_files(files)``; a damaged file is named in a :class:`DamagedFileError`."""
        try:
            return load_image_files(files)
        except (OSError, SyntaxError, ValueError) as err:  # PIL: truncated, not an image
            for file in files:
                try:
                    load_image_files([file])
                except (OSError, SyntaxError, ValueError) as one:
                    raise DamagedFileError(f"{file} is damaged ({one}); delete it and {regenerate(self.path)}") \
                        from one
            raise err

    @property
    def is_video(self) -> bool:
        """Whether the folder's items are videos (folders of frames, as video pipelines write them)."""
        for r in self.rows:
            for item in self.index(r["run"]):
                path = self.path / "images" / r["run"] / item["file"]
                if path.exists():
                    return path.is_dir()
        return False

    def video(self, run: str, index: int) -> Tensor | None:
        """The frames ``[T, C, H, W]`` (float, [-1, 1]) of the run's item with this ``index``, or ``None``."""
        items = self.items(run, [index])
        folder = self.path / "images" / run / items[0]["file"] if items else None
        if folder is None or not folder.is_dir():
            return None
        try:
            frames = frame_files(folder)
        except ValueError as err:
            raise DamagedFileError(f"{folder}: {err}; delete it and {regenerate(self.path)}") from err
        return self._load(frames)

    def prompts(self, k: int | None = None, indices: Sequence[int] | None = None) -> list[str] | None:
        """Prompts of the baseline's items with these ``index`` values (``indices``), else of its first ``k``
        items, or ``None`` for class-conditional runs."""
        items = self.items("baseline", indices) if indices is not None else self.index("baseline")[:k]
        return [item["prompt"] for item in items] if items and "prompt" in items[0] else None

    def grid_items(self, k: int | None = 8, select: str = "distinct") -> list[int]:
        """Item indices shown by the image grids, the same for every run: of the items every run with
        images has on disk (in the baseline's order, or the first such run's), ``"distinct"`` takes the
        first item of each distinct class label or prompt (one image per class, or per prompt when a
        prompt has several images), ``"first"`` the first items; at most ``k`` (all: ``None``).

        Example: items of classes ``[0, 0, 1, 1, 2, 2]`` (indices 0-5) -> ``[0, 2, 4]`` (``"first"``,
        ``k=3``: ``[0, 1, 2]``).
        """
        if select not in GRID_SELECT:
            raise UsageError(f"unknown grid selection {select!r}; choose from {sorted(GRID_SELECT)}")
        order: list[dict[str, Any]] = []
        present: list[set[int]] = []
        for r in self.rows:
            items = [it for it in self.index(r["run"]) if (self.path / "images" / r["run"] / it["file"]).exists()]
            if items:
                order = order or items
                present.append({it["index"] for it in items})
        common = [it for it in order if all(it["index"] in p for p in present)]
        if select == "distinct":
            seen: set[Any] = set()
            kept = []
            for it in common:
                key = ("prompt", it["prompt"]) if "prompt" in it else ("label", it.get("label"))
                if key not in seen:
                    seen.add(key)
                    kept.append(it)
            common = kept
        return [it["index"] for it in common[:k]]

    def maps(self, run: str) -> dict[str, Tensor]:
        file = self.path / "maps" / f"{run}.safetensors"
        if not file.exists():
            return {}
        from safetensors.torch import load_file

        try:
            return load_file(file)
        except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise DamagedFileError(f"{file} is damaged ({type(err).__name__}: {err}); delete it (the figures then "
                                   "leave out that run's merge maps)") from err

    def map_grids(self, run: str) -> dict[str, tuple[int, ...]]:
        """The token grid of each merge map of the run (``(H, W)`` or ``(T, H, W)``), from the maps file's
        metadata; ``{}`` for maps written without it."""
        file = self.path / "maps" / f"{run}.safetensors"
        if not file.exists():
            return {}
        from safetensors import safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                metadata = f.metadata() or {}
            grids = json.loads(metadata.get("grids", "{}"))
        except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise DamagedFileError(f"{file} is damaged ({type(err).__name__}: {err}); delete it (the figures then "
                                   "leave out that run's merge maps)") from err
        return {k: tuple(int(v) for v in g) for k, g in grids.items()}

    def records(self, run: str) -> list[dict[str, Any]]:
        file = self.path / "maps" / f"{run}.json"
        if not file.exists():
            return []
        try:
            records = json.loads(file.read_text())
        except ValueError as err:
            raise DamagedFileError(f"{file} is damaged ({err}); delete it (the figures then leave out that run's "
                                   "schedule)") from err
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise DamagedFileError(f"{file} is not a list of block-call records; delete it (the figures then "
                                   "leave out that run's schedule)")
        return records

    def missing_images(self) -> list[Path]:
        """Image files (video folders) that the rows' ``prompts.jsonl`` list but that are not there, and the
        image folders of rows that have none."""
        missing = []
        for r in self.rows:
            folder = self.path / "images" / r["run"]
            if not (folder / INDEX_FILE).exists():
                missing.append(folder)
            missing += [folder / item["file"] for item in self.index(r["run"]) if not (folder / item["file"]).exists()]
        return missing


def regenerate(path: Path) -> str:
    """What recreates the images of a run folder (the end of an error message)."""
    return (f"rerun the `tomerge ablate` command that made {path} (the same config and --set values; "
            "config.yaml there holds them), which generates missing images again")


def _resolve(path: Path) -> Path:
    if (path / RESULTS).is_file():
        return path
    is_wandb = path.name.startswith(("offline-run-", "run-")) or any(path.glob("*.wandb"))
    for parent in list(path.parents)[:3] if is_wandb else []:
        if (parent / RESULTS).is_file():
            return parent
    hint = ("; a W&B run directory is read only inside a run folder, standalone W&B runs are not supported"
            if is_wandb else "")
    raise FileNotFoundError(f"{path} is not a run folder (no results.jsonl; write one with `tomerge ablate`){hint}")


def load_run(path: str | Path, runs: Sequence[str] | None = None) -> RunData:
    """Reads a run folder (or a W&B run dir inside one); ``runs`` keeps matching run ids (globs) and the baseline.

    Example:
        >>> data = load_run("runs/reference")                     # doctest: +SKIP
        >>> [r["run"] for r in data.rows][:2]                      # doctest: +SKIP
        ['baseline', 'tomesd-r0.5-use_rand=False']
    """
    import warnings

    path = _resolve(Path(path))
    rows = [r for r in last_rows(read_rows(path))
            if r["run"] == "baseline" or not runs or any(fnmatch.fnmatch(r["run"], p) for p in runs)]
    rows.sort(key=lambda r: r["run"] != "baseline")  # stable: baseline first, then file order
    _check_keys(path, rows)
    _check_counter(path, rows)
    config_file = path / "config.yaml"
    config: Any = {}
    if config_file.exists():
        try:
            config = yaml.safe_load(config_file.read_text())
        except yaml.YAMLError as err:
            warnings.warn(f"{config_file} is damaged ({type(err).__name__}); figures do without it", stacklevel=2)
    data = RunData(path, path.name, config if isinstance(config, dict) else {}, rows)
    missing = data.missing_images()
    if missing:
        warnings.warn(f"{path}: {len(missing)} images or image folders are missing (first: {missing[0]}); the grids "
                      f"leave them out; to draw them, {regenerate(path)}", stacklevel=2)
    return data


OTHER_VERSION = ("a run folder written by another tomerge version is read by that version (its rows name it: "
                 "versions, git_commit)")
# keys every row (and every merged row) needs to be drawn
ROW_KEYS = ("run",)
MERGED_ROW_KEYS = ("strategy",)


def _check_keys(path: Path, rows: list[dict[str, Any]]) -> None:
    """Refuses rows that lack the keys figures need (a folder written by another tomerge version)."""
    lacking = {r["run"]: [k for k in (*ROW_KEYS, *(MERGED_ROW_KEYS if r["run"] != "baseline" else ())) if k not in r]
               for r in rows}
    lacking = {run: keys for run, keys in lacking.items() if keys}
    if lacking:
        run, keys = next(iter(lacking.items()))
        raise DamagedFileError(f"{path / 'results.jsonl'}: {len(lacking)} rows lack keys figures need (first: {run} "
                               f"has no {', '.join(map(repr, keys))}): {OTHER_VERSION}")


def _check_counter(path: Path, rows: list[dict[str, Any]]) -> None:
    """Refuses rows whose FLOPs another FLOP counter made: their FLOP-ideal speed-ups follow other rules."""
    stale = other_counter_runs(rows)
    if stale:
        raise UsageError(f"{other_counter_message(path, stale)}; rerun tomerge ablate with the folder's config to "
                         "measure them again (their images are reused)")
