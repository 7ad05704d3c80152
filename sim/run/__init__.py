"""One simulated run: the cluster, its engines, records, metrics, reports and the router it runs."""
