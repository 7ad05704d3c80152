"""Many simulated runs: points, executors, capacity searches and sweeps."""
