"""latentmill: sharded data prep and latent caching on Prefect, a distributed flow-matching trainer."""

import logging


class _ExpectedNoise(logging.Filter):
    """Drops log records that tell the user nothing they can act on (kept: everything else)."""

    # transformers warns once per image-processor class that torchvision is missing and that it uses the
    # PIL processor instead: torchvision is not a dependency, and the PIL processor is what we want.
    EXPECTED = ("requires torchvision (not installed); falling back to",)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.EXPECTED)


logging.getLogger("transformers.utils.import_utils").addFilter(_ExpectedNoise())
