"""The `splitserve` command and the Python client. Imports the planes only lazily, per
subcommand, so `splitserve controlplane` never loads torch."""
