"""`dit`: class-conditional DiT (diffusers `DiTTransformer2DModel`, adaLN-Zero `BasicTransformerBlock`).

Every `BasicTransformerBlock` (``norm_type="ada_norm_zero"``) is one block, in ``transformer_blocks``
order. Merge points: ``attn1`` (self-attention, ``"attn"``: its first positional argument is the
modulated, normalised image tokens) and ``ff`` (``"mlp"``); both outputs are unmerged before the
gated residual. Positions are absolute sin-cos embeddings added at the patch embedding, so merging
needs no positional work. The token grid is ``(H0 // p, W0 // p)`` for a latent ``H0 x W0`` (recorded
by a pre-hook on the model) and patch size ``p``.

Received attention for ``idm``: a strided set of at most 64 image queries against all keys of
``attn1``, from the q/k that its projections computed (:func:`probe_self_attention`).

Feed-forward chunking (``block.set_chunk_feed_forward``) calls ``ff`` once per chunk, which cannot
take a merged sequence: apply() raises while it is enabled (and so does a call if it is enabled
later); disable it first.

Note (diffusers 0.42 itself, not tomerge): ``DiTTransformer2DModel.forward`` unpatchifies with
``height = width = sqrt(N)``, so the model only produces meaningful output for square latents.
The adapter's grid is the true ``(H, W)`` in any case.

This module also holds the helpers the other patchified diffusers transformers (``pixart``, ``sd3``)
share: :func:`call_arg`, :func:`patch_grid`, :func:`check_ff_chunking` and :class:`PatchifiedAdapter`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from tomerge.adapter import BackboneAdapter, BlockSpec, MergePoint, class_names
from tomerge.state import MergeState

from ._diffusers import probe_self_attention, submodel


# ---------------------------------------------------------------------- helpers shared by the transformers
def call_arg(args: tuple, kwargs: dict, name: str, index: int) -> Any:
    """The argument ``name`` of a call, given by keyword or as positional ``index`` (``None`` if absent)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def patch_grid(latent_size: tuple[int, int] | None, patch_size: int, num_tokens: int) -> tuple[int, int] | None:
    """The token grid of a patchified latent, or ``None`` when it does not account for ``num_tokens``.

    Args:
        latent_size: ``(H0, W0)`` of the latent the model was called with (``None``: not seen yet).
        patch_size: the patch side ``p`` (patches are ``p x p``, stride ``p``: ``floor`` division).
        num_tokens: ``N``, the image tokens entering the block.

    Returns:
        ``(H0 // p, W0 // p)`` if its product is ``N``, else ``None`` (then the block is not merged).

    Example:
        >>> patch_grid((12, 20), 2, 60)
        (6, 10)
    """
    if latent_size is None:
        return None
    H, W = latent_size[0] // patch_size, latent_size[1] // patch_size
    return (H, W) if H * W == num_tokens else None


def check_ff_chunking(blocks: list[nn.Module]) -> None:
    """Raises if any block has feed-forward chunking enabled (``ff`` would get chunks, not the merged sequence).

    Args:
        blocks: the block modules (diffusers blocks keep the setting in ``_chunk_size``).
    """
    for block in blocks:
        if getattr(block, "_chunk_size", None) is not None:
            raise ValueError(
                f"feed-forward chunking is enabled on a {type(block).__name__} (chunk size {block._chunk_size}, "
                f"dim {getattr(block, '_chunk_dim', 0)}): the feed-forward then runs once per chunk and cannot "
                "take the merged sequence. Call model.disable_forward_chunking() (or "
                "block.set_chunk_feed_forward(None)) before tomerge.apply; merging already saves the memory "
                "chunking would")


class PatchifiedAdapter(BackboneAdapter):
    """Base of the adapters of patchified diffusers transformers with ``transformer_blocks`` of one class.

    Subclasses set ``model_class`` (class name of the transformer), ``block_names`` (the block class),
    ``block_kind``, ``timestep_index`` (position of ``timestep`` in the model's forward), and implement
    :meth:`merge_points`.
    """

    model_class: ClassVar[str] = ""
    block_kind: ClassVar[str] = "basic"
    timestep_index: ClassVar[int] = 1

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        self.latent_size: tuple[int, int] | None = None
        self.patch_size = int(model.config.patch_size)

    @classmethod
    def find_model(cls, obj: Any) -> nn.Module | None:
        """The transformer: ``obj`` itself or a pipeline's ``obj.transformer``."""
        return submodel(obj, "transformer", cls.model_class)

    def _block_modules(self) -> list[nn.Module]:
        blocks = getattr(self.model, "transformer_blocks", None)
        if blocks is None:
            return []
        return [m for m in blocks if any(name in class_names(m) for name in self.block_names)]

    def merge_points(self, block: nn.Module) -> tuple[MergePoint, ...]:
        """The merge points of one block module."""
        raise NotImplementedError

    def blocks(self) -> list[BlockSpec]:
        return [BlockSpec(module, layer=i, kind=self.block_kind, points=self.merge_points(module))
                for i, module in enumerate(self._block_modules())]

    def check(self) -> None:
        check_ff_chunking(self._block_modules())

    def on_model_call(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        sample = call_arg(args, kwargs, "hidden_states", 0)  # [B, C, H0, W0]
        if sample.dim() != 4:
            raise ValueError(f"{type(self.model).__name__} expects a latent [B, C, H, W], got {tuple(sample.shape)}")
        self.latent_size = (int(sample.shape[-2]), int(sample.shape[-1]))
        return call_arg(args, kwargs, "timestep", self.timestep_index)

    def grid(self, block: BlockSpec, num_tokens: int) -> tuple[int, int] | None:
        check_ff_chunking([block.module])  # enabled after apply(): say so instead of failing inside ff
        return patch_grid(self.latent_size, self.patch_size, num_tokens)


# ---------------------------------------------------------------------- the DiT adapter
class DiTAdapter(PatchifiedAdapter):
    """Adapter for diffusers `DiTTransformer2DModel` (see the module docstring).

    Example (``pipe``: a `DiTPipeline`, or the transformer itself):
        >>> import tomerge
        >>> handle = tomerge.apply(pipe, "tomesd", ratio=0.5)  # doctest: +SKIP
    """

    name: ClassVar[str] = "dit"
    block_names: ClassVar[tuple[str, ...]] = ("BasicTransformerBlock",)
    model_class: ClassVar[str] = "DiTTransformer2DModel"
    block_kind: ClassVar[str] = "adaln_zero"
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, class_labels, ...)

    def merge_points(self, block: nn.Module) -> tuple[MergePoint, ...]:
        return (MergePoint("attn", block.attn1), MergePoint("mlp", block.ff))

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        return probe_self_attention(block, point, state)
