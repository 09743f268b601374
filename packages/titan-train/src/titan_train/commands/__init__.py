"""`titan-train` commands other than training: check, generate, eval, and the one-process model they load."""
