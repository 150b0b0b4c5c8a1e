"""The ground floor: what every room (stages, trainer, pipelines) builds on, importing none of them.

``latentmill.core.durable``: writes that survive a crash (file and folder fsync'd, then renamed into place).
"""
