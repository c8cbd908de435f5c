"""Triton kernels of the data plane, one kernel per file.

Each file holds a private `@triton.jit` kernel, a launcher that checks dtypes, shapes and strides,
and a pure-torch reference that the tests in tests/dataplane/kernels compare it with. Importing a
kernel module imports triton: callers on the CPU path must not import these modules.
"""
