"""A simulated cluster on one machine (network namespaces, a bridge, shaped links, pinned cores)
for multi-node tests and benchmarks: ``python -m deploy.simcluster --help``."""
from deploy.simcluster.cluster import (SimCluster, SimClusterError, SimNode, clean_stale,
                                       netadmin_missing, rate_bits, teardown)

__all__ = ["SimCluster", "SimClusterError", "SimNode", "clean_stale", "netadmin_missing",
           "rate_bits", "teardown"]
