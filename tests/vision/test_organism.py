"""The visual organism: the shapes task's scenes and questions, the shipped tiny LLaVA
(hashes, card, the processor's inputs equal to the training layout, a fresh sample within
the card's spread), the registry and CLI, and a seconds-long build that is deterministic."""

import json
import math
import os

import numpy as np
import pytest
import torch

from attnkit import organisms
from attnkit.cli import main
from attnkit.organisms import store, visual
from attnkit.vision import organism as vo
from attnkit.vision import shapes

NAME = "shapes-vlm"


# -- the task ---------------------------------------------------------------------------------


def test_the_same_seed_gives_the_same_scenes_and_another_seed_others():
    a, b, c = shapes.examples(30, 7), shapes.examples(30, 7), shapes.examples(30, 8)
    assert all(np.array_equal(x.image, y.image) and x.question == y.question and x.objects == y.objects for x, y in zip(a, b))
    assert sum(np.array_equal(x.image, z.image) for x, z in zip(a, c)) == 0


def test_scenes_hold_distinct_shapes_in_distinct_cells_and_questions_name_them():
    for e in shapes.examples(300, 1):
        assert 1 <= len(e.objects) <= shapes.MAX_OBJECTS
        assert len({o.shape for o in e.objects}) == len(e.objects) == len({o.cell for o in e.objects})
        words = e.question.split()
        assert set(words) <= set(shapes.WORDS)
        present = {(o.colour, o.shape) for o in e.objects}
        if e.kind == "presence":
            asked = (words[3], words[4])
            assert e.answer == ("yes" if asked in present else "no") and e.absent == (asked not in present)
            if e.near_miss:
                assert any(asked[0] == o.colour or asked[1] == o.shape for o in e.objects)
        elif e.kind == "colour":
            (obj,) = [o for o in e.objects if o.shape == words[4]]
            assert e.answer == obj.colour
        else:
            (obj,) = [o for o in e.objects if (o.colour, o.shape) == (words[3], words[4])]
            assert e.answer == shapes.POSITIONS[obj.cell] == obj.position


def test_kinds_cycle_and_presence_questions_are_balanced():
    ex = shapes.examples(3000, 2)
    assert [e.kind for e in ex[:6]] == list(shapes.KINDS) * 2
    presence = [e for e in ex if e.kind == "presence"]
    absent = sum(e.absent for e in presence) / len(presence)
    assert abs(absent - 0.5) < 4 * math.sqrt(0.25 / len(presence))
    near = sum(e.near_miss for e in presence if e.absent) / sum(e.absent for e in presence)
    assert 0.6 < near <= 1.0  # 3 in 4 when a near miss exists


def test_rendered_pixels_are_the_shapes_colours_where_the_shape_is_and_background_elsewhere():
    objects = (shapes.Obj("red", "square", 0), shapes.Obj("blue", "circle", 4), shapes.Obj("yellow", "triangle", 8))
    image = shapes.render(objects)  # centred, no noise
    assert image.shape == (shapes.IMAGE_SIZE, shapes.IMAGE_SIZE, 3) and image.dtype == np.uint8
    for o in objects:
        top, left = (o.cell // 3) * 8 + 1, (o.cell % 3) * 8 + 1
        block = image[top : top + 6, left : left + 6].reshape(-1, 3)
        coloured = (block == np.array(shapes.COLOURS[o.colour])).all(-1)
        # the literal areas of a 6-pixel square, disc and triangle (rows of 2, 2, 4, 4, 6, 6 pixels)
        assert coloured.sum() == {"square": 36, "circle": 32, "triangle": 24}[o.shape], o
    empty = image[9:15, 1:7]  # cell 3
    assert (empty == 20).all()


def test_bad_task_arguments_are_named():
    with pytest.raises(ValueError, match="^kinds: "):
        shapes.examples(3, 0, kinds=["size"])
    with pytest.raises(ValueError, match="^n: "):
        shapes.examples(-1, 0)
    with pytest.raises(ValueError, match="^stream: "):
        shapes.stream("nope")
    with pytest.raises(ValueError, match="^objects: "):
        shapes.render([shapes.Obj("pink", "square", 0)])


# -- the shipped organism ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped():
    if NAME not in organisms.shipped():
        pytest.skip(f"{NAME} is not shipped in this install")
    model, processor = organisms.load(NAME)
    return model, processor, organisms.card(NAME)


def test_the_organism_is_listed_verified_and_resolved_by_name(shipped):
    assert NAME in visual.names() and NAME in organisms.shipped("visual") and NAME not in organisms.shipped("text")
    directory = organisms.path(NAME)
    assert store.resolve_model_path(NAME) == directory
    size = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory))
    assert size < 2_000_000
    card = shipped[2]
    assert card["kind"] == "visual" and card["name"] == NAME and card["recipe"] == visual.organism(NAME).to_dict()
    assert set(card["files"]) >= {"model.safetensors", "config.json", "tokenizer.json", "processor_config.json", "task.json"}
    assert set(card["accuracy"]) == set(shapes.KINDS)
    assert card["training"]["steps"] > 0 and card["training"]["wall_seconds"] <= 15 * 60 and card["machine"]["cpu"]
    assert card["model"]["parameters"] == sum(p.numel() for p in shipped[0].parameters())
    assert card["known_failures"]


