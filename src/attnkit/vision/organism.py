"""The visual organism: a tiny LLaVA trained here on the shapes task (``shapes.py``).

A CLIP vision tower (2 layers, width 64, 4 heads; 8 × 8-pixel patches of a 24 × 24
image, one per grid cell: 9 patch tokens and a class token, which LLaVA drops), LLaVA's
two-layer GELU projector, and a 2-layer Llama (width 64, 4 heads) over a 27-token
word-level vocabulary: transformers' ``LlavaForConditionalGeneration`` from configs,
nothing copied. A prompt is the 9 image placeholders followed by the question's five
words; the model answers with the next token, and training reads the answer's loss at
that one position, plus two auxiliary losses on the projected image features (what each
cell holds, which cell it is) that stand in for a pretrained vision tower.

``attnkit.organisms.build("shapes-vlm", DIR)`` (``organisms/visual.py``) trains it on one
thread (deterministic: the same steps on the same machine give the same bytes), exports
it — ``config.json`` + ``model.safetensors``, a ``LlavaProcessor`` (the PIL CLIP image
processor, no resize: rescale and normalise only, and a WordLevel tokenizer in
``tokenizer.json``; all JSON, nothing fetched), and ``task.json`` (the task's vocabulary
and prompt format) — then measures its card on the exported files loaded as users load
them (``AutoProcessor``, ``AutoModelForImageTextToText``).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from . import shapes

if TYPE_CHECKING:
    import torch

NAME = "shapes-vlm"
PAD, IMAGE = "<pad>", "<image>"
VOCAB = (PAD, IMAGE) + shapes.WORDS
PATCH = 8  # one patch per grid cell
IMAGE_TOKENS = (shapes.IMAGE_SIZE // PATCH) ** 2
TASK_FORMAT = "attnkit.vision.shapes"


@dataclass(frozen=True)
class Settings:
    """Everything that decides the weights (with the machine): sizes, seed, optimisation."""

    width: int = 64
    vision_layers: int = 2
    text_layers: int = 2
    heads: int = 4
    steps: int = 4000
    batch_size: int = 64
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    aux_weight: float = 1.0
    seed: int = 0
    eval_every: int = 250
    eval_examples: int = 300
    card_examples: int = 1200

    def to_dict(self) -> dict:
        return asdict(self)


def _require():
    from ..extras import require

    require("transformers", "the visual organism (attnkit.vision.organism)")


def model_config(settings: Settings = Settings()):
    """The ``LlavaConfig`` of the organism."""
    _require()
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

    w, h = settings.width, settings.heads
    vision = CLIPVisionConfig(
        hidden_size=w,
        intermediate_size=2 * w,
        num_hidden_layers=settings.vision_layers,
        num_attention_heads=h,
        image_size=shapes.IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=w,
    )
    text = LlamaConfig(
        vocab_size=len(VOCAB),
        hidden_size=w,
        intermediate_size=2 * w,
        num_hidden_layers=settings.text_layers,
        num_attention_heads=h,
        num_key_value_heads=h,
        max_position_embeddings=64,
        pad_token_id=VOCAB.index(PAD),
        bos_token_id=None,
        eos_token_id=None,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=VOCAB.index(IMAGE),
        image_seq_length=IMAGE_TOKENS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )


def build_processor():
    """A ``LlavaProcessor``: the PIL CLIP image processor (no resize or crop; pixels / 255,
    then (x - 0.5) / 0.5) and a WordLevel tokenizer over ``VOCAB`` (whitespace split; the
    image placeholder an added special token, so the processor's run of placeholders
    splits into one token each; an unknown word fails to encode)."""
    _require()
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=None))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(PAD, special=True, normalized=False), AddedToken(IMAGE, special=True, normalized=False)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )
    size = {"height": shapes.IMAGE_SIZE, "width": shapes.IMAGE_SIZE}
    images = CLIPImageProcessorPil(
        size=size,
        crop_size=size,
        do_resize=False,
        do_center_crop=False,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
        do_convert_rgb=True,
    )
    return LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE,
    )


def task_description() -> dict:
    """task.json: how prompts are written and scored (the visual probe reads it)."""
    return {
        "format": TASK_FORMAT,
        "version": 1,
        "task": "shapes",
        "grid": shapes.GRID,
        "cell": shapes.CELL,
        "image_size": shapes.IMAGE_SIZE,
        "colours": list(shapes.COLOURS),
        "shapes": list(shapes.SHAPES),
        "positions": list(shapes.POSITIONS),
        "kinds": list(shapes.KINDS),
        "vocabulary": list(VOCAB),
        "prompt": f"{IMAGE} QUESTION (the processor expands {IMAGE} to {IMAGE_TOKENS} placeholders); "
        "the answer is the next token",
        "examples": {
            "presence": "is there a red circle",
            "colour": "what color is the circle",
            "position": "where is the red circle",
        },
    }


def pixels(images) -> torch.Tensor:
    """uint8 (N, H, W, 3) images -> the model's float pixel values, as the processor makes them."""
    import torch

    x = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    return (x * (1 / 255) - 0.5) / 0.5


