"""Run folders and W&B logging: where ablation results live.

A run folder ``runs/<name>/`` holds the frozen config, one result row per finished run (``results.jsonl``, appended
as runs finish: the resume point), the tables, the images, merge maps and features; figures are built from these
files alone. One process writes to a folder at a time (:meth:`RunFolder.open` locks it until
:meth:`RunFolder.close`), and every file and row is written whole, so a process killed at any moment leaves
finished files and rows intact. The files and the recovery rules: docs/experiments.md, "Run the ablation" (the run
folder; kills, full disks, broken files).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import subprocess
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..measure.columns import BETTER, format_markdown_table, table_columns
from ..measure.intervals import interval_keys, row_interval
from ..errors import UsageError
from ..config.schema import AblationConfig
from ..generation.files import DamagedFileError, FolderLock, append_line, load_image_files, load_video, lock_folder, \
    read_jsonl, remove_temp_files, repair_jsonl_tail, write_text_atomic, write_with
from ..generation.pictures import image_grid, merge_map_rgb

if TYPE_CHECKING:
    from torch import Tensor

# (key, title) of table.md; a column is shown when some row has a value for it. Which way each numeric column
# is better (what `tomerge search` optimises, and figures mark): BETTER. Both come from columns.COLUMNS.
TABLE_COLUMNS = table_columns()
GRID_IMAGES = 20  # images in a run's grid PNG and logged to W&B
GRID_VIDEOS = 4  # videos in a run's grid PNG (one row of frames each) and logged to W&B
VIDEO_FPS = 8  # frame rate of the videos logged to W&B (GIF)


def environment() -> dict[str, Any]:
    """Package versions and the git commit, recorded with every result row."""
    import importlib.metadata as md

    import torch

    versions = {}
    for name in ("torch", "diffusers", "timm", "tomerge"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"versions": versions, "git_commit": commit, "device": "cuda" if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads()}


def preview_grid(files: list[Path]) -> Tensor:
    """The first :data:`GRID_IMAGES` images in rows of 10, or the first :data:`GRID_VIDEOS` videos (frame
    folders) one row of frames each: ``[H', W', 3]`` uint8."""
    import torch

    if files and Path(files[0]).is_dir():
        videos = [load_video(f) for f in files[:GRID_VIDEOS]]  # each [T, C, H, W]
        return image_grid(torch.cat(videos), columns=videos[0].shape[0])  # [n * T, C, H, W] -> rows of T
    return image_grid(load_image_files(files[:GRID_IMAGES]))


def save_png(array: Tensor, path: Path) -> None:
    from PIL import Image

    write_with(path, lambda tmp: Image.fromarray(array.numpy()).save(tmp, format="PNG"))


RESULTS = "results.jsonl"
# What to do about a broken row of results.jsonl (the end of DamagedFileError's message)
FIX_ROW = "fix or delete that line (`tomerge ablate` then redoes its run)"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every row of the run folder's ``results.jsonl``, in file order: a broken row is a
    :class:`~tomerge.experiments.errors.DamagedFileError` naming its line and :data:`FIX_ROW`; an unfinished last
    row (a killed process) is left out with a warning."""
    return read_jsonl(path / RESULTS, FIX_ROW, required=("run",))[0]


