"""Prompt sets for text-to-image experiments: which file, which format, which prompts are used.

Everything is read offline from a local file, in one of the formats ``txt``, ``jsonl``, ``coco``, ``parti``
(PartiPrompts' TSV) or ``classes`` (class names turned into prompts by a template); ``auto`` picks one by the
file's extension. The formats and their rules: docs/experiments.md, "The prompts".

>>> import pathlib, tempfile
>>> path = pathlib.Path(tempfile.mkdtemp(), "prompts.txt")
>>> _ = path.write_text("a red cube\\n\\n  a corgi # on a sofa \\n")
>>> PromptSet(str(path)).prompts()
['a red cube', 'a corgi # on a sofa']
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
from pathlib import Path
from typing import Any

FORMATS = ("auto", "txt", "jsonl", "coco", "parti", "classes")
COCO_CAPTION_RULES = ("first", "longest")
DEFAULT_TEMPLATE = "a photo of a {name}"


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Where prompts come from and which of them are used.

    Args:
        file: the prompt file (a local path).
        format: ``auto`` (by extension: ``.txt`` txt, ``.jsonl`` jsonl, ``.tsv`` parti, ``.json``
            coco or classes by content), ``txt``, ``jsonl``, ``coco``, ``parti`` or ``classes``.
        field: jsonl only: the key holding the prompt (default: ``"prompt"``, else ``"caption"``).
        template: classes only: each class name becomes ``template.format(name=name)``; must
            contain ``{name}``.
        num_prompts: how many prompts are used (``None``: all after the offset; fewer when the file
            has fewer).
        prompt_offset: prompts skipped at the start of the file.
        images_per_prompt: images the caller makes per prompt; recorded here, it does not change
            :meth:`prompts`.
        coco_caption: coco only: which caption of an image: ``first`` (smallest annotation id) or
            ``longest`` (SDTM's sampler keeps each image's longest caption).
        image_field: jsonl only: the key holding each prompt's input image (a PNG/JPEG path, relative to the
            prompt file's folder or absolute), for editing pipelines that take ``image=`` (FLUX.1 Kontext,
            Qwen-Image-Edit, FLUX.2 with reference images); ``None``: no input images.

    >>> ps = PromptSet("captions.json", num_prompts=100, images_per_prompt=2)
    >>> ps.format, ps.num_prompts, ps.prompt_offset, ps.images_per_prompt
    ('auto', 100, 0, 2)
    """

    file: str
    format: str = "auto"
    field: str | None = None
    template: str = DEFAULT_TEMPLATE
    num_prompts: int | None = None
    prompt_offset: int = 0
    images_per_prompt: int = 1
    coco_caption: str = "first"
    image_field: str | None = None

    def __post_init__(self):
        if isinstance(self.file, os.PathLike):
            object.__setattr__(self, "file", os.fspath(self.file))
        if not isinstance(self.file, str) or not self.file:
            raise ValueError(f"prompts: file must be a non-empty path, got {self.file!r}")
        _check_format(self.format)
        if self.field is not None and (not isinstance(self.field, str) or not self.field):
            raise ValueError(f"prompts: field must be a non-empty string or None, got {self.field!r}")
        _check_template(self.template)
        if self.image_field is not None:
            if not isinstance(self.image_field, str) or not self.image_field:
                raise ValueError(f"prompts: image_field must be a non-empty string or None, got {self.image_field!r}")
            if self.format not in ("auto", "jsonl") or (self.format == "auto"
                                                        and Path(self.file).suffix.lower() != ".jsonl"):
                raise ValueError(f"prompts: image_field reads input images from a jsonl file; {self.file!r} is "
                                 f"read as {self.format}")
        if self.coco_caption not in COCO_CAPTION_RULES:
            raise ValueError(f"prompts: coco_caption must be one of {list(COCO_CAPTION_RULES)}, got {self.coco_caption!r}")
        if self.num_prompts is not None and (not _is_int(self.num_prompts) or self.num_prompts < 1):
            raise ValueError(f"num_prompts must be an integer >= 1 or None (all), got {self.num_prompts!r}")
        if not _is_int(self.prompt_offset) or self.prompt_offset < 0:
            raise ValueError(f"prompt_offset must be an integer >= 0, got {self.prompt_offset!r}")
        if not _is_int(self.images_per_prompt) or self.images_per_prompt < 1:
            raise ValueError(f"images_per_prompt must be an integer >= 1, got {self.images_per_prompt!r}")

    @classmethod
    def from_config(cls, value: str | os.PathLike | dict | None, **overrides: Any) -> PromptSet | None:
        """A prompt set from a config value: a path, or a mapping of the fields; ``None`` gives ``None``.

        ``overrides`` (fields, e.g. a config's top-level ``num_prompts``) replace the value's fields.
        Unknown keys, in the mapping or the overrides, raise naming the valid ones.

        >>> PromptSet.from_config("parti.tsv", num_prompts=8)
        PromptSet(file='parti.tsv', format='auto', field=None, template='a photo of a {name}', num_prompts=8, prompt_offset=0, images_per_prompt=1, coco_caption='first', image_field=None)
        >>> PromptSet.from_config({"file": "classes.txt", "format": "classes", "template": "a {name}"}).template
        'a {name}'
        >>> PromptSet.from_config(None) is None
        True
        """
        if value is None:
            return None
        if isinstance(value, (str, os.PathLike)):
            values: dict[str, Any] = {"file": value}
        elif isinstance(value, dict):
            values = dict(value)
        else:
            raise TypeError(f"prompts: expected a file path or a mapping of {_field_names()}, "
                            f"got {type(value).__name__}")
        values.update(overrides)
        unknown = sorted(set(values) - set(_field_names()))
        if unknown:
            import difflib

            close = {u: m[0] for u in unknown if (m := difflib.get_close_matches(str(u), _field_names(), n=1))}
            hint = f" (did you mean {', '.join(f'{m!r} for {u!r}' for u, m in close.items())}?)" if close else ""
            raise ValueError(f"unknown prompts key(s) {unknown}; valid keys: {_field_names()}{hint}")
        if "file" not in values:
            raise ValueError(f"prompts: a mapping needs 'file'; valid keys: {_field_names()}")
        return cls(**values)

    def read(self) -> list[str]:
        """All prompts of the file, in file order, before ``prompt_offset`` and ``num_prompts``.

        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp(), "prompts.jsonl")
        >>> _ = path.write_text('{"prompt": "a fox"}\\n{"caption": "a boat"}\\n')
        >>> PromptSet(str(path), prompt_offset=1).read()
        ['a fox', 'a boat']
        """
        return read_prompts(self.file, self.format, self.field, self.template, self.coco_caption)

    def images(self) -> list[Path] | None:
        """The input image of each prompt of :meth:`prompts` (``image_field``), or ``None`` without
        ``image_field``. Raises ``ValueError`` for a line without the field and ``FileNotFoundError`` for an
        image file that is not there.

        >>> import pathlib, tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> _ = (folder / "cat.png").write_bytes(b"")
        >>> _ = (folder / "edits.jsonl").write_text('{"prompt": "make it red", "image": "cat.png"}\\n')
        >>> [p.name for p in PromptSet(str(folder / "edits.jsonl"), image_field="image").images()]
        ['cat.png']
        """
        if self.image_field is None:
            return None
        path = Path(self.file)
        images = []
        for lineno, record in _jsonl_records(path):
            value = record.get(self.image_field)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"line {lineno} of {path}: image_field {self.image_field!r} must name an image "
                                 f"file, got {value!r}")
            images.append(path.parent / Path(value.strip()).expanduser())  # an absolute path stays as it is
        stop = None if self.num_prompts is None else self.prompt_offset + self.num_prompts
        chosen = images[self.prompt_offset:stop]
        missing = [str(image) for image in chosen if not image.is_file()]
        if missing:
            raise FileNotFoundError(f"{len(missing)} input images of {path} not found (first: {missing[0]})")
        return chosen

    def prompts(self) -> list[str]:
        """The prompts used: ``read()[prompt_offset:prompt_offset + num_prompts]``.

        Raises ``ValueError`` when that leaves no prompt.

        >>> import pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp(), "prompts.txt")
        >>> _ = path.write_text("one\\ntwo\\nthree\\nfour\\n")
        >>> PromptSet(str(path), prompt_offset=1, num_prompts=2).prompts()
        ['two', 'three']
        """
        everything = self.read()
        stop = None if self.num_prompts is None else self.prompt_offset + self.num_prompts
        chosen = everything[self.prompt_offset:stop]
        if not chosen:
            raise ValueError(f"prompt_offset={self.prompt_offset} leaves no prompts: {self.file} has "
                             f"{len(everything)}")
        return chosen

    def to_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (what a run records); ``from_config`` reads it back.

        >>> d = PromptSet("coco.json", num_prompts=5).to_dict()
        >>> d["file"], d["num_prompts"], PromptSet.from_config(d) == PromptSet("coco.json", num_prompts=5)
        ('coco.json', 5, True)
        """
        return dataclasses.asdict(self)


def read_prompts(path: str | os.PathLike, format: str = "auto", field: str | None = None,
                 template: str = DEFAULT_TEMPLATE, coco_caption: str = "first") -> list[str]:
    """Every prompt of a local file, in order (the formats are in the module docstring).

    ``coco``: ``{"images": [...], "annotations": [{"image_id", "id", "caption"}, ...]}`` gives ONE
    prompt per image: the images that have a caption, in ascending ``image_id`` order; for each, the
    caption of its annotation with the smallest annotation ``id``, stripped and with internal
    whitespace (newlines included) collapsed to single spaces. With ``coco_caption="longest"`` the
    caption with the most characters instead (ties: the smallest annotation id), the rule of SDTM's
    released sampler (``load_captions`` in their ``sample.py``, which keeps images in order of first
    appearance: the same set of prompts, in another order). The order of annotations in the file
    does not matter. COCO-2017 val (``captions_val2017.json``) has 5,000 images, so 5,000 prompts; the
    papers' protocols (e.g. SDTM's) sample from it.

    ``classes``: a ``.json`` file is a list of names, or an ImageNet-style index ordered by integer
    key, ``{"0": ["n01440764", "tench"], ...}`` (the last element is the name) or
    ``{"0": "tench, Tinca tinca", ...}`` (the first comma-separated name); any other file has one
    name per line. Underscores in names become spaces; each name gives ``template.format(name=name)``.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for a file with no prompts or
    one that does not fit its format.

    >>> import json, pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp(), "captions.json")
    >>> _ = path.write_text(json.dumps({"images": [{"id": 7}, {"id": 3}], "annotations": [
    ...     {"image_id": 7, "id": 12, "caption": "A dog."}, {"image_id": 3, "id": 40, "caption": "A cat\\n on a mat. "},
    ...     {"image_id": 3, "id": 41, "caption": "A kitten."}, {"image_id": 7, "id": 11, "caption": "A puppy."}]}))
    >>> read_prompts(path)
    ['A cat on a mat.', 'A puppy.']
    >>> _ = path.write_text(json.dumps({"0": ["n01440764", "tench"], "1": ["n01443537", "goldfish"]}))
    >>> read_prompts(path, template="a photo of a {name}")
    ['a photo of a tench', 'a photo of a goldfish']
    """
    _check_format(format)
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompt file not found: {path}")
    if not path.is_file():
        raise ValueError(f"prompt file {path} is not a file")
    data = None
    if format == "auto":
        format, data = _detect(path)
    if format == "txt":
        prompts = _read_txt(path)
    elif format == "jsonl":
        prompts = _read_jsonl(path, field)
    elif format == "coco":
        prompts = _read_coco(path, _load_json(path) if data is None else data, coco_caption)
    elif format == "parti":
        prompts = _read_parti(path)
    else:
        _check_template(template)
        prompts = [template.format(name=name) for name in _read_class_names(path, data)]
    if not prompts:
        raise ValueError(f"no prompts in {path} (read as {format})")
    return prompts


# -- formats -------------------------------------------------------------------------------------

def _detect(path: Path) -> tuple[str, Any]:
    ext = path.suffix.lower()
    if ext == ".txt":
        return "txt", None
    if ext == ".jsonl":
        return "jsonl", None
    if ext == ".tsv":
        return "parti", None
    if ext == ".json":
        data = _load_json(path)
        if isinstance(data, dict) and "annotations" in data:
            return "coco", data
        if isinstance(data, list) or (isinstance(data, dict) and _is_class_index(data)):
            return "classes", data
        raise ValueError(f"{path} is neither a COCO captions JSON (no 'annotations') nor a list or index of "
                         f"class names; set format: to one of {list(FORMATS[1:])}")
    raise ValueError(f"cannot tell the prompt format of {path} from its extension {ext or '(none)'!r} "
                     f"(known: .txt, .jsonl, .tsv, .json); set format: to one of {list(FORMATS[1:])}")


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8-sig")


def _load_json(path: Path) -> Any:
    try:
        return json.loads(_read_text(path))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def _read_txt(path: Path) -> list[str]:
    return [line.strip() for line in _read_text(path).splitlines() if line.strip()]


def _jsonl_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of every non-blank line of a jsonl file."""
    records = []
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {lineno} of {path} is not valid JSON: {e}") from None
        if not isinstance(record, dict):
            raise ValueError(f"line {lineno} of {path} is not a JSON object")
        records.append((lineno, record))
    return records


