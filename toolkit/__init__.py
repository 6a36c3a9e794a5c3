"""Curriculum fine-tuning of LLMs and multimodal LLMs on HuggingFace Accelerate."""

__version__ = "0.1.0"