def test_a_changed_file_is_named(tmp_path, monkeypatch):
    if NAME not in organisms.shipped():
        pytest.skip(f"{NAME} is not shipped")
    root = tmp_path / "data"
    import shutil

    shutil.copytree(organisms.path(NAME), root / NAME)
    monkeypatch.setattr(store, "data_dir", lambda: str(root))
    with open(root / NAME / "task.json", "a") as f:
        f.write(" ")
    with pytest.raises(ValueError, match=r"task.json does not match its hash"):
        organisms.path(NAME)


def test_the_processor_makes_the_training_layout(shipped):
    _, processor, _ = shipped
    ex = shapes.examples(5, 11)
    inputs = processor(images=[e.image for e in ex], text=[vo.prompt(e.question) for e in ex], return_tensors="pt")
    assert torch.equal(inputs["input_ids"], vo.token_ids([e.question for e in ex]))
    assert torch.allclose(inputs["pixel_values"], vo.pixels([e.image for e in ex]), atol=1e-6)
    assert processor.tokenizer.convert_ids_to_tokens(list(range(len(vo.VOCAB)))) == list(vo.VOCAB)


def binomial_tolerance(p: float, n: int, n_card: int) -> float:
    """4 standard deviations of the difference of two accuracies on n and n_card questions
    (p held in [0.05, 0.95]), plus one question."""
    q = min(max(p, 0.05), 0.95)
    return 4 * math.sqrt(q * (1 - q) * (1 / n + 1 / n_card)) + 1 / n


def test_a_fresh_sample_agrees_with_the_card(shipped):
    model, processor, card = shipped
    n = 180  # 60 per kind, from a stream the card did not read
    examples = shapes.examples(n, shapes.stream("test"))
    scored = vo.score(examples, vo.answers(model, processor, examples))
    for kind, entry in card["accuracy"].items():
        tol = binomial_tolerance(entry["accuracy"], n // 3, card["evaluation"]["per_kind"])
        assert abs(scored["accuracy"][kind]["accuracy"] - entry["accuracy"]) <= tol, (kind, scored["accuracy"][kind], entry)


def test_the_cli_lists_and_cards_the_visual_organism(shipped, capsys):
    assert main(["organisms", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[NAME]["shipped"] and rows[NAME]["kind"] == "visual"
    assert set(rows[NAME]["accuracy"]) == set(shapes.KINDS)
    assert main(["organisms", "list"]) == 0
    assert NAME in capsys.readouterr().out
    assert main(["organisms", "card", NAME]) == 0
    text = capsys.readouterr().out
    assert "presence" in text and "position" in text and "known failures" in text
    assert main(["organisms", "path", NAME]) == 0
    assert capsys.readouterr().out.strip() == organisms.path(NAME)
    assert main(["organisms", "list", "--markdown"]) == 0
    assert f"| `{NAME}` |" in capsys.readouterr().out


def test_an_unknown_name_lists_the_visual_organism_too():
    with pytest.raises(ValueError, match=f"^name: no organism 'shapes-xl'; known: .*{NAME}"):
        organisms.path("shapes-xl")
    with pytest.raises(ValueError, match="^kind: "):
        organisms.shipped("audio")


# -- building -------------------------------------------------------------------------------


@pytest.fixture
def tiny_visual(monkeypatch):
    spec = visual.VisualOrganism(
        "tiny-shapes",
        "a seconds-long shapes build",
        settings=dict(steps=12, batch_size=16, eval_every=6, eval_examples=30, card_examples=60),
        known_failures=("it is a test",),
    )
    monkeypatch.setitem(visual.VISUAL, spec.name, spec)
    return spec


def test_a_tiny_build_is_carded_verified_and_deterministic(tiny_visual, tmp_path):
    card = organisms.build(tiny_visual.name, tmp_path / "a", work_dir=str(tmp_path / "run"))
    again = organisms.build(tiny_visual.name, tmp_path / "b")
    reused = organisms.build(tiny_visual.name, tmp_path / "c", work_dir=str(tmp_path / "run"))  # from the kept run
    assert store.verify(str(tmp_path / "a"))["name"] == tiny_visual.name
    assert card["files"] == again["files"] == reused["files"]  # every file, the same bytes
    assert card["accuracy"] == again["accuracy"] and card["training"]["steps"] == 12
    assert len(card["training"]["history"]) == 2
    # the card's numbers are the exported files' answers, re-measured here
    model, processor = vo.load_export(str(tmp_path / "a"))
    examples = shapes.examples(60, shapes.stream("card"))
    scored = vo.score(examples, vo.answers(model, processor, examples))
    assert scored["accuracy"] == card["accuracy"]
    with pytest.raises(ValueError, match="^--out: .* already exists"):
        organisms.build(tiny_visual.name, tmp_path / "a")
