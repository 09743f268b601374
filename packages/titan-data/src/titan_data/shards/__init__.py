"""Token shards on disk: the format, the tokenize job that writes them, and reading them back."""
