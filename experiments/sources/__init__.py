"""What a run draws from: items (`items`), prompt sets (`prompt_sets`), Fashion-MNIST (`data`), the model
source (`models`: the reference DiT of `reference_model` or a diffusers pipeline of `pipelines`, called with
`call_arguments` on `devices`), the reference DiT's sampler (`sampling`) and trainer (`training`), the local
metric weights (`weights`) and the table of merged diffusers classes (`coverage`)."""
