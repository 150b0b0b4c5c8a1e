"""The ground floor: what every room (stages, trainer, pipelines) builds on, importing none of them.

``config``: the typed configs' coercion and validation (``from_dict``, ``to_dict``, dotted overrides, YAML) and
``ConfigError``; ``hashing``: content hashes and canonical JSON; ``filehashes``: file digests remembered across
runs; ``fingerprints``: model fingerprints (config and weight files); ``durable``: writes that survive a crash
(file and folder fsync'd, then renamed into place). ``tests/test_code_rules.py`` keeps this package free of
imports from the rest of latentmill.
"""
