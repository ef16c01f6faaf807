"""The generated protobuf/gRPC modules are exactly what grpcio-tools generates from protos/."""
import filecmp
from pathlib import Path

import setup

GENERATED = Path(setup.ROOT) / "client" / "tensorkv" / "v1"


def test_generated_modules_match_a_fresh_generation(tmp_path):
    setup.generate_protos(out_dir=tmp_path)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert fresh, "grpc_tools generated nothing"
    for relative in fresh:
        assert relative.parts[:2] == ("tensorkv", "v1")
        committed = GENERATED / relative.name
        assert committed.exists(), f"{committed} is missing: run `make proto`"
        assert filecmp.cmp(tmp_path / relative, committed, shallow=False), f"{committed} is stale: run `make proto`"
