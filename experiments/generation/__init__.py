"""Images and videos for a list of items, in one process or with Lightning DDP (`generate`), and their
files: PNG, MP4 and the index of each folder (`files`)."""
