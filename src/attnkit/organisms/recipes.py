"""What an organism is made from: a recipe, a chain of arena runs.

Each stage is one ``attnkit arena`` run (task, its parameters, the training settings,
a length curriculum) that starts from the weights the stage before it ended on, so a
recipe is reproducible by hand as well: ``Recipe.commands()`` prints the arena command
lines it runs. The model's sizes, mechanism and seed are the recipe's, shared by every
stage (a warm start needs the same shapes).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Stage:
    """One arena run: ``task`` with ``params``, trained with ``train`` (TrainConfig
    fields; ``schedule`` as text); ``max_len`` the model's context (None: the arena's
    default). The first stage of a recipe starts from scratch, each later one from the
    weights the one before ended on."""

    name: str
    task: str
    params: dict
    train: dict
    max_len: int | None = None


@dataclass(frozen=True)
class Recipe:
    """An organism: its ``stages``, the model (``mechanism``, sizes, ``seed``), how its card
    is measured (``card_lengths``, ``card_examples`` held-out prompts per length) and
    ``known_failures``: what it is known not to do, each stated with the measurement
    behind it (the card's numbers, measured on the shipped weights, back them)."""

    name: str
    summary: str
    stages: tuple[Stage, ...]
    mechanism: str = "softmax"
    d_model: int = 64
    layers: int = 2
    heads: int = 4
    seed: int = 0
    card_lengths: tuple[int, ...] = ()
    card_examples: int = 500
    known_failures: tuple[str, ...] = field(default_factory=tuple)

    def commands(self) -> list[str]:
        """The arena command lines that build it (``--init`` of each later stage is the
        export of the stage before)."""
        lines = []
        for i, stage in enumerate(self.stages):
            args = [
                "attnkit",
                "arena",
                stage.task,
                "--mechanisms",
                self.mechanism,
                "--d-model",
                str(self.d_model),
                "--layers",
                str(self.layers),
                "--heads",
                str(self.heads),
            ]
            for key, value in stage.params.items():
                args += ["--param", f"{key}={_json(value)}"]
            for key, value in stage.train.items():
                option = "--" + {"target_accuracy": "target", "eval_examples": "eval-examples"}.get(key, key.replace("_", "-"))
                if value is True:
                    args.append(option)
                elif isinstance(value, (list, tuple)):
                    args += [option, ",".join(map(str, value))]
                else:
                    args += [option, "none" if value is None else str(value)]
            if stage.max_len:
                args += ["--max-len", str(stage.max_len)]
            if i:
                args += ["--init", f"{self.stages[i - 1].name}/export"]
            args += ["--out", stage.name, "--export", f"{stage.name}/export"]
            lines.append(shlex.join(args))
        return lines

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "summary": self.summary,
            "mechanism": self.mechanism,
            "d_model": self.d_model,
            "layers": self.layers,
            "heads": self.heads,
            "seed": self.seed,
            "stages": [
                {"name": s.name, "task": s.task, "params": s.params, "train": s.train, "max_len": s.max_len} for s in self.stages
            ],
            "card_lengths": list(self.card_lengths),
            "card_examples": self.card_examples,
        }

    @classmethod
    def from_dict(cls, data: dict, known_failures: tuple[str, ...] = ()) -> Recipe:
        """The recipe ``to_dict`` wrote (a sweep cell carries its recipe this way, so a
        worker needs no registry)."""
        stages = tuple(Stage(s["name"], s["task"], dict(s["params"]), dict(s["train"]), s.get("max_len")) for s in data["stages"])
        return cls(
            name=data["name"],
            summary=data["summary"],
            stages=stages,
            mechanism=data["mechanism"],
            d_model=data["d_model"],
            layers=data["layers"],
            heads=data["heads"],
            seed=data["seed"],
            card_lengths=tuple(data["card_lengths"]),
            card_examples=data["card_examples"],
            known_failures=tuple(known_failures),
        )


def _json(value) -> str:
    import json

    return json.dumps(value, separators=(",", ":")) if not isinstance(value, str) else value


__all__ = ["Recipe", "Stage"]
