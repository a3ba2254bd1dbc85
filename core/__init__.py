"""The floor everything in rolecall stands on, and which imports nothing above it: model loading and aliases
(:mod:`~rolecall.core.models`), config files (:mod:`~rolecall.core.configfile`), the registry, atomic writes,
token-id checks, process placement (:mod:`~rolecall.core.distributed`) and the role manifest format
(:mod:`~rolecall.core.manifest`). The runtime, calibration, training and the datasets all build on it."""
