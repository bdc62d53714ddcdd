"""A new steering intervention is one file: this one defines ``ToyGain`` (the chosen
heads' outputs times ``gain``), registers it for ``--steer``, and the command line's spec
parser builds it from ``toy-gain:heads=...:gain=...`` without any other edit."""

from types import SimpleNamespace

import pytest
import torch
from steer_reference import outputs
from tiny_models import VOCAB, build

from attnkit import steer
from attnkit.cli.steer_spec import build_interventions, parse_spec
from attnkit.steer.base import Intervention
from attnkit.steer.registry import INTERVENTIONS, number, register_intervention


class ToyGain(Intervention):
    name = "toy-gain"

    def __init__(self, heads, gain: float = 1.0):
        super().__init__(heads)
        self.gain = gain

    def output_for(self, layer, out, keep):
        flags = self.selected(layer, out.shape[1], out.device)
        return out if flags is None else torch.where(flags.view(1, -1, 1, 1), out * self.gain, out)


@pytest.fixture
def registered():
    register_intervention("toy-gain", ToyGain, params={"gain": number}, required=("gain",), example="toy-gain:gain=2")
    yield
    INTERVENTIONS.pop("toy-gain")


def test_a_registered_intervention_is_read_by_the_spec_parser(registered):
    assert parse_spec("toy-gain:heads=0.1:gain=2") == ("toy-gain", {"heads": "0.1", "gain": "2"})
    with pytest.raises(ValueError, match=r"^--steer: toy-gain needs gain=\.\.\., e\.g\. toy-gain:gain=2"):
        parse_spec("toy-gain:heads=0.1")
    with pytest.raises(ValueError, match=r"^--steer: toy-gain takes heads, gain; got 'factor'"):
        parse_spec("toy-gain:factor=2")
    with pytest.raises(ValueError, match=r"^--steer: gain='x' is not a finite number"):
        build_interventions(["toy-gain:heads=0.1:gain=x"], SimpleNamespace(model=build("llama")))


def test_the_built_intervention_steers_like_its_builtin_twin(registered):
    llama = build("llama").double()
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    [toy] = build_interventions(["toy-gain:heads=0.1,1.0:gain=2"], SimpleNamespace(model=llama))
    assert isinstance(toy, ToyGain) and toy.gain == 2.0
    with torch.no_grad():
        with steer.apply(llama, toy):
            mine = outputs(llama(input_ids=ids))
        with steer.apply(llama, steer.scale([(0, 1), (1, 0)], 2.0)):
            twin = outputs(llama(input_ids=ids))
        plain = outputs(llama(input_ids=ids))
    assert torch.equal(mine, twin) and not torch.equal(mine, plain)


def test_unregistered_names_are_refused_and_builtins_are_registered():
    assert {"ablate", "scale", "temperature", "disperse"} <= set(INTERVENTIONS)
    with pytest.raises(ValueError, match=r"^--steer: unknown intervention 'toy-gain'"):
        parse_spec("toy-gain:gain=2")