def _read_jsonl(path: Path, field: str | None) -> list[str]:
    prompts = []
    for lineno, record in _jsonl_records(path):
        if field is not None:
            if field not in record:
                raise ValueError(f"line {lineno} of {path} has no {field!r} field (field: {field!r})")
            key = field
        elif "prompt" in record:
            key = "prompt"
        elif "caption" in record:
            key = "caption"
        else:
            raise ValueError(f"line {lineno} of {path} has neither a 'prompt' nor a 'caption' field "
                             f"(set field: to the key holding the prompt)")
        value = record[key]
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"line {lineno} of {path}: {key!r} must be a non-empty string, got {value!r}")
        prompts.append(value.strip())
    return prompts


def _read_coco(path: Path, data: Any, rule: str = "first") -> list[str]:
    if not isinstance(data, dict) or "annotations" not in data:
        raise ValueError(f"{path} is not a COCO captions JSON: it has no 'annotations'")
    annotations = data["annotations"]
    if not isinstance(annotations, list):
        raise ValueError(f"{path}: 'annotations' must be a list")
    best: dict[Any, tuple[Any, str]] = {}          # image_id -> (smallest annotation id, its caption)
    for index, ann in enumerate(annotations):
        if not isinstance(ann, dict) or not all(k in ann for k in ("image_id", "id", "caption")):
            raise ValueError(f"{path}: annotation {index} needs 'image_id', 'id' and 'caption', got {ann!r}")
        if not isinstance(ann["caption"], str):
            raise ValueError(f"{path}: annotation id {ann['id']!r} has a caption that is not a string")
        image_id, ann_id = ann["image_id"], ann["id"]
        if image_id not in best or _better(rule, (ann_id, ann["caption"]), best[image_id]):
            best[image_id] = (ann_id, ann["caption"])
    prompts = []
    for image_id in sorted(best, key=_order):
        ann_id, caption = best[image_id]
        caption = " ".join(caption.split())
        if not caption:
            raise ValueError(f"{path}: annotation id {ann_id!r} (image_id {image_id!r}) has an empty caption")
        prompts.append(caption)
    return prompts


