"""Executing one model: definitions, weights, paged KV, prefix cache, batching, sampling."""
from engines.config import EngineConfig, ModelConfig
from engines.engine import Engine, GenerateOutput
from engines.sampling import SamplingParams
from engines.sequence import SeqStatus, Sequence

__all__ = ["Engine", "EngineConfig", "GenerateOutput", "ModelConfig", "SamplingParams", "SeqStatus", "Sequence"]
