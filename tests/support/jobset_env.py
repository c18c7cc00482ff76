"""A JobSet's environment as its pods get it: 2 slices of 3 hosts."""

JOBSET_ENV = {
    "SIDECAR_JOBSET_NAME": "train",
    "SIDECAR_REPLICATED_JOB": "slice",
    "SIDECAR_NUM_SLICES": "2",
    "SIDECAR_HOSTS_PER_SLICE": "3",
}
