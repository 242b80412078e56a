"""Drop-in integrations with trainer frameworks.

Each integration lives in its own module and imports its framework only when used:

* :mod:`lorasync.integrations.trl`: a ``transformers.TrainerCallback`` that publishes after every
  optimizer step; works for ``transformers.Trainer`` and every TRL trainer (they are Trainers).

May import: every package below the top floor; nothing in lorasync imports it.
"""

__all__: list[str] = []
