"""Model sources that are not genai folders (GGUF files, transformers checkpoints),
turned once into folders the engines drive and kept in a cache (see DESIGN: "a model file
is a source, the folder is what runs"). Conversion never imports the server; engines never
read GGUF; both converters (ours for GGUF, og's builder for checkpoints) run in child
processes."""

from ._cache import cache_root, converted_folder, file_digest
from ._names import CONVERTER_VERSION, GgufError, SourceError, SourceKind, is_model_file, source_kind

__all__ = [
    "CONVERTER_VERSION",
    "GgufError",
    "SourceError",
    "SourceKind",
    "cache_root",
    "converted_folder",
    "file_digest",
    "is_model_file",
    "source_kind",
]
