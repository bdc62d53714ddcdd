"""The arena: attention mechanisms compared on synthetic tasks with a tiny trainer, reproducibly.

    from attnkit.arena import make_task, run_grid
    rows, runs = run_grid(make_task("mqar"), "softmax,linear_elu", widths=[64], seeds=[0])

``tasks/`` the generators (one file per family), ``models.py`` what reads them,
``trainer.py`` the deterministic trainer, ``runner.py`` the grids and their tables,
``plots.py`` the figures, ``export.py`` (with ``tokenizer.py``) a trained model as a
transformers Llama; ``attnkit arena`` is the command line.
"""

from .export import export, read_task
from .models import MechanismSpec, RetrievalLayer, VectorTransformer, build_model, parse_mechanisms
from .plots import write_plots
from .runner import COLUMNS, format_table, plan, run_grid, write_csv, write_json
from .tasks import TASKS, Batch, Task, make_task
from .tokenizer import Symbols, build_tokenizer, task_symbols
from .trainer import Evaluation, TrainConfig, Trainer, TrainResult

__all__ = [
    "COLUMNS",
    "TASKS",
    "Batch",
    "Evaluation",
    "MechanismSpec",
    "RetrievalLayer",
    "Symbols",
    "Task",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "VectorTransformer",
    "build_model",
    "build_tokenizer",
    "export",
    "format_table",
    "make_task",
    "parse_mechanisms",
    "plan",
    "read_task",
    "run_grid",
    "task_symbols",
    "write_csv",
    "write_json",
    "write_plots",
]
