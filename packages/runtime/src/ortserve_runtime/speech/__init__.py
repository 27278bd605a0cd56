"""Speech: transcription (Whisper through onnxruntime-genai) and synthesis (Piper voices)."""

from ._synthesis import SpeechChunk, VoiceModel, find_voice_files
from ._transcription import Segment, SpeechModel, Transcription

__all__ = ["Segment", "SpeechChunk", "SpeechModel", "Transcription", "VoiceModel", "find_voice_files"]
