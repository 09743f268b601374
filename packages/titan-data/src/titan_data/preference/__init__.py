"""Preference data (DPO and its family): prompt, chosen and rejected, as pairs of masked sequences."""
