"""latentmill: sharded data prep and latent caching on Prefect, a distributed flow-matching trainer.

One import namespace: ``latentmill.stages``, ``latentmill.trainer``, ``latentmill.pipelines`` and the glue in
``latentmill.*``. A wheel installs them inside ``latentmill/``. A repository checkout keeps them as the
top-level folders ``stages/``, ``trainer/``, ``pipelines/`` (and ``configs/``, ``data/``): the checkout's
root joins this package's search path, so the same names import from there, with or without an install.
"""

import logging
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "stages" / "__init__.py").is_file():
    __path__.append(str(_CHECKOUT))  # noqa: F821 (a package's __path__)


class _ExpectedNoise(logging.Filter):
    """Drops log records that tell the user nothing they can act on (kept: everything else)."""

    # transformers warns once per image-processor class that torchvision is missing and that it uses the
    # PIL processor instead: torchvision is not a dependency, and the PIL processor is what we want.
    EXPECTED = ("requires torchvision (not installed); falling back to",)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.EXPECTED)


logging.getLogger("transformers.utils.import_utils").addFilter(_ExpectedNoise())
