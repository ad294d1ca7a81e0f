"""``sdtm``: the Structure-then-Detail Token Merging schedule (Fang et al., CVPR 2025, arXiv:2505.11707).

A :class:`~tomerge.Schedule` that merges with :class:`~tomerge.strategies.ssm.SSM` in the structure phase and
:class:`~tomerge.strategies.idm.IDM` in the detail phase at a cosine-scheduled ratio, with protected steps and
layers, prompt token reweighting and an optional feature cache; presets ``sdtm_release`` (the authors' code) and
``sdtm_paper`` (the paper). Every rule, the authors' code it follows and the deviations: docs/schedules.md, "sdtm".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from tomerge.feature_cache import FeatureCaching
from tomerge.options import check_choice, check_int, check_number, check_ratio_option, check_sublayers
from tomerge.schedule import Decision, Schedule, Where, check_attention_runs_before_its_merge
from tomerge.strategy import MergeStrategy
from tomerge.streaks import Streaks

from .idm import IDM
from .sdtm_prompts import PromptCategories
from .ssm import SSM

CURVES = ("cosine", "linear", "constant")
ORDERS = ("structure_first", "detail_first")
MAX_RATIO = 0.99  # upper clamp of the scheduled ratio
STRUCTURE, DETAIL, PROTECTED = "structure", "detail", "protected"


# ---------------------------------------------------------------------- the schedule
@dataclasses.dataclass(frozen=True, kw_only=True)
class SDTM(Schedule):
    """Structure-then-detail schedule (the rules: docs/schedules.md, "sdtm").

    Args:
        ratio: centre of the ratio curve, in ``[0, 1)``.
        deviation: half-width ``dev`` of the curve; ``ratio + dev < 1``. Where the curve is below 0 (only
            when ``ratio - dev < 0``) the ratio is 0: those calls merge nothing.
        switch: last progress of the structure phase, in ``[0, 1]`` (``p <= switch`` is structure).
        switch_step: absolute last structure step (``step <= switch_step``); overrides ``switch``.
        curve: ``"cosine"`` (authors), ``"linear"`` or ``"constant"``.
        order: ``"structure_first"`` (SDTM) or ``"detail_first"`` (the paper's reversed-order ablation: IDM
            up to the switch, SSM after it).
        protect_every: run the full block on steps with ``step % k == 0``; ``None``: off.
        protect_layers: layer indices (the adapter's block positions) never merged.
        protect_layers_every: protect layers with ``layer % k == 0`` and the last layer; ``None``: off.
        structure_sublayers: where SSM merges (default attention and MLP).
        detail_sublayers: where IDM merges (default MLP only; ``"attn"`` only with ``idm_variant="streak"``:
            the attention variant's received attention is recorded after the attention ran).
        window: ``k x k`` window side of both SSM and IDM.
        temporal_window: window depth in frames of both SSM and IDM on a ``(T, H, W)`` grid (1: per frame).
        alpha_s: SSM persistence-prior weight.
        round_windows: SSM rounds the merged-window count down to a multiple of this (1: off).
        include_self: SSM ``include_self``: the window score averages all ``K * K`` similarity pairs, the
            diagonal included (the authors' code), not the ``K * (K - 1)`` off-diagonal ones (the paper).
        alpha_d: IDM streak weight.
        idm_variant: IDM ``variant``: ``"attention"`` (paper) or ``"streak"`` (released code).
        idm_local: IDM ``local``: merge each source into its own window's destination only.
        idm_plan_from: IDM ``plan_from``: ``"block_input"`` (the block's input, the closest reachable to the
            authors' ``norm1`` output) or ``"sublayer"`` (the MLP input).
        idm_round_tokens: IDM ``round_tokens`` (round the removed count down to a multiple); ``None``: the
            variant's default (16 for ``"streak"``, 1 for ``"attention"``).
        prompt_reweight: ``a_p`` of prompt reweighting (active only with prompt categories); ``None``: off.
        cache_weight: ``w`` of the feature cache (the authors' ``mcw``), in ``[0, 1]``; ``None``: off. Needs
            ``protect_every``.
    """

    name: ClassVar[str] = "sdtm"

    ratio: float = 0.3
    deviation: float = 0.0
    switch: float = 0.4
    switch_step: int | None = None
    curve: str = "cosine"
    order: str = "structure_first"
    protect_every: int | None = None
    protect_layers: tuple[int, ...] = ()
    protect_layers_every: int | None = None
    structure_sublayers: tuple[str, ...] = ("attn", "mlp")
    detail_sublayers: tuple[str, ...] = ("mlp",)
    window: int = 2
    temporal_window: int = 1
    alpha_s: float = 0.05
    round_windows: int = 16
    include_self: bool = False
    alpha_d: float = 0.05
    idm_variant: str = "attention"
    idm_local: bool = False
    idm_round_tokens: int | None = None
    idm_plan_from: str = "block_input"
    prompt_reweight: float | None = 2.0
    cache_weight: float | None = None

    _ssm: SSM = dataclasses.field(init=False, repr=False, compare=False)
    _idm: IDM = dataclasses.field(init=False, repr=False, compare=False)
    _structure: frozenset[str] = dataclasses.field(init=False, repr=False, compare=False)
    _detail: frozenset[str] = dataclasses.field(init=False, repr=False, compare=False)
    _cached: frozenset[str] = dataclasses.field(init=False, repr=False, compare=False)
    _blend: tuple[FeatureCaching, ...] = dataclasses.field(init=False, repr=False, compare=False)  # () or one

    def __post_init__(self) -> None:
        what = "sdtm"
        check_ratio_option(self.ratio, what)
        dev = check_number(self.deviation, "deviation", what, low=0)
        if self.ratio + dev >= 1:  # below 0 is accepted: ratio_at clips it to 0 (those calls merge nothing)
            raise ValueError(
                f"{what}: ratio + deviation (the curve's highest ratio) must be < 1, got ratio={self.ratio}, "
                f"deviation={dev} (peak {self.ratio + dev:g})")
        check_number(self.switch, "switch", what, low=0, high=1)
        check_int(self.switch_step, "switch_step", what, low=0, optional=True)
        check_choice(self.curve, "curve", what, CURVES)
        check_choice(self.order, "order", what, ORDERS)
        if self.curve == "constant" and dev != 0:
            raise ValueError(f"{what}: curve='constant' uses ratio alone; set deviation=0 (got {dev})")
        check_int(self.protect_every, "protect_every", what, low=1, optional=True)
        check_number(self.prompt_reweight, "prompt_reweight", what, low=1e-6, optional=True)
        check_int(self.protect_layers_every, "protect_layers_every", what, low=1, optional=True)
        check_number(self.cache_weight, "cache_weight", what, low=0, high=1, optional=True)
        if self.cache_weight is not None and self.protect_every is None:
            raise ValueError(f"{what}: cache_weight blends merged outputs with the outputs cached on protected "
                             "steps, but protect_every is None (no step is protected); set protect_every")
        if isinstance(self.protect_layers, (str, bytes)) or not isinstance(self.protect_layers, Iterable):
            raise ValueError(f"{what}: protect_layers must be a tuple of layer indices, got {self.protect_layers!r}")
        layers = tuple(sorted(set(self.protect_layers)))
        for layer in layers:
            check_int(layer, "every entry of protect_layers", what, low=0)
        set_ = object.__setattr__  # frozen: normalise lists from configs to tuples once, here
        set_(self, "protect_layers", layers)
        for option in ("structure_sublayers", "detail_sublayers"):
            set_(self, option, check_sublayers(getattr(self, option), option, what,
                                               note="to run a phase unmerged, protect its steps or move the switch"))
        set_(self, "_structure", frozenset(self.structure_sublayers))
        set_(self, "_detail", frozenset(self.detail_sublayers))
        set_(self, "_cached", self._structure | self._detail if self.cache_weight is not None else frozenset())
        set_(self, "_blend", (FeatureCaching(weight=self.cache_weight),) if self.cache_weight is not None else ())
        set_(self, "_ssm", SSM(window=self.window, temporal_window=self.temporal_window, alpha_s=self.alpha_s,
                               round_windows=self.round_windows, include_self=self.include_self))
        set_(self, "_idm", IDM(window=self.window, temporal_window=self.temporal_window, alpha_d=self.alpha_d,
                               variant=self.idm_variant, local=self.idm_local, round_tokens=self.idm_round_tokens,
                               plan_from=self.idm_plan_from))
        check_attention_runs_before_its_merge(
            self._idm, self._detail, "leave 'attn' out of detail_sublayers (the default merges the MLP alone), or "
            "set idm_variant='streak' (it needs no received attention)",
            where=f" (the detail phase of {what}, detail_sublayers={self.detail_sublayers})")

    # ------------------------------------------------------------------ the rules, as pure functions
    @property
    def ssm(self) -> SSM:
        """The structure-phase strategy (built once)."""
        return self._ssm

    @property
    def idm(self) -> IDM:
        """The detail-phase strategy (built once)."""
        return self._idm

    def ratio_at(self, progress: float) -> float:
        """The scheduled ratio at ``progress`` in ``[0, 1]``.

        Args:
            progress: ``p = step / (num_steps - 1)``.

        Returns:
            ``r(p)`` for the configured curve, clipped to ``[0, 0.99]``: 0 where the curve is negative
            (``ratio - deviation < 0`` near the end), so that call merges nothing.
        """
        dev = self.deviation
        if self.curve == "cosine":
            r = (self.ratio - dev) + 2.0 * dev * math.cos(progress * math.pi / 2.0)
        elif self.curve == "linear":
            r = (self.ratio + dev) - 2.0 * dev * progress
        else:
            r = self.ratio
        return min(max(r, 0.0), MAX_RATIO)

    def in_structure_phase(self, where: Where) -> bool:
        """Whether the call is in the first phase (``step <= switch_step`` when ``switch_step`` is set, else
        ``progress <= switch``) with ``order="structure_first"``, or in the second with ``"detail_first"``."""
        if self.switch_step is not None:
            first = where.step <= self.switch_step
        else:
            first = where.progress <= self.switch
        return first if self.order == "structure_first" else not first

    def is_protected(self, where: Where) -> bool:
        """Whether the block call runs unmerged (protected step or layer).

        Raises:
            ValueError: when ``protect_layers`` names a layer the model does not have.
        """
        if self.protect_layers and self.protect_layers[-1] >= where.num_layers:
            raise ValueError(
                f"sdtm: protect_layers {self.protect_layers} names layers beyond the {where.num_layers} "
                f"blocks of this model (valid: 0..{where.num_layers - 1})")
        if self.protect_every is not None and where.step % self.protect_every == 0:
            return True
        if where.layer in self.protect_layers:
            return True
        k = self.protect_layers_every
        return k is not None and (where.layer % k == 0 or where.layer == where.num_layers - 1)

    # ------------------------------------------------------------------ Schedule
    def decide(self, where: Where) -> Decision:
        """The decision for one block call (docs/schedules.md, "sdtm").

        Args:
            where: the block call's step, progress, layer and block kind.

        Returns:
            ``"protected"``: no strategy; ``"structure"``: SSM on ``structure_sublayers``;
            ``"detail"``: IDM on ``detail_sublayers``; both at ``ratio_at(where.progress)``.
        """
        if self.is_protected(where):
            # The authors reset their merge counter at protected layers (compute_ratio sets last_independent to
            # None) but leave it alone on protected steps, whose blocks never reach compute_ratio.
            # Protected steps fill the feature cache (when on); protected layers do not, as in the authors' code.
            step_protected = self.protect_every is not None and where.step % self.protect_every == 0
            stores = step_protected and self._cached
            techniques = (() if step_protected else (Streaks(reset=True),)) \
                + ((FeatureCaching(store=self._cached),) if stores else ())
            return Decision(strategy=None, label=PROTECTED, techniques=techniques)
        ratio = self.ratio_at(where.progress)
        if self.in_structure_phase(where):
            return Decision(self._ssm, ratio, self._structure, label=STRUCTURE, techniques=self._blend)
        return Decision(self._idm, ratio, self._detail, label=DETAIL, techniques=self._blend)

    # ------------------------------------------------------------------ prompt reweighting (the core's text-key bias)
    def prepare_text_labels(self, labels: Any) -> PromptCategories:
        """The prompt categories (one label list per prompt, see :class:`~.sdtm_prompts.PromptCategories`).

        Raises:
            TypeError: ``prompt_reweight`` is ``None`` (reweighting is off).
            ValueError: invalid labels.
        """
        if self.prompt_reweight is None:
            raise TypeError(f"schedule {self.name!r} with prompt_reweight=None takes no text labels; set "
                            "prompt_reweight=a_p to reweight prompt tokens")
        return PromptCategories(labels)

    def prompt_reweighting(self, where: Where) -> tuple[str, float] | None:
        """``("structure" | "detail", a_p)`` by the phase of ``where``; ``None`` when off or ``a_p == 1``.

        Example:
            >>> SDTM(prompt_reweight=2.0).prompt_reweighting(Where(0, 50, 0.0, 0, 8))
            ('structure', 2.0)
        """
        if self.prompt_reweight is None or self.prompt_reweight == 1.0:
            return None
        return (STRUCTURE if self.in_structure_phase(where) else DETAIL), float(self.prompt_reweight)

    def text_key_bias(self, where: Where, labels: PromptCategories, batch: int, text_len: int,
                      device: torch.device) -> Tensor | None:
        """``log(a_p)`` on the text keys of this phase's category (:meth:`prompt_reweighting`), ``[B, T]``."""
        reweighting = self.prompt_reweighting(where)
        if reweighting is None:
            return None
        return labels.bias(reweighting[0], reweighting[1], batch, text_len, device)

    def strategies(self) -> tuple[MergeStrategy, ...]:
        """``(ssm, idm)``: the adapter records what either needs (IDM: received attention)."""
        return (self._ssm, self._idm)

    def to_dict(self) -> dict[str, Any]:
        """The schedule's name and options (flat; the built strategies are derived, not logged)."""
        return {k: v for k, v in super().to_dict().items() if not k.startswith("_")}


# ---------------------------------------------------------------------- presets
@dataclasses.dataclass(frozen=True, kw_only=True)
class SDTMRelease(SDTM):
    """``sdtm_release``: SDTM* as the authors' code runs it (``sample.py`` defaults with ``TR_SDTM.py``, commit
    dfaf461); its settings and remaining differences: docs/schedules.md, "Presets"."""

    name: ClassVar[str] = "sdtm_release"

    deviation: float = 0.2
    switch_step: int | None = 20
    protect_every: int | None = 3
    include_self: bool = True
    idm_variant: str = "streak"
    prompt_reweight: float | None = None
    cache_weight: float | None = 0.1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SDTMPaper(SDTM):
    """``sdtm_paper``: SDTM* as the paper describes the method; its settings: docs/schedules.md, "Presets"."""

    name: ClassVar[str] = "sdtm_paper"

    deviation: float = 0.2
    round_windows: int = 1
    idm_variant: str = "attention"
    prompt_reweight: float | None = 2.0