def last_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last row of each run id, in the order the run ids first appear.

    Example:
        >>> [r["x"] for r in last_rows([{"run": "a", "x": 1}, {"run": "b", "x": 2}, {"run": "a", "x": 3}])]
        [3, 2]
    """
    latest: dict[str, dict[str, Any]] = {}
    for row in rows:
        latest[row["run"]] = row
    return list(latest.values())


def load_tensors(path: Path, key: str) -> dict[str, Tensor] | None:
    """The tensors of a run folder's ``<key>.safetensors`` (``features``: the baseline's, the reference's and each
    run's EfficientNet-Lite0 features), or ``None`` without the file; reads without taking the folder's lock."""
    file = path / f"{key}.safetensors"
    if not file.exists():
        return None
    from safetensors.torch import load_file

    return load_file(file)


@dataclasses.dataclass
class RunFolder:
    """The files of one ablation (see the module docstring)."""

    path: Path
    rows: list[dict[str, Any]]
    lock: FolderLock | None = dataclasses.field(default=None, repr=False, compare=False)

    @classmethod
    def open(cls, config: AblationConfig) -> RunFolder:
        """Locks the folder (a second process on it gets a :class:`~tomerge.experiments.errors.FolderInUseError`
        naming the first), tidies what a killed process left, checks the config and reads the rows;
        :meth:`close` releases the lock."""
        path = Path(config.out_dir) / config.name
        path.mkdir(parents=True, exist_ok=True)
        lock = lock_folder(path, "tomerge ablate")
        try:
            return cls(path, cls._read(path, config), lock)
        except BaseException:
            lock.release()
            raise

    @staticmethod
    def _read(path: Path, config: AblationConfig) -> list[dict[str, Any]]:
        (path / "images").mkdir(exist_ok=True)
        (path / "maps").mkdir(exist_ok=True)
        remove_temp_files(path, depth=2)  # of writes a killed process did not finish (we hold the lock)
        for log in (path / "images").glob("*/generated.jsonl"):
            repair_jsonl_tail(log)
        saved = path / "config.yaml"
        current = yaml.safe_dump(config.to_dict(), sort_keys=True)
        if saved.exists() and saved.read_text() != current:
            try:
                previous = yaml.safe_load(saved.read_text())
            except yaml.YAMLError as err:
                raise DamagedFileError(f"{saved} is damaged ({type(err).__name__}); if {path} was made with this "
                                       "config, delete that file and rerun, else use another name "
                                       "(--set name=...)") from err
            previous = previous if isinstance(previous, dict) else {}
            changed = sorted(k for k, v in config.to_dict().items() if not _same_setting(previous.get(k), _plain(v)))
            if set(changed) - {"grid", "wandb", "out_dir", "plugins"}:
                raise UsageError(f"{path} holds an ablation with another config (changed: {changed}); "
                                 "use another name (--set name=...) or delete the folder")
        write_text_atomic(saved, current)
        rows = []
        results = path / RESULTS
        if results.exists():
            rows = read_rows(path)
            repair_jsonl_tail(results)  # an unfinished last row (warned about) goes: the next row starts a line
        return current_counts(rows, path)

    def close(self) -> None:
        """Releases the folder's lock (a second call does nothing)."""
        if self.lock is not None:
            self.lock.release()

    @property
    def table_path(self) -> Path:
        return self.path / "table.md"

    def has(self, run_id: str) -> bool:
        return any(r["run"] == run_id for r in self.rows)

    def baseline_row(self) -> dict[str, Any]:
        return next(r for r in self.rows if r["run"] == "baseline")

    def last_row(self, run_id: str) -> dict[str, Any]:
        """The run's last row (:func:`last_rows`' rule)."""
        return next(r for r in reversed(self.rows) if r["run"] == run_id)

    def append(self, row: dict[str, Any]) -> None:
        """Appends a row whole, fsynced (a full disk: a one-line error, and the file as it was)."""
        append_line(self.path / RESULTS, json.dumps(row, default=str))
        self.rows.append(row)

    def images_dir(self, run_id: str) -> Path:
        """The run's PNGs, one per item (``{i:05d}_seed{s}.png`` / ``{i:05d}_class{c}_seed{s}.png``)."""
        return self.path / "images" / run_id

    def save_grid(self, run_id: str, files: list[Path]) -> None:
        """``images/<run>.png``: the first :data:`GRID_IMAGES` images side by side; for videos (frame
        folders) the first :data:`GRID_VIDEOS` videos, one row of frames each."""
        save_png(preview_grid(files), self.path / "images" / f"{run_id}.png")

    def save_tensors(self, key: str, tensors: dict[str, Tensor]) -> None:
        from safetensors.torch import save_file

        write_with(self.path / f"{key}.safetensors",
                   lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, tmp))

    def load_tensors(self, key: str) -> dict[str, Tensor] | None:
        return load_tensors(self.path, key)

    def save_maps(self, run_id: str, maps: dict[str, Tensor], records: list,
                  grids: dict[str, tuple[int, ...]] | None = None) -> None:
        """``maps/<run>.safetensors`` (``[N]`` slots per key; the metadata ``grids``: each key's token grid) and
        ``maps/<run>.json`` (the block-call records)."""
        from safetensors.torch import save_file

        if maps:
            metadata = {"grids": json.dumps({k: list(g) for k, g in (grids or {}).items()})}
            write_with(self.path / "maps" / f"{run_id}.safetensors",
                       lambda tmp: save_file({k: v.contiguous() for k, v in maps.items()}, tmp, metadata=metadata))
        write_text_atomic(self.path / "maps" / f"{run_id}.json", json.dumps([dataclasses.asdict(r) for r in records]))

    def finish(self) -> None:
        """Rewrites ``results.csv`` and ``table.md`` from the rows."""
        keys = sorted({k for r in self.rows for k in r if not isinstance(r[k], dict)})

        def write_csv(tmp: Path) -> None:
            with tmp.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(self.rows)

        write_with(self.path / "results.csv", write_csv)
        write_text_atomic(self.table_path, markdown_table(self.rows))

    def logger(self, config: AblationConfig, env: dict[str, Any]) -> WandbLogger:
        return WandbLogger(config, env, self.path)


