"""What a run reports: per-step metrics, profiles, the post-run report, device peaks and the memory estimate
of a dry run."""
