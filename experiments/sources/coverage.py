"""`tomerge backbones`: which diffusers model classes tomerge merges, read from the installed diffusers and the
registered backbone adapters (no model is built, nothing is downloaded).

    tomerge backbones                                     # one line per class
    tomerge backbones --json                              # one JSON object per class
    tomerge backbones --markdown > docs/backbones/coverage.md

Every cell comes from the adapters' declarations and from the rule :func:`tomerge.apply` refuses by
(:func:`tomerge.attach.refusal`), so the table cannot drift from what ``apply`` does. How each column is read:
docs/backbones/adding-a-family.md, "What `tomerge backbones` lists".
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tomerge.adapter import KindSummary

__all__ = ["NOT_MERGED", "NOT_DECLARED", "PAGE", "Row", "Coverage", "model_classes", "coverage", "default_ratio",
           "caches_blocks", "composition", "runnable_strategies", "text_table", "json_lines", "markdown"]

# Why a class of diffusers.models.transformers is not merged, for the classes that are no image or video
# generator from text (or are a part of another model). A class neither here nor named by an adapter reads
# NOT_DECLARED.
NOT_MERGED: dict[str, str] = {
    "AceStepTransformer1DModel": "audio (music) generation: a 1-D sequence, no image or video token grid",
    "DreamLiteTransformer2DModel": "a transformer stage inside the DreamLite UNet, not a model of its own",
    "Kandinsky6SRTransformer3DModel": "video super-resolution (an upsampler of Kandinsky 6 videos), text-free",
    "LongCatAudioDiTTransformer": "audio generation: a 1-D sequence, no image or video token grid",
    "MiniMaxMusic3RVQDepthDecoder": "the audio-codebook language model of MiniMax Music 3, not a diffusion transformer",
    "MiniMaxMusic3Transformer1DModel": "audio (music) generation: a 1-D sequence, no image or video token grid",
    "PriorTransformer": "a prior (unCLIP, Kandinsky 2, Shap-E): text embeddings to image embeddings, no image tokens",
    "RFD4ProteinaTransformer": "protein structure generation: residues, no image or video token grid",
    "SanaWMLTX2RefinerTransformer3DModel": "the chunk-causal refiner stage of SANA-WM, not a text-to-video model",
    "StableAudio3DiTModel": "audio generation: a 1-D sequence, no image or video token grid",
    "StableAudioDiTModel": "audio generation: a 1-D sequence, no image or video token grid",
    "T5FilmDecoder": "the spectrogram decoder of music spectrogram diffusion: audio",
    "Transformer2DModel": "a transformer stage inside UNets (merged through UNet2DConditionModel), not a model of its own",
    "TransformerTemporalModel": "the temporal layers of video UNets: attention across frames, no spatial token grid",
}
NOT_DECLARED = "not declared yet"

PAGE = "docs/backbones/coverage.md"
REGENERATE = f"tomerge backbones --markdown > {PAGE}"


@dataclasses.dataclass(frozen=True)
class Row:
    """One model class: merged (``backbone`` set) or not (``reason`` set).

    Args:
        model_class: the class name.
        module: the diffusers module defining it.
        backbone: the registered adapter that merges it, or ``None``.
        strategies: the registered merging strategies and schedules that run on it, sorted.
        grid_dims: 2 or 3 (the adapter's token grid); ``None`` when not merged.
        kinds: what the adapter merges per block kind (empty: merged, but not declared by the adapter).
        probed: the block kinds with a received-attention probe.
        reason: why it is not merged; ``None`` when merged.
        caching: the registered caching schedules that run on it, sorted.
        compositions: the compositions that run on it (:func:`composition`: ``fora(merge=tomesd)``), in the order
            of the caching schedules, then of the strategies.
        refused: ``(name, reason)`` of every strategy, caching schedule and composition that
            :func:`tomerge.apply` refuses on it, in that order.
    """

    model_class: str
    module: str
    backbone: str | None = None
    strategies: tuple[str, ...] = ()
    grid_dims: int | None = None
    kinds: tuple[KindSummary, ...] = ()
    probed: frozenset[str] = frozenset()
    reason: str | None = None
    caching: tuple[str, ...] = ()
    compositions: tuple[str, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()

    def to_json(self, diffusers_version: str) -> dict[str, Any]:
        """The ``--json`` object of the row."""
        return {"class": self.model_class, "backbone": self.backbone, "strategies": list(self.strategies),
                "caching": list(self.caching), "compositions": list(self.compositions),
                "refused": dict(self.refused), "reason": self.reason, "grid_dims": self.grid_dims,
                "kinds": [{**dataclasses.asdict(k), "probe": k.kind in self.probed} for k in self.kinds],
                "module": self.module, "diffusers": diffusers_version}


@dataclasses.dataclass(frozen=True)
class Coverage:
    """The table: one row per model class (sorted by name), the registered merging strategies, caching schedules
    and compositions, and the adapters of models that are no class of this diffusers (``(backbone, why)``)."""

    diffusers_version: str
    rows: tuple[Row, ...]
    strategies: tuple[str, ...]
    other_backbones: tuple[tuple[str, str], ...]
    caching: tuple[str, ...] = ()
    compositions: tuple[str, ...] = ()

    @property
    def merged(self) -> tuple[Row, ...]:
        return tuple(row for row in self.rows if row.backbone is not None)


def model_classes() -> dict[str, type]:
    """Name -> class of every ``ModelMixin`` subclass that ``diffusers.models.transformers`` exports, and of
    ``UNet2DConditionModel``, sorted by name."""
    import diffusers
    import diffusers.models.transformers as transformers
    from diffusers.models.modeling_utils import ModelMixin

    classes = {name: value for name, value in vars(transformers).items()
               if isinstance(value, type) and issubclass(value, ModelMixin)}
    classes["UNet2DConditionModel"] = diffusers.UNet2DConditionModel
    return dict(sorted(classes.items()))


def default_ratio(name: str) -> float | None:
    """The ratio the table checks a registered name at: 0.5 for a strategy, ``None`` for a schedule (its own
    default; a caching schedule without a merging strategy takes none)."""
    from tomerge.registry import strategy_class
    from tomerge.schedule import Schedule

    return None if issubclass(strategy_class(name), Schedule) else 0.5


def caches_blocks(name: str) -> bool:
    """Whether the registered strategy or schedule ``name`` is a caching schedule: it skips whole block calls
    (``Schedule.caches_blocks``: ``block_cache``, ``fora``, ``taylorseer``, ``first_block_cache``) or reuses sublayer
    outputs (``Schedule.reused_sublayers``: ``toca``)."""
    from tomerge.attach import check_options

    schedule = check_options(name, ratio=default_ratio(name))
    return bool(schedule.caches_blocks or schedule.reused_sublayers)


def takes_merge(name: str) -> bool:
    """Whether the registered caching schedule ``name`` composes with a merging strategy or schedule (``merge=``)."""
    import dataclasses as _dataclasses

    from tomerge.registry import strategy_class

    return any(f.name == "merge" and f.init for f in _dataclasses.fields(strategy_class(name)))


def composition(caching: str, merge: str) -> str:
    """The name of a composition in the table: ``fora(merge=tomesd)``."""
    return f"{caching}(merge={merge})"


CACHING_NOTE = ("Caching schedules ({names}; docs/schedules.md) and their compositions with a merging strategy "
                "(`fora(merge=tomesd)`: `merge=` any strategy or merging schedule, at ratio 0.5 or its own default) "
                "run on a class unless refused below, by the rule `tomerge.apply` refuses by "
                "(`tomerge.attach.refusal`): what they need recorded (`toca` and a composition with a strategy that "
                "needs received attention: every block kind probed), and whole blocks skipped (the step-level ones) "
                "only where the adapter does not declare them unskippable (`wan_vace`'s control blocks return a new "
                "hint, no residual). A block that returns a tuple its adapter does not declare (`BlockSpec.outputs`) "
                "stops the first call with a TypeError naming it. Step-level caching is tested for `native_dit`, "
                "`dit`, `sana`, `wan`, `qwenimage` and the families whose blocks return two streams, `auraflow`, "
                "`bria`, `bria_fibo`, `chroma`, `cogvideox`, `cogview3plus`, `cogview4`, `consisid`, `easyanimate`, "
                "`flux3`, `glm_image`, `hidream`, `longcat_image`, `mochi`, `ovis_image` "
                "(`tests/strategies/test_caching.py`), and for the video and audio streams of `kandinsky6` and `ltx2` "
                "(`tests/strategies/test_caching.py`, `tests/backbones/test_kandinsky6.py`, "
                "`tests/backbones/test_ltx2.py`); `toca` (a joint attention's whole output is reused, text included) "
                "for `native_dit`, `dit`, `pixart`, `sd3`, `lumina2`, `chroma`, `flux2`, `qwenimage`, `cogview4`, "
                "`wan`, `hunyuan_video` (`tests/strategies/test_toca.py`), `ltx` and `cogvideox` "
                "(`tests/experiments/test_ablate_video_pipelines.py`), `skyreels_v2` and `ltx2` "
                "(`tests/experiments/test_ablate_skips_forcing_and_audio.py`), `kandinsky6` and `ltx2` "
                "(`tests/strategies/test_caching.py`).")


def runnable_strategies(adapter: type, strategies: Sequence[str]) -> tuple[str, ...]:
    """The ones of ``strategies`` (registered names) that run on ``adapter`` with their default options (at
    :func:`default_ratio`): those :func:`tomerge.attach.refusal` does not refuse."""
    return tuple(name for name, reason in _cells(adapter, {name: _schedule(name, adapter) for name in strategies})
                 if reason is None)


def _schedule(name: str, adapter: type | None = None, merge: str | None = None):
    """The schedule ``tomerge.apply`` runs for the registered ``name`` at its defaults (with ``merge=``, at the
    merging strategy's :func:`default_ratio`)."""
    from tomerge.attach import check_options

    backbones = None if adapter is None else [adapter.name]
    if merge is None:
        return check_options(name, ratio=default_ratio(name), backbones=backbones)
    return check_options(name, merge=merge, ratio=default_ratio(merge), backbones=backbones)


def _cells(adapter: type, schedules: dict[str, Any]) -> list[tuple[str, str | None]]:
    """``(name, why apply refuses it or None)`` for each named schedule on ``adapter``."""
    from tomerge.attach import refusal

    kinds = [k.kind for k in adapter.kind_summaries()]
    return [(name, refusal(adapter, kinds, schedule)) for name, schedule in schedules.items()]


def coverage(backbones: Sequence[str] | None = None, strategies: Sequence[str] | None = None) -> Coverage:
    """The table for the installed diffusers and the given registered names (default: every registered backbone,
    strategy and schedule)."""
    import diffusers

    import tomerge
    from tomerge.registry import backbone_class

    backbones = sorted(tomerge.list_backbones() if backbones is None else backbones)
    everything = sorted(tomerge.list_strategies() if strategies is None else strategies)
    caching = tuple(name for name in everything if caches_blocks(name))
    strategies = tuple(name for name in everything if name not in caching)
    # the schedules are built once (the adapter's options do not change them): merging, caching, compositions
    schedules = {name: _schedule(name) for name in (*strategies, *caching)}
    compositions = {composition(c, m): _schedule(c, merge=m) for c in caching if takes_merge(c) for m in strategies}
    classes = model_classes()
    claimed: dict[str, type] = {}
    others: list[tuple[str, str]] = []
    for name in backbones:
        adapter = backbone_class(name)
        if not adapter.model_class:
            others.append((name, "not a diffusers model class"))
        elif adapter.model_class not in classes:
            others.append((name, f"{adapter.model_class}: not a model class of diffusers {diffusers.__version__}"))
        elif adapter.model_class in claimed:
            others.append((name, f"{adapter.model_class}: merged by {claimed[adapter.model_class].name!r}, registered "
                                 "first"))
        else:
            claimed[adapter.model_class] = adapter
    rows = []
    for class_name, cls in classes.items():
        adapter = claimed.get(class_name)
        if adapter is None:
            rows.append(Row(class_name, cls.__module__, reason=NOT_MERGED.get(class_name, NOT_DECLARED)))
            continue
        cells = _cells(adapter, {**schedules, **compositions})
        runs = {name for name, reason in cells if reason is None}
        rows.append(Row(class_name, cls.__module__, backbone=adapter.name,
                        strategies=tuple(s for s in strategies if s in runs), grid_dims=adapter.grid_dims,
                        kinds=adapter.kind_summaries(), probed=adapter.probed_kinds(),
                        caching=tuple(c for c in caching if c in runs),
                        compositions=tuple(c for c in compositions if c in runs),
                        refused=tuple((name, reason) for name, reason in cells if reason is not None)))
    return Coverage(diffusers.__version__, tuple(rows), strategies, tuple(others), caching, tuple(compositions))


# ---------------------------------------------------------------------- output
def _strategies_text(row: Row, all_strategies: tuple[str, ...]) -> str:
    """``all``, ``all but idm, sdtm`` or ``tomesd, ssm``: the shortest of the last two."""
    if row.strategies == all_strategies:
        return "all"
    missing = [s for s in all_strategies if s not in row.strategies]
    listed = ", ".join(row.strategies) or "none"
    return f"all but {', '.join(missing)}" if len(missing) < len(row.strategies) else listed


def _kind_text(kind: KindSummary) -> str:
    rope = f"RoPE {kind.rope}" if kind.rope else "no RoPE"
    return f"{kind.kind}: {' '.join(kind.sublayers)} ({rope}; {kind.context})"


def _caching_text(row: Row, all_caching: tuple[str, ...]) -> str:
    """``all``, ``none`` or the caching schedules of the row."""
    return "all" if row.caching == all_caching else ", ".join(row.caching) or "none"


def _compositions_text(row: Row, all_compositions: tuple[str, ...]) -> str:
    """``all``, ``none`` or ``N of M``: how many of the compositions run."""
    if row.compositions == all_compositions:
        return "all"
    return f"{len(row.compositions)} of {len(all_compositions)}" if row.compositions else "none"


def refused_groups(row: Row) -> list[tuple[str, str]]:
    """``(names, reason)`` per distinct reason of the row's refused cells, in order: the names of the refused
    strategies and caching schedules, then its compositions, ``fora(merge=*)`` where every composition of ``fora``
    is refused for that reason."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in row.refused:
        by_reason.setdefault(reason, []).append(name)
    groups = []
    for reason, names in by_reason.items():
        plain = [n for n in names if "(" not in n]
        composed: dict[str, list[str]] = {}
        for n in names:
            if "(" in n:
                composed.setdefault(n.split("(", 1)[0], []).append(n)
        total = {c: sum(1 for n, _ in row.refused if n.startswith(f"{c}(")) + sum(1 for n in row.compositions
                                                                               if n.startswith(f"{c}("))
                 for c in composed}
        listed = [*plain]
        for caching, members in composed.items():
            listed += [composition(caching, "*")] if len(members) == total[caching] else members
        groups.append((", ".join(listed), reason))
    return groups


def text_table(table: Coverage) -> str:
    """What ``tomerge backbones`` prints: a summary line, then one line per class (merged: backbone, grid,
    strategies, caching schedules, compositions, block kinds, then an indented line per reason of its refused
    cells; not merged: the reason)."""
    lines = [f"{len(table.merged)} of {len(table.rows)} model classes of diffusers {table.diffusers_version} are "
             f"merged by tomerge (all = {len(table.strategies)} strategies and schedules: "
             f"{', '.join(table.strategies)}; caching: all = {', '.join(table.caching)}; compositions: all = each "
             f"of {', '.join(c for c in table.caching if takes_merge(c))} with merge= each strategy, "
             f"{len(table.compositions)})"]
    width = max(len(row.model_class) for row in table.rows)
    backbone_width = max([len(row.backbone) for row in table.merged] + [1])
    for row in table.rows:
        if row.backbone is None:
            lines.append(f"{row.model_class:<{width}}  {'-':<{backbone_width}}  {row.reason}")
            continue
        kinds = " | ".join(_kind_text(kind) for kind in row.kinds) or "block kinds not declared"
        lines.append(f"{row.model_class:<{width}}  {row.backbone:<{backbone_width}}  {row.grid_dims}-D  "
                     f"strategies: {_strategies_text(row, table.strategies)}  "
                     f"caching: {_caching_text(row, table.caching)}  "
                     f"compositions: {_compositions_text(row, table.compositions)}  {kinds}")
        lines += [f"    refused {names}: {reason}" for names, reason in refused_groups(row)]
    lines += [f"other backbone {name}: {why}" for name, why in table.other_backbones]
    return "\n".join(lines)


def json_lines(table: Coverage) -> str:
    """What ``tomerge backbones --json`` prints: one JSON object per class (:meth:`Row.to_json`)."""
    return "\n".join(json.dumps(row.to_json(table.diffusers_version)) for row in table.rows)


def _per_kind(values: list[str]) -> str:
    """One cell for the kinds of a class: the value once when every kind has it, else one line per kind."""
    return values[0] if len(set(values)) == 1 else "<br>".join(values)


def markdown(table: Coverage) -> str:
    """The page ``docs/backbones/coverage.md`` (``tomerge backbones --markdown``)."""
    out = [
        "# Backbone coverage",
        "",
        f"Which model classes of diffusers {table.diffusers_version} tomerge merges: every model class that "
        "`diffusers.models.transformers` exports, and `UNet2DConditionModel`. The page is generated; regenerate it "
        "with",
        "",
        "```bash",
        REGENERATE,
        "```",
        "",
        "(`tomerge backbones --json` prints the same per class as JSON; "
        "[adding-a-family.md](adding-a-family.md#what-tomerge-backbones-lists) says how each column is read from the "
        "registered adapters). `tests/experiments/test_coverage.py` fails when the page is not what the command "
        "prints for the installed diffusers, or when a class merged here is no longer merged with these strategies.",
        "",
        f"{len(table.merged)} of {len(table.rows)} classes are merged. Strategies and schedules: "
        f"{', '.join(f'`{s}`' for s in table.strategies)}.",
        "",
        *([CACHING_NOTE.format(names=", ".join(f"`{s}`" for s in table.caching)), ""] if table.caching else []),
        f"Compositions: each of {', '.join(f'`{c}`' for c in table.caching if takes_merge(c))} with `merge=` each "
        f"strategy and schedule above ({len(table.compositions)}); the column says how many run (all: every one).",
        "",
        "## Merged",
        "",
        "| model class | backbone | grid | strategies | caching | compositions | block kinds: sublayers | RoPE | "
        "text / context |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in table.merged:
        kinds = [f"{k.kind}: {', '.join(k.sublayers)}" for k in row.kinds] or ["not declared"]
        ropes = [k.rope or "none" for k in row.kinds] or ["?"]
        contexts = [k.context for k in row.kinds] or ["?"]
        out.append(f"| `{row.model_class}` | `{row.backbone}` | {row.grid_dims}-D | {', '.join(row.strategies)} | "
                   f"{', '.join(row.caching) or 'none'} | {_compositions_text(row, table.compositions)} | "
                   f"{'<br>'.join(kinds)} | {_per_kind(ropes)} | {_per_kind(contexts)} |")
    refused = [(row, names, reason) for row in table.merged for names, reason in refused_groups(row)]
    if refused:
        out += ["", "## Refused", "", "What `tomerge.apply` refuses on a merged class, with its one-line reason "
                "(`fora(merge=*)`: every composition of `fora`).", "", "| model class | refused | why |",
                "|---|---|---|"]
        out += [f"| `{row.model_class}` | {', '.join(f'`{n}`' for n in names.split(', '))} | {reason} |"
                for row, names, reason in refused]
    out += ["", "## Not merged", "", "| model class | why not |", "|---|---|"]
    out += [f"| `{row.model_class}` | {row.reason} |" for row in table.rows if row.backbone is None]
    if table.other_backbones:
        out += ["", "## Backbones of other models", "", "| backbone | model |", "|---|---|"]
        out += [f"| `{name}` | {why} |" for name, why in table.other_backbones]
    return "\n".join(out) + "\n"
