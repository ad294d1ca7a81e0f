"""Images and videos for a list of items, in one process or with Lightning DDP (`generate`), their files:
PNG, MP4 and the index of each folder (`files`), and the pictures drawn from them: image grids and merge maps
(`pictures`)."""
