"""Text sources and the packed token dataset."""