def token_ids(questions) -> torch.Tensor:
    import torch

    index = {t: i for i, t in enumerate(VOCAB)}
    rows = [[index[IMAGE]] * IMAGE_TOKENS + [index[w] for w in q.split()] for q in questions]
    if len({len(r) for r in rows}) != 1:
        raise ValueError("questions: the training batch expects questions of one length")
    return torch.tensor(rows)


def answer_ids(answers) -> torch.Tensor:
    import torch

    return torch.tensor([VOCAB.index(a) for a in answers])


#: what each patch (grid cell) holds, the vision tower's auxiliary target: 0 empty, then (colour, shape) pairs
CELL_CLASSES = 1 + len(shapes.COLOURS) * len(shapes.SHAPES)


def cell_labels(examples) -> torch.Tensor:
    """(N, cells) long: per grid cell, 0 when empty, else 1 + colour * len(SHAPES) + shape."""
    import torch

    colours = list(shapes.COLOURS)
    out = torch.zeros(len(examples), shapes.GRID * shapes.GRID, dtype=torch.long)
    for i, e in enumerate(examples):
        for o in e.objects:
            out[i, o.cell] = 1 + colours.index(o.colour) * len(shapes.SHAPES) + shapes.SHAPES.index(o.shape)
    return out


def _train_batch(step: int, settings: Settings):
    # one seed sequence per step: the batch of step s is the same whatever ran before it
    rng_seed = [shapes.STREAMS["train"], settings.seed, step]
    batch = shapes.examples(settings.batch_size, rng_seed)
    return (
        pixels([e.image for e in batch]),
        token_ids([e.question for e in batch]),
        answer_ids([e.answer for e in batch]),
        cell_labels(batch),
    )


def accuracy_by_kind(model, examples, batch_size: int = 150) -> dict:
    """Answer accuracy per question kind of ``model`` (training layout: the batch built
    here, not by the processor) on ``examples``."""
    import torch

    right: dict[str, list[int]] = {k: [0, 0] for k in shapes.KINDS}
    with torch.inference_mode():
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            logits = model(
                input_ids=token_ids([e.question for e in chunk]), pixel_values=pixels([e.image for e in chunk])
            ).logits[:, -1]
            guess = logits.argmax(-1).tolist()
            for e, g in zip(chunk, guess):
                right[e.kind][0] += VOCAB[g] == e.answer
                right[e.kind][1] += 1
    return {k: r / n for k, (r, n) in right.items() if n}


def train(settings: Settings = Settings(), on_eval=None):
    """The trained ``LlavaForConditionalGeneration`` and its training record. One thread,
    AdamW with linear warm-up and cosine decay; the loss is the cross-entropy of the
    answer token plus ``aux_weight`` times two auxiliary cross-entropies on the projected
    image features (what each cell holds, which cell it is; heads not exported)."""
    _require()
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(settings, on_eval)
    finally:
        torch.set_num_threads(threads)


