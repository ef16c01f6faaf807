"""Build hook: generate the protobuf and gRPC modules from protos/ with grpcio-tools.

The generated modules land beside their proto package (protos/tensorkv/v1 ->
client/tensorkv/v1), so `tensorkv.v1.kvstore_pb2` mirrors `tensorkv.v1` in the schema.
They are build outputs: git ignores them and nobody edits them.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent


def generate_protos(out_dir=ROOT / "client"):
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(str(p.relative_to(ROOT / "protos")) for p in (ROOT / "protos").rglob("*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT / 'protos'}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + " ".join(protos))


class BuildWithProtos(build_py):
    def run(self):
        generate_protos()
        super().run()


if __name__ == "__main__":
    setup(cmdclass={"build_py": BuildWithProtos})
