"""``attnkit inspect --model DIR`` where DIR is a diffusers pipeline (it holds
``model_index.json``): sample once, write the per-token attention maps report.

The options of this path live here; ``cli/inspect.py`` adds them to its parser and hands
pipeline directories over.
"""

from __future__ import annotations

import json
import re

from .options import nonnegative_float, nonnegative_int, options_named, output_dir, positive_int, read_utf8

#: options of the transformers path that mean nothing for a pipeline, with their defaults
_TRANSFORMERS_ONLY = {
    "meters": None,
    "queries": None,
    "span": None,
    "token_heads": None,
    "max_tokens": None,
    "mechanism": "softmax",
    "top_k": 8,
}
_PIPELINE_ONLY = ("steps", "guidance", "size", "seed", "ranges", "prompt_embeds")


def is_pipeline_dir(path) -> bool:
    """Whether ``--model`` names a diffusers pipeline directory (one holding model_index.json)."""
    from ..inspection.diffusion_run import is_pipeline_dir as holds_model_index  # on use: the CLI's start stays light

    return holds_model_index(path)


def add_arguments(p) -> None:
    g = p.add_argument_group("diffusers pipelines (--model DIR holding model_index.json)")
    g.add_argument("--steps", type=positive_int, metavar="N", help="denoising steps (default: 10)")
    g.add_argument(
        "--guidance", type=nonnegative_float, metavar="G", help="classifier-free guidance scale (default: the pipeline's)"
    )
    g.add_argument("--size", metavar="HxW", help="image height x width in pixels, e.g. 512x512 (default: the pipeline's)")
    g.add_argument("--seed", type=nonnegative_int, metavar="S", help="seed of the initial noise (default: 0)")
    g.add_argument(
        "--ranges", type=positive_int, metavar="K", help="step ranges with maps of their own (default: 2, early and late)"
    )
    g.add_argument(
        "--prompt-embeds",
        metavar="FILE",
        help="safetensors file with prompt_embeds (and negative_prompt_embeds) for a pipeline without a text encoder",
    )


def reject_pipeline_options(args) -> None:
    """For a transformers model: the pipeline-only options are an error, not ignored."""
    for name in _PIPELINE_ONLY:
        if getattr(args, name, None) is not None:
            raise ValueError(
                f"--{name.replace('_', '-')}: only for a diffusers pipeline directory (one holding model_index.json)"
            )


def parse_size(spec: str | None) -> tuple[int, int] | None:
    if spec is None:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", spec)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--size: expected HEIGHTxWIDTH in pixels, e.g. 512x512, got {spec!r}")
    return int(m.group(1)), int(m.group(2))


def run(args) -> int:
    from ..inspection.diffusion_run import DEFAULT_PROMPT

    for name, default in _TRANSFORMERS_ONLY.items():
        if getattr(args, name, default) != default:
            raise ValueError(
                f"--{name.replace('_', '-')}: not available for a diffusers pipeline (it measures per-token cross-attention maps)"
            )
    size = parse_size(args.size)
    if args.prompt_embeds is not None and (args.prompt is not None or args.text is not None):
        raise ValueError("--prompt-embeds: give either --prompt-embeds or a prompt (--prompt/--text), not both")
    prompt = None
    if args.prompt_embeds is None:
        prompt = (
            args.prompt
            if args.prompt is not None
            else (read_utf8(args.text, "--text") if args.text is not None else DEFAULT_PROMPT)
        )
        if not prompt.strip():
            raise ValueError(f"{'--prompt' if args.prompt is not None else '--text'}: the prompt is empty")
    steps = args.steps or 10
    ranges = args.ranges or 2
    if ranges > steps:
        raise ValueError(f"--ranges: {ranges} step ranges need at least as many --steps, got {steps}")
    from .inspect import parse_indices  # not at the top: cli/inspect.py imports this module

    heads = parse_indices(args.heads, "--heads")
    layers = None if args.layers is None else [s.strip() for s in args.layers.split(",") if s.strip()]
    output_dir(args.out)
    names = {
        "model": "--model",
        "layers": "--layers",
        "heads": "--heads",
        "prompt": "--prompt",
        "prompt_embeds": "--prompt-embeds",
        "ranges": "--ranges",
        "guidance": "--guidance",
    }
    with options_named(names):
        return _measure(args, prompt, steps, ranges, size, heads, layers)


def _measure(args, prompt, steps, ranges, size, heads, layers) -> int:
    from ..inspection.diffusion_run import inspect_pipeline, load_local_pipeline, load_prompt_embeds
    from ..report.diffusion import write_token_maps_report
    from .progress import Progress

    embeds = None if args.prompt_embeds is None else load_prompt_embeds(args.prompt_embeds)
    pipeline = load_local_pipeline(args.model)
    progress = Progress(steps, "inspect", enabled=not args.quiet and not args.json)
    result = inspect_pipeline(
        pipeline,
        prompt,
        prompt_embeds=embeds,
        steps=steps,
        guidance=args.guidance,
        size=size,
        seed=args.seed or 0,
        ranges=ranges,
        layers=layers,
        heads=heads,
        progress=progress.step,
    )
    meta = {"model": args.model, **result.meta}
    sections = [("all steps", result.overall)] + [(label, maps) for label, _, maps in result.ranges]
    paths = write_token_maps_report(
        result.tokens, sections, args.out, image=result.image, meta=meta, title=f"attnkit inspect — {args.model}"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "report": paths["html"],
                    "maps": paths.get("maps"),
                    "json": paths["json"],
                    "model": args.model,
                    "tokens": result.tokens,
                    "sections": [label for label, _ in sections],
                    "grid": meta["grid"],
                    "layers": len(meta["layers"]),
                    "seconds": meta["seconds"],
                },
                ensure_ascii=False,
            )
        )
        return 0
    print(
        f"{args.model}: {len(result.tokens)} tokens, {len(meta['layers'])} attention layers, {steps} steps "
        f"in {meta['seconds']:.2f} s; maps {meta['grid'][0]}x{meta['grid'][1]}"
    )
    print(f"report: {paths['html']}")
    if paths.get("maps"):
        print(f"maps: {paths['maps']}, {paths['json']}")
    return 0
