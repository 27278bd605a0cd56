"""Model files that are not genai folders (GGUF files), turned once into folders the
engines drive and kept in a cache (see DESIGN: "a model file is a source, the folder is
what runs"). Conversion never imports the server; engines never read GGUF."""

from ._cache import cache_root, converted_folder, file_digest
from ._names import CONVERTER_VERSION, GgufError, is_model_file

__all__ = ["CONVERTER_VERSION", "GgufError", "cache_root", "converted_folder", "file_digest", "is_model_file"]
