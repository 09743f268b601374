"""What every step does whatever its objective: the optimizer stepping in backward, Muon after the step,
pipeline stage inputs, the heap kept between steps and garbage collection at fixed steps."""
