"""Upstream torchtitan against torchtitan_lite on the same model and data
(``scripts/torchtitan_side_by_side.py``). Imports nothing: ``torchtitan_cpu`` runs inside torchtitan's own
environment, where this project's dependencies are not installed."""
