"""Encoders: embedding and rerank models over one micro-batcher (:class:`~._encoder.BatchedEncoder`)."""

from ._embedding import EmbeddingInput, EmbeddingModel, EmbeddingResult, Pooling
from ._rerank import RerankModel, RerankResult

__all__ = ["EmbeddingInput", "EmbeddingModel", "EmbeddingResult", "Pooling", "RerankModel", "RerankResult"]
