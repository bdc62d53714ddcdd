"""The registry finds every mechanism in a fresh process: no hand-written module list."""

import json
import subprocess
import sys
import textwrap

import pytest

# In a fresh interpreter: what available() lists first, then the registry after every
# module of the package (subpackages included) has been imported by hand.
EVERY_MODULE = """
import importlib, json, pkgutil
import attnkit.mechanisms as m
from attnkit.mechanisms import base
listed = m.available()
modules = [info.name for info in pkgutil.walk_packages(m.__path__, m.__name__ + ".")]
for name in modules:
    importlib.import_module(name)
print(json.dumps({"listed": listed, "registered": sorted(base._REGISTRY), "modules": modules}))
"""

# A family file dropped into the package (here: a folder added to its path) registers
# without any edit to mechanisms/__init__.py.
NEW_FILE = """
from attnkit.kernels.run import softmax_attention
from attnkit.mechanisms.base import Mechanism, register


@register("registry_test_family")
class RegistryTestFamily(Mechanism):
    def forward(self, q, k, v, **call):
        return softmax_attention(q, k, v, **call)
"""


def _fresh(script: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_available_lists_what_every_module_registers():
    got = _fresh(EVERY_MODULE)
    assert got["listed"] == got["registered"]
    # the families of the README's map, one from each kind of file
    for name in ("softmax", "sigmoid", "hyper_attention", "nsa", "block_sparse", "deltanet", "multi_token"):
        assert name in got["listed"], name
    assert any(m.endswith(".linear.instances") for m in got["modules"])


def test_a_new_family_file_registers_in_a_fresh_process(tmp_path):
    (tmp_path / "registry_test_family.py").write_text(NEW_FILE)
    # the folder joins the package's path before the package runs (it finds its families then)
    script = textwrap.dedent(f"""
        import importlib.util, json, sys
        spec = importlib.util.find_spec("attnkit.mechanisms")
        spec.submodule_search_locations.append({str(tmp_path)!r})
        m = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = m
        spec.loader.exec_module(m)
        print(json.dumps({{"listed": m.available()}}))
    """)
    assert "registry_test_family" in _fresh(script)["listed"]


def test_lookups_after_import_never_scan_the_package(monkeypatch):
    """Families are found once per process: a lookup is a dict access (torch.compile traces
    it; a directory scan per call cost ~0.4 ms and broke fullgraph)."""
    import attnkit.mechanisms as m

    def scan():
        raise AssertionError("the package directory was scanned again")

    monkeypatch.setattr(m, "family_modules", scan)
    assert "sigmoid" in m.available()
    assert m.get_mechanism("sigmoid").name == "sigmoid"
    assert m.mechanism_class("deltanet").name == "deltanet"
    with pytest.raises(ValueError, match="unknown name 'no_such'.*registered: .*sigmoid"):
        m.get_mechanism("no_such")
