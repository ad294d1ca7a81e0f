"""Images and videos for a list of items: in one process, with their output folder and its index
(`generate`), or over Lightning DDP ranks (`distributed`); the files of run and generation folders, written
whole and locked against a second writer, and read back as tensors (`files`); and the pictures drawn from
them: image grids and merge maps (`pictures`)."""
