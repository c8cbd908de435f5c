"""What both planes share: config types, the wire encoding of int arrays, transport helpers.

Imports neither plane, nor torch, nor grpc.
"""
