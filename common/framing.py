"""Two-frame messages on the link: the serialized LinkMessage and its CRC-32, so a corrupted
frame is detected and dropped instead of parsed into wrong tokens (CURVE, on TCP links, also
authenticates every frame; ipc:// links rely on this check)."""

import zlib

from google.protobuf.message import DecodeError

from protos import link_pb2


def encode(message: link_pb2.LinkMessage) -> list[bytes]:
    payload = message.SerializeToString()
    return [payload, zlib.crc32(payload).to_bytes(4, "little")]


def decode(frames: list[bytes]) -> link_pb2.LinkMessage | None:
    """The message, or None for anything malformed: wrong frame count, bad checksum,
    unparsable, or a message without a body (unknown to this version)."""
    if len(frames) != 2 or len(frames[1]) != 4:
        return None
    payload, checksum = frames
    if zlib.crc32(payload).to_bytes(4, "little") != checksum:
        return None
    message = link_pb2.LinkMessage()
    try:
        message.ParseFromString(payload)
    except DecodeError:
        return None
    return message if message.WhichOneof("body") is not None else None
