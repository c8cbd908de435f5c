"""Regenerate the Python modules of protos/*.proto next to them (or into --out for drift checks).

Generated with grpcio-tools 1.84.0 so the stubs import under the grpcio 1.84.0 of the GPU image
(generated stubs refuse a grpcio older than the grpcio-tools that wrote them).
"""

import argparse
import pathlib
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent


def generate(out: pathlib.Path) -> None:
    protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "protos").glob("*.proto"))
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    for proto in protos:
        args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}"]
        if "service " in (ROOT / proto).read_text():
            args.append(f"--grpc_python_out={out}")
        if protoc.main([*args, proto]) != 0:
            sys.exit(f"protoc failed on {proto}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=ROOT)
    generate(parser.parse_args().out)
