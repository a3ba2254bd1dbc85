"""The role manifest: one safetensors file that says which layers and heads of a model need full attention.

==================  ==============================================================================
``format.py``       :class:`RoleManifest`, :class:`ModelIdentity`: the schema, reading, checking, writing
``interop.py``      other formats in and out (DuoAttention patterns, JSON, layer lists), merging
``hub.py``          publishing to and resolving from the Hugging Face Hub
``plots.py``        the role map as a figure (``rolecall inspect --plot``)
==================  ==============================================================================

The names below are the format's, re-exported: ``from rolecall.core.manifest import RoleManifest``.
"""

from rolecall.core.manifest.format import (
    CONTENT_HASH_KEY,
    FORMAT,
    HEAD_ROLE_RETRIEVAL,
    HEAD_ROLE_SPARSE,
    LAYER_ROLE_FULL,
    LAYER_ROLE_SELECT,
    LAYER_ROLE_SPARSE,
    SCHEMA_VERSION,
    ManifestError,
    ManifestMismatchError,
    ModelIdentity,
    RoleManifest,
    UnverifiedManifestError,
    UnverifiedManifestWarning,
    config_sha256,
    content_sha256,
    portable_name,
    read_manifest_file,
    read_metadata,
)

__all__ = ["CONTENT_HASH_KEY", "FORMAT", "HEAD_ROLE_RETRIEVAL", "HEAD_ROLE_SPARSE", "LAYER_ROLE_FULL",
           "LAYER_ROLE_SELECT", "LAYER_ROLE_SPARSE", "SCHEMA_VERSION", "ManifestError", "ManifestMismatchError",
           "ModelIdentity", "RoleManifest", "UnverifiedManifestError", "UnverifiedManifestWarning", "config_sha256",
           "content_sha256", "portable_name", "read_manifest_file", "read_metadata"]
