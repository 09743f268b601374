"""Training objectives: what a step asks of its batches (see `protocol`); one registry names them."""
