"""``attnkit inspect --model VLM_DIR --image FILE --prompt TEXT``: a vision-language
model answers, and the report shows where each head looked in the image (the patch
grid overlaid by its attention) and the visual share at every generated token."""

from __future__ import annotations

import io
import json
import os

from .options import options_named, output_dir

#: options of the text report that mean nothing here: refused, not ignored
_TEXT_ONLY = {
    "meters": "--meters",
    "span": "--span",
    "token_heads": "--token-heads",
    "queries": "--queries",
    "max_tokens": "--max-tokens",
}


def run(args, text: str) -> int:
    for name, flag in _TEXT_ONLY.items():
        if getattr(args, name, None):
            raise ValueError(f"{flag}: not used with --image (the image report measures the generated tokens' visual attention)")
    if args.mechanism != "softmax":
        raise ValueError("--mechanism: --image runs the model's own softmax attention")
    if args.model is None:
        raise ValueError("--model: --image needs a local vision-language model directory (or a visual organism's name)")
    from .inspect import parse_indices

    layers, heads = parse_indices(args.layers, "--layers"), parse_indices(args.heads, "--heads")
    output_dir(args.out)
    names = {
        "model": "--model",
        "image": "--image",
        "inputs": "--prompt" if args.prompt is not None else "--text",
        "max_new_tokens": "--max-new-tokens",
        "layers": "--layers",
        "heads": "--heads",
        "top_k": "--top-k",
    }
    with options_named(names):
        return _measure(args, text, layers, heads)


def _measure(args, text: str, layers, heads) -> int:
    from transformers.utils import logging as hf_logging

    from ..inspection.vision_run import inspect_image, load_vlm, read_image
    from ..report.vision import write_vision_report

    hf_logging.disable_progress_bar()
    model, processor = load_vlm(args.model)
    image = read_image(args.image)
    profile = inspect_image(
        model,
        processor,
        image,
        text,
        max_new_tokens=args.max_new_tokens or 16,
        layers=layers,
        heads=heads,
        top_k=min(args.top_k, 64),
    )
    profile.meta["model"] = args.model
    profile.meta["image"] = os.path.basename(args.image)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    paths = write_vision_report(profile, args.out, image_png=buf.getvalue(), title=f"attnkit inspect — {args.model}")
    paths["csv"] = os.path.join(args.out, "profile.csv")
    paths["json"] = os.path.join(args.out, "profile.json")
    profile.to_csv(paths["csv"])
    profile.to_json(paths["json"])
    vis = profile.meta["vision"]
    share = profile.values("visual.share")
    mean = sum(share.values()) / len(share) if share else float("nan")
    if args.json:
        print(
            json.dumps(
                {
                    "report": paths["html"],
                    "csv": paths["csv"],
                    "json": paths["json"],
                    "model": args.model,
                    "tokens": profile.meta["tokens"],
                    "generated": vis["generated"],
                    "steps": vis["steps"],
                    "visual_share": mean,
                    "seconds": profile.meta["seconds"],
                }
            )
        )
        return 0
    print(
        f"{args.model}: {profile.meta['prompt_tokens']} prompt tokens ({sum(i['end'] - i['start'] for i in vis['images'])} image), "
        f"{vis['steps']} generated in {profile.meta['seconds']:.2f} s"
    )
    print(f"answer: {vis['generated']!r}")
    print(f"visual share (mean over heads and generated tokens): {mean:.3f}")
    print(f"profile: {paths['csv']}, {paths['json']}")
    print(f"report: {paths['html']}")
    return 0