def _better(rule: str, candidate: tuple[Any, str], current: tuple[Any, str]) -> bool:
    """Whether ``(annotation id, caption)`` replaces the image's current choice under ``rule``."""
    if rule == "longest" and len(candidate[1].strip()) != len(current[1].strip()):
        return len(candidate[1].strip()) > len(current[1].strip())
    return _order(candidate[0]) < _order(current[0])


def _read_parti(path: Path) -> list[str]:
    # QUOTE_NONE: PartiPrompts.tsv is raw text; a prompt may start with '"' ('"G I G G L E" painted ...').
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        raise ValueError(f"no prompts in {path}: it is empty (a PartiPrompts TSV has a header row with a "
                         f"'Prompt' column)")
    header = [name.strip() for name in rows[0]]
    if "Prompt" not in header:
        raise ValueError(f"{path} has no 'Prompt' column in its header row (tab-separated); its columns: {header}")
    column = header.index("Prompt")
    return [row[column].strip() for row in rows[1:] if len(row) > column and row[column].strip()]


def _read_class_names(path: Path, data: Any) -> list[str]:
    if data is None and path.suffix.lower() == ".json":
        data = _load_json(path)
    if data is None:
        names = _read_txt(path)
    elif isinstance(data, list):
        if not all(isinstance(name, str) for name in data):
            raise ValueError(f"{path}: a JSON list of class names must hold only strings")
        names = data
    elif isinstance(data, dict) and _is_class_index(data):
        names = []
        for key in sorted(data, key=int):
            value = data[key]
            names.append(value[-1] if isinstance(value, list) else value.split(",")[0])
    else:
        raise ValueError(f"{path}: class names must be a JSON list of names or an index like "
                         f'{{"0": ["n01440764", "tench"]}} or {{"0": "tench, Tinca tinca"}}')
    return [" ".join(name.replace("_", " ").split()) for name in names if name.replace("_", " ").strip()]


# -- helpers -------------------------------------------------------------------------------------

def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(PromptSet)]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _order(value: Any) -> tuple[bool, Any]:
    """Sort key for ids: numbers ascending, then strings."""
    return (isinstance(value, str), value)


def _is_class_index(data: dict) -> bool:
    def key_ok(key):
        try:
            int(key)
        except (TypeError, ValueError):
            return False
        return True

    def value_ok(value):
        if isinstance(value, str):
            return True
        return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)

    return all(key_ok(k) and value_ok(v) for k, v in data.items())


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"unknown prompt format {format!r}; valid formats: {list(FORMATS)}")


def _check_template(template: str) -> None:
    if not isinstance(template, str) or "{name}" not in template:
        raise ValueError(f"prompts: template must contain {{name}} (e.g. {DEFAULT_TEMPLATE!r}), got {template!r}")
    try:
        template.format(name="x")
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"prompts: template {template!r} can only use {{name}}: {e!r}") from None
