"""``attnkit rerank``: re-rank documents for a query by a causal LM's attention
(ICR, attention sorting, attention-basin order), as a table or JSON.

The documents file is a JSON array of strings (``.json``), JSON Lines of strings or of
objects with a ``"text"`` field (``.jsonl``), or plain text with one document per
non-empty line (anything else).
"""

from __future__ import annotations

import json
import os

from .options import positive_int, read_utf8

METHODS = ("icr", "sorting", "basin")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "rerank",
        help="re-rank documents for a query by a causal LM's attention (ICR, sorting, basin)",
        description="Re-rank documents by the attention a local causal LM pays them: icr (in-context "
        "re-ranking, arXiv 2410.02642: query attention minus a content-free query's), sorting "
        "(attention sorting, arXiv 2310.01427: most attended last, repeated) or basin (the ICR "
        "ranking placed first, last, second, second to last, ...). One prefill of the documents; "
        "only the query rows are computed against the cached keys.",
    )
    p.add_argument("--model", metavar="PATH", required=True, help="local transformers causal LM directory (e.g. an arena export)")
    p.add_argument("--query", metavar="TEXT", required=True, help="the query")
    p.add_argument(
        "--docs",
        metavar="FILE",
        required=True,
        help='documents: .json (array of strings), .jsonl (strings or {"text": ...}) or text, one per line',
    )
    p.add_argument("--method", choices=METHODS, default="icr", help="icr (default), sorting or basin")
    p.add_argument("--prefix", default="", metavar="TEXT", help="text before the documents (default: none)")
    p.add_argument("--separator", default="\n\n", metavar="TEXT", help="text after each document (default: a blank line)")
    p.add_argument(
        "--query-template",
        default="{query}",
        metavar="TEXT",
        help="how the query is written after the documents; must contain {query} (default: {query})",
    )
    p.add_argument("--calibration", default="N/A", metavar="TEXT", help="content-free query for ICR's calibration (default: N/A)")
    p.add_argument("--uncalibrated", action="store_true", help="icr/basin: raw query attention, no calibration pass")
    p.add_argument("--rounds", type=positive_int, default=2, metavar="N", help="sorting: measure-and-sort rounds (default: 2)")
    p.add_argument(
        "--layers",
        metavar="L,...",
        help="sum the attention of these layers only (default: all; needed for models with sliding-window layers)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


def read_documents(path: str) -> list[str]:
    """The documents of ``path``; errors name --docs."""
    text = read_utf8(path, "--docs")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--docs: {path} is not valid JSON ({e})") from None
        if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
            raise ValueError(f"--docs: {path} must hold a JSON array of strings")
        docs = data
    elif ext == ".jsonl":
        docs = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--docs: line {n} of {path} is not valid JSON ({e})") from None
            if isinstance(item, dict) and isinstance(item.get("text"), str):
                item = item["text"]
            if not isinstance(item, str):
                raise ValueError(f'--docs: line {n} of {path} must be a JSON string or an object with a "text" string')
            docs.append(item)
    else:
        docs = [line for line in text.splitlines() if line.strip()]
    if not docs:
        raise ValueError(f"--docs: {path} holds no documents")
    for i, doc in enumerate(docs):
        if not doc.strip():
            raise ValueError(f"--docs: document {i} of {path} is empty")
    return docs


NAMES = {
    "documents": "--docs",
    "query": "--query",
    "method": "--method",
    "rounds": "--rounds",
    "prefix": "--prefix",
    "separator": "--separator",
    "query_template": "--query-template",
    "calibration": "--calibration",
    "model": "--model",
    "layers": "--layers",
    "tokenizer": "--model",
}


def _preview(text: str, width: int = 60) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def run(args) -> int:
    from ..probes import load_probe_model
    from ..steer.rerank import rerank
    from .options import options_named
    from .probe import _quiet_transformers

    documents = read_documents(args.docs)  # before loading the model: a bad file costs nothing
    layers = None
    if args.layers is not None:
        try:
            layers = [int(x) for x in args.layers.split(",")]
        except ValueError:
            raise ValueError(f"--layers: expected comma-separated layer indices, got {args.layers!r}") from None
    with options_named(NAMES), _quiet_transformers():
        pm = load_probe_model(args.model)
        order, scores = rerank(
            pm,
            None,
            args.query,
            documents,
            method=args.method,
            prefix=args.prefix,
            separator=args.separator,
            query_template=args.query_template,
            calibration=args.calibration,
            calibrate=not args.uncalibrated,
            rounds=args.rounds,
            layers=layers,
        )
    if args.json:
        print(
            json.dumps(
                {
                    "method": args.method,
                    "model": pm.name,
                    "query": args.query,
                    "order": order,
                    "scores": scores,
                    "documents": documents,
                }
            )
        )
        return 0
    what = {
        "icr": "ranking, most relevant first",
        "sorting": "context order, most attended last",
        "basin": "context order, most relevant at both ends",
    }[args.method]
    print(f"{args.method} on {pm.name}: {len(documents)} documents ({what})")
    head = ["position", "document", "score", "text"]
    rows = [[str(p + 1), str(d), f"{scores[d]:.6g}", _preview(documents[d])] for p, d in enumerate(order)]
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(4)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return 0
