"""Text sources, how documents are dealt to streams, and the packed and memory-mapped datasets."""
