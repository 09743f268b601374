"""Prompt-only data for learning from rewards (GRPO): prompts rendered for generation, the rest of each row kept."""
