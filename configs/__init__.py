"""Runnable recipes: one Python file per experiment exposing ``get_config()``."""
