"""hookscope where people train: callbacks that open the Monitor and the NaN tracer on the
model a trainer trains, step them on its real optimizer steps, and log through the trainer's
own loggers as well as hookscope's sinks.

- :mod:`hookscope.integrations.lightning`: a Lightning ``Callback`` (``lightning`` extra);
- :mod:`hookscope.integrations.transformers`: a ``TrainerCallback`` for Hugging Face's
  ``Trainer`` (``transformers`` extra);
- :class:`Maps`: CAM or attention maps of a fixed batch, drawn every few epochs and logged as
  images to the same loggers (either callback's ``maps=``).

Importing this package imports no trainer; ``import hookscope`` does not import it.
"""

from ._maps import Maps

__all__ = ["Maps"]
