"""``attnkit doctor``: what this installation runs on — the C++ CPU operators (built or
not, and why), the compiler that builds them, the CPU's vector capability, torch's
threads, and the versions of torch and transformers."""

from __future__ import annotations

import json
import platform

from ..kernels.machine import cpu_name


def add_parser(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="show the build status of the C++ operators, compiler, CPU, threads and versions",
        description="Build (first run) or load attnkit's C++ CPU operators and report what attnkit "
        "will run on: operator status and why, compiler, CPU capability, threads, versions.",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)


def _version(module: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return "not installed"


def report() -> dict[str, str]:
    import torch

    from ..kernels import cpu

    status = cpu.status()
    parallel = torch.__config__.parallel_info().splitlines()
    backend = next((line.split(":", 1)[1].strip() for line in parallel if line.startswith("ATen parallel backend")), "unknown")
    return {
        "operators": "available" if status.available else "unavailable",
        "operators_detail": status.reason,
        "operators_seconds": f"{status.seconds:.1f}",
        "compiler": cpu.build.compiler(),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": f"{torch.get_num_threads()} intra-op ({backend}), {torch.get_num_interop_threads()} inter-op",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "attnkit": _version("attnkit"),
    }


def run(args) -> int:
    rows = report()
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        width = max(map(len, rows))
        for key, value in rows.items():
            print(f"{key.replace('_', ' '):<{width}}  {value}")
    return 0