def _train(settings: Settings, on_eval):
    import torch
    from transformers import LlavaForConditionalGeneration

    torch.manual_seed(settings.seed)
    model = LlavaForConditionalGeneration(model_config(settings))
    model.train()
    # The auxiliary heads read the projected image features (what the language model sees): what each cell holds
    # and which cell it is. They stand in for a pretrained vision tower (LLaVA starts from CLIP's): trained on the
    # answers alone, the tower learned no shapes and no positions (4x4 patches: position 0.06-0.17 over 1500 steps;
    # 8x8 patches: 0.06-0.21 over 1250; colour 0.67-0.74, the scene's colours not bound to the asked shape). With
    # them every kind passed 0.95 by step 1250. They are not exported.
    aux = torch.nn.ModuleDict(
        {
            "content": torch.nn.Linear(settings.width, CELL_CLASSES),
            "cell": torch.nn.Linear(settings.width, shapes.GRID * shapes.GRID),
        }
    )
    captured: dict[str, torch.Tensor] = {}
    hook = model.model.multi_modal_projector.register_forward_hook(lambda mod, inp, out: captured.__setitem__("features", out))
    cells = torch.arange(IMAGE_TOKENS)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2] + [p for p in aux.parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2] + [p for p in aux.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step):
        if step < settings.warmup:
            return (step + 1) / settings.warmup
        t = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    held_out = shapes.examples(settings.eval_examples, [shapes.STREAMS["train"], settings.seed, 1 << 30])
    history, seconds, losses = [], 0.0, []
    for step in range(settings.steps):
        x, ids, y, labels = _train_batch(step, settings)
        start = time.perf_counter()
        logits = model(input_ids=ids, pixel_values=x).logits[:, -1]
        features = captured.pop("features")  # (B, cells, width)
        loss = torch.nn.functional.cross_entropy(logits, y)
        aux_loss = torch.nn.functional.cross_entropy(
            aux["content"](features).flatten(0, 1), labels.flatten()
        ) + torch.nn.functional.cross_entropy(aux["cell"](features).flatten(0, 1), cells.repeat(len(labels)))
        loss = loss + settings.aux_weight * aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        seconds += time.perf_counter() - start
        losses.append(loss.item())
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            model.eval()
            record = {
                "step": step + 1,
                "loss": float(np.mean(losses)),
                "seconds": round(seconds, 1),
                "accuracy": accuracy_by_kind(model, held_out),
            }
            model.train()
            losses = []
            history.append(record)
            if on_eval is not None:
                on_eval(record)
    hook.remove()
    model.eval()
    return model, {"steps": settings.steps, "seconds": round(seconds, 1), "history": history}


def save_trained(model, record: dict, settings: Settings, directory: str) -> None:
    """A finished training run: the weights (safetensors) and training.json beside them."""
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(directory)
    with open(os.path.join(directory, "training.json"), "w", encoding="utf-8") as f:
        json.dump({"settings": settings.to_dict(), **record}, f, indent=1)


def load_trained(directory: str):
    """The model ``save_trained`` wrote (safetensors only; float32, eval mode)."""
    _require()
    import torch
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(directory, local_files_only=True, dtype=torch.float32).eval()


def export(model, directory: str) -> None:
    """The organism as users load it: config.json, model.safetensors, generation_config.json,
    the processor's JSON files and task.json (no directory may exist there yet)."""
    import torch

    os.makedirs(directory)
    # a freshly trained model and one reloaded from a training run write the same config.json (a reload records
    # the sub-configs' dtype, a fresh model only the top one's)
    for config in (model.config, model.config.text_config, model.config.vision_config):
        config.dtype = torch.float32
    model.save_pretrained(directory)
    build_processor().save_pretrained(directory)
    with open(os.path.join(directory, "task.json"), "w", encoding="utf-8") as f:
        json.dump(task_description(), f, indent=1)
        f.write("\n")


def load_export(directory: str):
    """(model, processor) of an exported organism, offline, float32, eval mode."""
    _require()
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
    model = AutoModelForImageTextToText.from_pretrained(directory, local_files_only=True, dtype=torch.float32).eval()
    return model, processor


def prompt(question: str) -> str:
    """The text given to the processor with one image (it expands the placeholder)."""
    return f"{IMAGE} {question}"


def answers(model, processor, examples, batch_size: int = 100) -> list[str]:
    """The model's answer word to each example, the inputs made by ``processor`` as a user would."""
    import torch

    out = []
    vocab = processor.tokenizer.convert_ids_to_tokens(list(range(len(processor.tokenizer))))
    with torch.inference_mode():
        for i in range(0, len(examples), batch_size):
            chunk = examples[i : i + batch_size]
            inputs = processor(
                images=[e.image for e in chunk], text=[prompt(e.question) for e in chunk], return_tensors="pt", padding=True
            )
            logits = model(**inputs).logits[:, -1]
            out += [vocab[j] for j in logits.argmax(-1).tolist()]
    return out


