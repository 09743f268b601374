"""Supervised fine-tuning data: chat rows, the model's chat template, turn masks and packing."""