def current_counts(rows: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    """The rows whose FLOPs the current counter made; the others are left out with a warning, so that their
    runs are measured again (their images are reused)."""
    import warnings

    stale = set(other_counter_runs(rows))
    if stale:
        warnings.warn(f"{other_counter_message(path, sorted(stale))}; they are measured again, reusing their images",
                      stacklevel=3)
    return [r for r in rows if r["run"] not in stale]


def other_counter_runs(rows: list[dict[str, Any]]) -> list[str]:
    """Runs with a row whose FLOPs another FLOP counter made (``flop_counter`` is not
    :data:`~tomerge.experiments.measure.flops.COUNTER_VERSION`): their FLOP-ideal speed-ups follow other rules."""
    from ..measure.flops import COUNTER_VERSION

    return list(dict.fromkeys(r["run"] for r in rows if "flops" in r and r.get("flop_counter") != COUNTER_VERSION))


def other_counter_message(path: Path, runs: list[str]) -> str:
    from ..measure.flops import COUNTER_VERSION

    shown = ", ".join(runs[:3]) + (", ..." if len(runs) > 3 else "")
    return f"{path}: {len(runs)} runs ({shown}) have FLOPs of another FLOP counter (not version {COUNTER_VERSION})"


def _same_setting(saved: Any, current: Any) -> bool:
    """A config value saved in a run folder means the current one. A key that the saved mapping lacks (a
    setting added since, e.g. ``model.offload``) matches its off value, ``None``."""
    if isinstance(saved, dict) and isinstance(current, dict):
        return all(_same_setting(saved[k], v) if k in saved else v is None for k, v in current.items()) \
            and set(saved) <= set(current)
    return saved == current


def _plain(value: Any) -> Any:
    return yaml.safe_load(yaml.safe_dump(value))


def format_value(value: Any) -> str:
    """A number of a results table as tables print it (``-`` for none; 3 significant digits below 100)."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if value == float("inf") else f"{value:.3g}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def _cell(row: dict[str, Any], key: str) -> str:
    if key == "timing_spread" and row.get(key) is not None:
        return f"{100 * row[key]:.0f}%" + (" (noisy)" if row.get("timing_noisy") else "")
    return format_with_interval(row, key)


def format_with_interval(row: dict[str, Any], key: str) -> str:
    """A row's value as tables print it, followed by its 95% interval ``[lo, hi]`` when the row has one
    (``measure.intervals``).

    Example:
        >>> format_with_interval({"psnr": 31.234, "psnr_lo": 30.51, "psnr_hi": 31.9}, "psnr")
        '31.2 [30.5, 31.9]'
    """
    text = format_value(row.get(key))
    interval = row_interval(row, key)
    if row.get(key) is None or interval is None:
        return text
    return f"{text} [{format_value(interval[0])}, {format_value(interval[1])}]"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The ablation table: one row per run; a column for every key some row has. A run whose timing
    repeats disagree by more than 10% (max - min over the median) is marked ``(noisy)``."""
    columns = [(k, t) for k, t in TABLE_COLUMNS if k in ("run", "ratio") or any(r.get(k) is not None for r in rows)]
    cells = [[_cell(row, k) for k, _ in columns] for row in rows]
    lines = [format_markdown_table([title for _, title in columns], cells, [k != "run" for k, _ in columns])]
    if any(r.get(interval_keys(k)[0]) is not None for r in rows for k, _ in columns):
        lines.append("\n[lo, hi]: the 95% interval (quality: over the images, paired with the baseline's images of the "
                     "same seeds (bootstrap; FD: jackknife); speed-up: over the paired timing rounds; docs/experiments.md).")
    if any(r.get("timing_noisy") for r in rows):
        lines.append("\n(noisy): the timing repeats of that run disagree by more than 10%; its speed-up is not "
                     "reliable (rerun with more `repeats` on a quiet machine).")
    return "\n".join(lines) + "\n"


def wandb_mode(requested: str) -> str:
    """``auto`` means online with a configured API key, offline otherwise (no account, no network)."""
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    has_key = bool(os.environ.get("WANDB_API_KEY"))
    netrc = Path.home() / ".netrc"
    if not has_key and netrc.exists():
        has_key = "api.wandb.ai" in netrc.read_text()
    return "online" if has_key else "offline"


class WandbLogger:
    """One W&B run per ablation (resumed with the folder): config, one row of metrics per run,
    image grids, merge maps, and the results table at the end."""

    def __init__(self, config: AblationConfig, env: dict[str, Any], folder: Path) -> None:
        self.mode = wandb_mode(config.wandb)
        self.run = None
        if self.mode == "disabled":
            return
        import wandb

        id_file = folder / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        write_text_atomic(id_file, run_id)
        self.run = wandb.init(project="tomerge", name=config.name, id=run_id, resume="allow", dir=str(folder),
                              mode=self.mode, config={**config.to_dict(), **env}, reinit="finish_previous",
                              settings=wandb.Settings(silent=True, console="off"))

    def row(self, row: dict[str, Any], images: list[Path] | None = None, prompts: list[str] | None = None,
            maps: dict[str, Tensor] | None = None, grids: dict[str, tuple[int, ...]] | None = None) -> None:
        """One run's metrics, its first images (each with its prompt as caption; a video as one row of its
        frames, and as a video, ``videos/<run>``) and merge maps (``grids``: each map's token grid, ``(H, W)`` or
        ``(T, H, W)``)."""
        if self.run is None:
            return
        import wandb

        payload: dict[str, Any] = {f"{row['run']}/{k}": v for k, v in row.items()
                                   if isinstance(v, (int, float)) and v is not None}
        if images:
            video = images[0].is_dir()
            first = images[:GRID_VIDEOS if video else GRID_IMAGES]
            if video:
                videos = [load_video(f) for f in first]  # each [T, C, H, W]
                strips = [image_grid(frames, columns=frames.shape[0]) for frames in videos]
                payload[f"videos/{row['run']}"] = [
                    wandb.Video(gif_bytes(frames), format="gif",
                                caption=prompts[k] if prompts is not None else first[k].name)
                    for k, frames in enumerate(videos)]
            else:
                loaded = load_image_files(first)  # [k, C, H, W]
                strips = [image_grid(loaded[k:k + 1], columns=1) for k in range(len(first))]
            payload[f"images/{row['run']}"] = [
                wandb.Image(strip.numpy(), caption=prompts[k] if prompts is not None else first[k].name)
                for k, strip in enumerate(strips)]
        for key, slots in (maps or {}).items():
            grid = (grids or {}).get(key)
            payload[f"maps/{row['run']}/{key}"] = wandb.Image(merge_map_rgb(slots, grid).numpy())
        self.run.log(payload)

    def finish(self, folder: RunFolder) -> None:
        if self.run is None:
            return
        import wandb

        columns = [k for key, _ in TABLE_COLUMNS
                   for k in (key, *interval_keys(key)) if k == key or any(k in r for r in folder.rows)]
        table = wandb.Table(columns=columns, data=[[r.get(k) for k in columns] for r in folder.rows])
        self.run.log({"ablation": table})
        self.run.summary.update({f"{r['run']}/{k}": r.get(k) for r in folder.rows for k in columns[2:]})
        self.run.finish()


def gif_bytes(frames: Tensor, fps: int = VIDEO_FPS) -> io.BytesIO:
    """A video ``[T, C, H, W]`` in [-1, 1] as an animated GIF (looping, ``fps`` frames per second), in memory:
    what ``wandb.Video`` takes without a video encoder installed."""
    from PIL import Image

    images = [Image.fromarray(image_grid(frame[None], columns=1).numpy()) for frame in frames]  # [H, W, 3] each
    buffer = io.BytesIO()
    images[0].save(buffer, format="GIF", save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    buffer.seek(0)
    return buffer
