"""Integrations with model libraries (Hugging Face transformers)."""

from .hf_routers import MoeRouter, find_moe_routers

__all__ = ["MoeRouter", "find_moe_routers"]
