"""How a run meets faults: the per-step guard (numerics, preemption, drills), the peer watch and hang
diagnosis, and the exit statuses a launcher reads."""
