"""verify: fingerprints, traces, trace and checkpoint comparison, bisection. Knows nothing of mok or rl."""
