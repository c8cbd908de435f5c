"""The rules of DESIGN.md that code can check: who imports whom, no torch in the control plane,
generated protobuf modules in sync with the .proto files, nothing pickled."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_import_contracts_hold():
    """import-linter contracts in pyproject.toml: the planes never import each other; common and
    the control plane stay free of torch."""
    lint_imports = pathlib.Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint_imports), "--config", "pyproject.toml"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_control_plane_runs_without_torch():
    """Importing everything the control plane process runs leaves torch out of sys.modules."""
    code = ("import sys; import controlplane.server, controlplane.engine, splitserve.client, "
            "splitserve.cli, splitserve.supervisor, common.transport; "
            "bad = [m for m in ('torch', 'triton', 'transformers', 'safetensors') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_protos_are_in_sync(tmp_path):
    subprocess.run([sys.executable, "scripts/gen_protos.py", "--out", str(tmp_path)], cwd=ROOT,
                   check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "nothing generated"
    for rel in generated:
        committed = ROOT / rel
        assert committed.exists(), f"{rel} is generated but not committed"
        assert committed.read_text() == (tmp_path / rel).read_text(), \
            f"{rel} is stale: run python scripts/gen_protos.py"


def test_nothing_is_pickled_across_processes():
    pattern = re.compile(r"\b(pickle|cloudpickle|dill|recv_pyobj|send_pyobj|broadcast_object_list)\b")
    offenders = [f"{path.relative_to(ROOT)}:{n}"
                 for package in ("common", "controlplane", "dataplane", "splitserve")
                 for path in (ROOT / package).rglob("*.py")
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if pattern.search(line) and not line.lstrip().startswith("#")]
    assert offenders == []
