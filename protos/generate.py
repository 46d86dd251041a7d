"""Regenerates the Python code of the contracts in protos/tensorserve/v1/ (run by `make protos`).

protoc is run with protos/ as the include root, so the .proto files import each
other as "tensorserve/v1/common.proto" and the descriptors keep their public
names (package tensorserve.v1, services /tensorserve.v1.Worker/Step, ...). The
Python it writes imports its siblings as ``from tensorserve.v1 import ...``;
this script rewrites those imports (and the module names given to the
descriptor builder) to ``protos.tensorserve.v1``, where the installed package
puts them. tests/test_protos.py regenerates into a temporary folder with
``generate()`` and fails when the committed files differ.

The output depends on the grpcio-tools version (it embeds protoc's version and
the minimum grpcio), so the version is pinned here and in pyproject.toml.
"""
from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from importlib import metadata, resources
from pathlib import Path

GRPC_TOOLS_VERSION = "1.85.1"
PROTOS_DIR = Path(__file__).resolve().parent   # the include root
PACKAGE_DIR = "tensorserve/v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_IMPORT = re.compile(r"^from tensorserve\.v1 import ", re.M)
_BUILDER_MODULE = re.compile(r"(BuildTopDescriptorsAndMessages\(DESCRIPTOR, ')tensorserve\.v1\.")


def check_version() -> None:
    try:
        found = metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError:
        found = None
    if found != GRPC_TOOLS_VERSION:
        raise SystemExit(f"protos/generate.py needs grpcio-tools=={GRPC_TOOLS_VERSION} (found {found}): "
                         f"pip install 'grpcio-tools=={GRPC_TOOLS_VERSION}', or `make install`")


def proto_files() -> list[str]:
    """The contracts, relative to the include root, in a stable order."""
    return sorted(p.relative_to(PROTOS_DIR).as_posix() for p in (PROTOS_DIR / PACKAGE_DIR).glob("*.proto"))


def is_generated(path: Path) -> bool:
    return path.name.endswith(GENERATED_SUFFIXES)


def generate(out_root: Path) -> list[Path]:
    """Writes the generated modules under out_root/tensorserve/v1/ and returns their paths."""
    check_version()
    from grpc_tools import protoc

    out_root = Path(out_root)
    (out_root / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    args = ["grpc_tools.protoc", f"-I{PROTOS_DIR}", f"-I{well_known}",
            f"--python_out={out_root}", f"--pyi_out={out_root}", f"--grpc_python_out={out_root}",
            *proto_files()]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    written = sorted(p for p in (out_root / PACKAGE_DIR).iterdir() if is_generated(p))
    for path in written:
        text = path.read_text()
        text = _IMPORT.sub("from protos.tensorserve.v1 import ", text)
        text = _BUILDER_MODULE.sub(r"\1protos.tensorserve.v1.", text)
        path.write_text(text)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.parse_args(argv)
    target = PROTOS_DIR / PACKAGE_DIR
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        for old in target.iterdir():           # drop modules of removed contracts
            if is_generated(old):
                old.unlink()
        for path in fresh:
            shutil.copyfile(path, target / path.name)
            print(f"wrote {(target / path.name).relative_to(PROTOS_DIR.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
