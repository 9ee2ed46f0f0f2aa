"""The GPU runbook's setup report on the interpreter its steps run, the carried wheels on its path
(``python3 -m bench.env_report``): nvidia-smi, versions, the wheels the steps need, and whether the carried
wheels' own requirements are met. Stdlib only; lion_pytorch (which may exit on import) is found, never imported."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import platform
import subprocess
import sys

WHEELS = ("numpy", "pyarrow", "pandas", "fsspec", "huggingface-hub", "xxhash", "dill", "multiprocess", "datasets",
          "lion-pytorch", "sentencepiece", "sacrebleu", "einops", "matplotlib", "pytest", "pytest-timeout",
          "hypothesis", "transformers", "ctranslate2")
CARRIED = ("datasets", "lion-pytorch", "dill", "multiprocess", "fsspec")  # their requirements are checked
QUERY = "name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,power.limit"


def main() -> int:
    print("---- nvidia-smi")
    for cmd in (["nvidia-smi"], ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv"]):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            print(out.stdout + out.stderr + ("" if out.returncode == 0 else "nvidia-smi failed\n"), end="")
        except (OSError, subprocess.TimeoutExpired) as e:
            print(f"nvidia-smi failed: {e}")
    print(f"---- versions and carried wheels\npython {platform.python_version()} at {sys.executable}")
    try:
        import torch
        import triton

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NONE"
        print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, GPU: {gpu}")
    except Exception as e:  # noqa: BLE001 - the report says what it could not import
        print(f"torch/triton import failed: {e!r}")
    for name in WHEELS:
        try:
            print(f"  {name:<16} {md.version(name):<12} {md.distribution(name).locate_file('')}")
        except md.PackageNotFoundError:
            print(f"  {name:<16} MISSING")
    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
    except ImportError:
        print("packaging is missing: requirements not checked")
        return 1
    env, problems = dict(default_environment(), extra=""), []
    for name in CARRIED:
        try:
            reqs = [Requirement(r) for r in md.requires(name) or []]
        except md.PackageNotFoundError:
            continue
        for req in (r for r in reqs if r.marker is None or r.marker.evaluate(env)):
            try:
                have = md.version(req.name)
                if req.specifier and not req.specifier.contains(have, prereleases=True):
                    problems.append(f"  REQUIREMENT MISMATCH: {name} needs {req}, found {req.name} {have}")
            except md.PackageNotFoundError:
                problems.append(f"  REQUIREMENT MISSING: {name} needs {req}")
    print("\n".join([*problems, f"carried wheels' requirements: {f'{len(problems)} problem(s)' if problems else 'all met'}"]))
    for mod in ("datasets", "lion_pytorch"):
        print(f"module {mod}: {'found' if importlib.util.find_spec(mod) else 'MISSING'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
