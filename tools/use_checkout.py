"""Imported first by each tool (``import use_checkout``; Python finds it beside the tool): puts this
checkout's megatron_train on the path, installed or not, and imports it, so that a tool started by
a Python without the project's environment (one not activated) says so in one line with exit code 2
(``megatron_train/__init__.py``) instead of ending in an import traceback."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import megatron_train  # noqa: E402, F401