def score(examples, said) -> dict:
    """accuracy per kind with groups, and the presence rates, of answers ``said`` to ``examples``."""
    cells: dict[str, dict[str, list[int]]] = {k: {} for k in shapes.KINDS}
    for e, a in zip(examples, said):
        if e.kind == "presence":
            group = "absent near miss" if e.near_miss else "absent other" if e.absent else "present"
        else:
            group = f"{len(e.objects)} object" + ("s" if len(e.objects) > 1 else "")
        cell = cells[e.kind].setdefault(group, [0, 0])
        cell[0] += a == e.answer
        cell[1] += 1
    accuracy = {}
    for kind, groups in cells.items():
        if not groups:
            continue
        right, n = sum(c[0] for c in groups.values()), sum(c[1] for c in groups.values())
        accuracy[kind] = {
            "accuracy": round(right / n, 4),
            "counted": n,
            "groups": {g: round(c[0] / c[1], 4) for g, c in sorted(groups.items())},
            "group_counts": {g: c[1] for g, c in sorted(groups.items())},
        }

    def yes_rate(select):
        picked = [a == "yes" for e, a in zip(examples, said) if e.kind == "presence" and select(e)]
        return round(sum(picked) / len(picked), 4) if picked else float("nan")

    presence = {
        "yes_present": yes_rate(lambda e: not e.absent),
        "yes_absent": yes_rate(lambda e: e.absent),
        "yes_absent_near": yes_rate(lambda e: e.absent and e.near_miss),
        "yes_absent_far": yes_rate(lambda e: e.absent and not e.near_miss),
        "counts": {
            "present": sum(e.kind == "presence" and not e.absent for e in examples),
            "absent": sum(e.absent for e in examples),
        },
    }
    return {"accuracy": accuracy, "presence": presence}


def measure(directory: str, n: int, stream: str = "card") -> dict:
    """The card's numbers: the export in ``directory`` loaded as users load it, asked
    ``n`` held-out questions of ``stream`` (kinds in equal shares)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, processor = load_export(directory)
        examples = shapes.examples(n, shapes.stream(stream))
        scored = score(examples, answers(model, processor, examples))
    finally:
        torch.set_num_threads(threads)
    worst = min(((g_acc, kind, g) for kind, e in scored["accuracy"].items() for g, g_acc in e["groups"].items()))
    return {
        "evaluation": {
            "examples": n,
            "per_kind": n // len(shapes.KINDS),
            "stream": stream,
            "images": "fresh scenes of 1-3 objects (distinct shapes, distinct cells), shape offsets and "
            "pixel noise drawn per image; presence questions half about present objects, "
            "the absent ones drawn 3 times in 4 from the near misses (colour or "
            "shape in the scene, not the pair), else from every absent pair",
            "loaded_as": "transformers AutoProcessor + AutoModelForImageTextToText, float32",
        },
        **scored,
        "worst": {"kind": worst[1], "group": worst[2], "accuracy": worst[0]},
    }


def model_info(model, settings: Settings) -> dict:
    return {
        "architecture": "LlavaForConditionalGeneration",
        "vision": f"CLIP vision tower, {settings.vision_layers} layers, width {settings.width}, {settings.heads} heads, "
        f"{PATCH}x{PATCH} patches of a {shapes.IMAGE_SIZE}x{shapes.IMAGE_SIZE} image",
        "projector": "2-layer MLP (GELU)",
        "text": f"Llama, {settings.text_layers} layers, width {settings.width}, {settings.heads} heads, "
        f"{len(VOCAB)}-token vocabulary",
        "d_model": settings.width,
        "layers": settings.text_layers,
        "vision_layers": settings.vision_layers,
        "heads": settings.heads,
        "image_tokens": IMAGE_TOKENS,
        "max_len": IMAGE_TOKENS + 5,
        "vocab_size": len(VOCAB),
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(
        description="train the visual organism (the weights and training.json; attnkit organisms build exports and cards it)"
    )
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=Settings.steps)
    args = p.parse_args(argv)
    settings = Settings(steps=args.steps)
    start = time.perf_counter()
    model, record = train(settings, on_eval=lambda r: print(json.dumps(r), flush=True))
    record["wall_seconds"] = round(time.perf_counter() - start, 1)
    save_trained(model, record, settings, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
