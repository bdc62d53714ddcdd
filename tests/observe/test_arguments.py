"""Bad meter arguments raise ValueError naming the argument."""

import pytest
from dense_meters import qkv

import attnkit as ak
from attnkit.observe import DistanceProfile, Entropy, LogitStats, SinkMass, SpanMass, TopKeys


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: SinkMass(first=0), "first"),
        (lambda: SinkMass(first=2.5), "first"),
        (lambda: SinkMass(epsilon=1.5), "epsilon"),
        (lambda: SinkMass(positions=("a",)), "positions"),
        (lambda: Entropy(heads=[-1]), "heads"),
        (lambda: Entropy(heads=[1.5]), "heads"),
        (lambda: LogitStats(layers="x"), "layers"),
        (lambda: LogitStats(layers=[]), "layers"),
        (lambda: TopKeys(queries=(1, 2, 3)), "queries"),
        (lambda: TopKeys(queries=range(0, 9, 2)), "queries"),
        (lambda: TopKeys(k=0), "k"),
        (lambda: DistanceProfile(edges=(1, 2)), "edges"),
        (lambda: DistanceProfile(edges=(0, 4, 2)), "edges"),
        (lambda: SpanMass({}), "spans"),
        (lambda: SpanMass({"a": (5, 5)}), "spans"),
        (lambda: SpanMass({"a,b": (0, 2)}), "spans"),
        (lambda: SpanMass({"a": (0, 2.0)}), "spans"),
    ],
)
def test_bad_arguments_name_themselves(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_arguments_that_do_not_fit_the_call():
    q, k, v = qkv(1, 2, 2, 20, 20)
    for meter, match in (
        (SinkMass(positions=(20,)), "positions"),
        (SinkMass(heads=[2]), "heads"),
        (SpanMass({"late": (10, 21)}), "spans"),
    ):
        with pytest.raises(ValueError, match=match):
            ak.attention(q, k, v, observers=[meter], layer=0)


def test_one_meter_cannot_mix_head_counts_in_a_layer():
    meter = Entropy()
    ak.attention(*qkv(1, 2, 2, 8, 8), observers=[meter], layer=0)
    with pytest.raises(ValueError, match="head counts"):
        ak.attention(*qkv(1, 4, 4, 8, 8), observers=[meter], layer=0)
