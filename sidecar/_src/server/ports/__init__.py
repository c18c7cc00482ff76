"""The ports anyone may reach: the health port, accepted by the sidecar itself, and the
bounds on connections and streams that carry no token (issue 76)."""
