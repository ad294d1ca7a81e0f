"""What a run draws from: items (`items`), prompt sets (`prompt_sets`), Fashion-MNIST (`data`), the
reference DiT and diffusers pipelines as one model source (`models`), its sampler (`sampling`) and trainer
(`training`), and the table of merged diffusers classes (`coverage`). `tomerge.experiments.sources.NAME`
answers the names of `models`."""

from .. import forward_names

__getattr__ = forward_names(__name__, f"{__name__}.models")
