"""The data plane: every tensor. Model weights sharded over tensor-parallel ranks, the paged KV
cache, attention backends, sampling. Rank 0 talks to the control plane; the others follow it."""
